//! A streamed snapshot's rows on their way into a cache: kept in GPU staging buffers, one per
//! slot, until the whole snapshot checks out, then copied into place by the caller.

use super::SNAPSHOT_ROWS;
use crate::codec::{padded_row_bytes, used_row_bytes};
use crate::error::Result;
use crate::kernels::{allocated, check_staging};
use crate::snapshot::SnapshotHeader;
use crate::spec::SlotSpec;

/// Host bytes gathered before a `write_buffer` into staging (whole words), and the bytes written
/// between two flushing submissions (which let wgpu release its own copies of them).
const STAGE_PIECE: usize = 1 << 20;
const SUBMIT_EVERY: u64 = 16 << 20;

/// A streamed snapshot's rows, kept in one GPU staging buffer per slot until the snapshot checks
/// out. Row padding is written as zeros.
pub(crate) struct StagedRows {
    device: wgpu::Device,
    queue: wgpu::Queue,
    /// Per layer, per slot: its staging buffer (none for no rows), row bytes and element bytes.
    buffers: Vec<Vec<(Option<wgpu::Buffer>, usize, usize)>>,
    /// Bytes not yet written, of slot `at.0, at.1` from byte `at.2`.
    pending: Vec<u8>,
    at: (usize, usize, u64),
    unsubmitted: u64,
}

impl StagedRows {
    /// Staging for `header`'s rows, or [`Error::OutOfMemory`] where the device cannot hold them.
    pub(crate) fn new(
        device: &wgpu::Device,
        queue: &wgpu::Queue,
        header: &SnapshotHeader,
    ) -> Result<Self> {
        let spec = &header.spec;
        let row_bytes = |slot: &SlotSpec| padded_row_bytes(slot.row_elems(), spec.dtype_of(slot));
        let total = spec
            .layers()
            .iter()
            .flat_map(|layer| &layer.slots)
            .map(|slot| row_bytes(slot) * header.len as u64)
            .sum();
        let buffers = allocated(device, "a snapshot's staging buffers", total, || {
            spec.layers()
                .iter()
                .map(|layer| {
                    layer
                        .slots
                        .iter()
                        .map(|slot| {
                            let size = row_bytes(slot) * header.len as u64;
                            let buffer = (size > 0).then(|| {
                                device.create_buffer(&wgpu::BufferDescriptor {
                                    label: Some("kvgpu snapshot staging"),
                                    size,
                                    usage: wgpu::BufferUsages::COPY_DST
                                        | wgpu::BufferUsages::COPY_SRC,
                                    mapped_at_creation: false,
                                })
                            });
                            let used =
                                used_row_bytes(slot.row_elems(), spec.dtype_of(slot)) as usize;
                            (buffer, row_bytes(slot) as usize, used)
                        })
                        .collect()
                })
                .collect()
        })?;
        Ok(Self {
            device: device.clone(),
            queue: queue.clone(),
            buffers,
            pending: Vec::new(),
            at: (0, 0, 0),
            unsubmitted: 0,
        })
    }

    pub(crate) fn buffer(&self, layer: usize, slot: usize) -> Option<&wgpu::Buffer> {
        self.buffers.get(layer)?.get(slot)?.0.as_ref()
    }

    /// Bytes `[offset, offset + bytes.len())` of a slot's rows; pieces arrive in order. Where the
    /// pending bytes come to more than 4 MiB (an app's large piece), natively the device is first
    /// checked to stage them ([`check_staging`]): [`crate::Error::OutOfMemory`], with nothing
    /// written, where it cannot.
    pub(crate) fn rows(
        &mut self,
        layer: usize,
        slot: usize,
        offset: u64,
        bytes: &[u8],
    ) -> Result<()> {
        let (l, s, at) = self.at;
        if (l, s) != (layer, slot) || at + self.pending.len() as u64 != offset {
            self.flush();
            self.at = (layer, slot, offset);
        }
        self.pending.extend_from_slice(bytes);
        if self.pending.len() >= STAGE_PIECE {
            let n = self.pending.len() & !3;
            check_staging(&self.device, SNAPSHOT_ROWS, n as u64)?;
            self.write(n);
        }
        Ok(())
    }

    /// Writes every pending byte (a slot's rows end on a whole word).
    pub(crate) fn flush(&mut self) {
        debug_assert!(self.pending.len().is_multiple_of(4));
        self.write(self.pending.len() & !3);
        self.pending.clear();
    }

    /// Writes the first `n` pending bytes (a multiple of 4), padding zeroed.
    fn write(&mut self, n: usize) {
        let (layer, slot, at) = self.at;
        let Some((Some(buffer), row_bytes, used)) =
            self.buffers.get(layer).and_then(|l| l.get(slot))
        else {
            return;
        };
        if n == 0 {
            return;
        }
        zero_padding(&mut self.pending[..n], at, *row_bytes as u64, *used as u64);
        self.queue.write_buffer(buffer, at, &self.pending[..n]);
        self.pending.drain(..n);
        self.at.2 += n as u64;
        self.unsubmitted += n as u64;
        if self.unsubmitted >= SUBMIT_EVERY {
            self.queue.submit(std::iter::empty());
            self.unsubmitted = 0;
        }
    }
}

/// Zeroes the padding (bytes `used..row_bytes` of each row) in `bytes`, the slot's bytes from byte
/// `at`, which may start and end inside a row.
fn zero_padding(bytes: &mut [u8], at: u64, row_bytes: u64, used: u64) {
    if used >= row_bytes {
        return;
    }
    let end = at + bytes.len() as u64;
    let mut row = at - at % row_bytes;
    while row < end {
        let (lo, hi) = ((row + used).max(at), (row + row_bytes).min(end));
        if lo < hi {
            bytes[(lo - at) as usize..(hi - at) as usize].fill(0);
        }
        row += row_bytes;
    }
}

/// In the browser the staging buffers are destroyed with the rows, so that their memory (as large
/// as the snapshot's rows) goes at a refusal or after `finish`, not at the page's garbage
/// collection: wgpu 30 does not destroy a dropped WebGPU buffer. Every copy out of them was
/// submitted by then (`finish` submits its own encoder), and a destroyed buffer outlives the work
/// submitted before. Natively a drop frees them already (see `device::Staging`).
impl Drop for StagedRows {
    fn drop(&mut self) {
        #[cfg(target_arch = "wasm32")]
        for buffer in self
            .buffers
            .iter()
            .flatten()
            .filter_map(|(b, _, _)| b.as_ref())
        {
            buffer.destroy();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::zero_padding;

    /// Rows of 12 bytes, 10 used, seen through every window of the slot's bytes (starting and
    /// ending anywhere, inside a row or on one): exactly the padding bytes are zeroed.
    #[test]
    fn padding_is_zeroed_in_any_window_of_the_rows() {
        let (row_bytes, used) = (12u64, 10u64);
        let total = 5 * row_bytes;
        for at in 0..total {
            for end in at..=total {
                let mut bytes = vec![0xffu8; (end - at) as usize];
                zero_padding(&mut bytes, at, row_bytes, used);
                for (i, &b) in bytes.iter().enumerate() {
                    let padding = (at + i as u64) % row_bytes >= used;
                    assert_eq!(b == 0, padding, "bytes {at}..{end}, byte {}", at + i as u64);
                }
            }
        }
        let mut whole = vec![0xffu8; 8];
        zero_padding(&mut whole, 4, 8, 8);
        assert_eq!(whole, [0xff; 8], "rows without padding");
    }
}
