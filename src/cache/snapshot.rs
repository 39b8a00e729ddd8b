//! Snapshots of a single-sequence cache: its committed rows exported as the bytes of
//! [`crate::snapshot`], and restored into an empty cache of a compatible spec.

use std::io::Write;

use super::KvCache;
use crate::device::read_range;
use crate::error::{Error, Result, SnapshotProblem};
use crate::placement::Run;
use crate::snapshot::{Snapshot, SnapshotWriter};

impl KvCache {
    /// Writes a snapshot of the committed rows to `out` and returns its length in bytes. Pending
    /// rows of the current step are not part of it. The rows are read back one slot at a time, so
    /// besides what `out` keeps at most one slot's committed rows are held on the host.
    pub async fn export_async<W: Write + ?Sized>(&self, out: &mut W) -> Result<u64> {
        let len = self.len();
        let mut writer = SnapshotWriter::new(out, &self.spec, len, 0)?;
        for (layer, slots) in self.slots.iter().enumerate() {
            for (slot, sb) in slots.iter().enumerate() {
                let size = sb.placement.offset(len);
                let rows = read_range(&self.device, &self.queue, &sb.buffer, 0, size)
                    .await
                    .map_err(|reason| Error::Readback {
                        layer,
                        slot,
                        reason,
                    })?;
                writer.rows(&rows)?;
            }
        }
        writer.finish()
    }

    /// A snapshot of the committed rows (see [`KvCache::export_async`]) in one `Vec`.
    pub async fn snapshot_async(&self) -> Result<Vec<u8>> {
        let mut bytes = Vec::new();
        self.export_async(&mut bytes).await?;
        Ok(bytes)
    }

    /// [`KvCache::export_async`], blocking.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn export<W: Write + ?Sized>(&self, out: &mut W) -> Result<u64> {
        pollster::block_on(self.export_async(out))
    }

    /// [`KvCache::snapshot_async`], blocking.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn snapshot(&self) -> Result<Vec<u8>> {
        pollster::block_on(self.snapshot_async())
    }

    /// Restores a snapshot into this cache, which must be empty (no committed or pending rows):
    /// afterwards it holds the snapshot's rows, bit for bit, and its length. Everything is checked
    /// first — the bytes ([`Error::Snapshot`]: truncated, corrupt, another version, another
    /// storage type or shape, a cache that is not empty) and the capacity
    /// ([`Error::CapacityExceeded`]) — and a refusal changes nothing. The rows reach the GPU at the
    /// next queue submission, like host appends. Returns the rows restored.
    pub fn import(&mut self, bytes: &[u8]) -> Result<usize> {
        let snap = Snapshot::parse_for(bytes, &self.spec)?;
        let pending = (0..self.spec.n_layers())
            .filter_map(|l| self.ledger.pending(l).ok())
            .max()
            .unwrap_or(0);
        if !self.is_empty() || pending > 0 {
            return Err(Error::Snapshot {
                problem: SnapshotProblem::NotEmpty {
                    len: self.len(),
                    pending,
                },
            });
        }
        let len = snap.header.len;
        let shapes: Vec<Vec<Vec<usize>>> = self
            .spec
            .layers()
            .iter()
            .map(|l| {
                l.slots
                    .iter()
                    .map(|s| [&[len][..], &s.trailing].concat())
                    .collect()
            })
            .collect();
        let plans = (0..self.spec.n_layers())
            .filter(|&l| !shapes[l].is_empty())
            .map(|l| {
                self.ledger
                    .plan_append_with(l, shapes[l].len(), |s| &shapes[l][s])
            })
            .collect::<Result<Vec<_>>>()?;
        for plan in plans {
            let [run] = plan.runs();
            for (slot, rows) in snap.sections[plan.layer].iter().enumerate() {
                self.write_stored(plan.layer, slot, &[(0, run)], rows);
            }
            self.ledger.commit_append(plan);
        }
        self.ledger.advance(len)?;
        Ok(len)
    }

    /// Writes stored rows (the layout of [`KvCache::read_words_async`]) into `runs` of a slot
    /// buffer (`(first row of rows, run)`), with any row padding written as zeros.
    pub(crate) fn write_stored(
        &mut self,
        layer: usize,
        slot: usize,
        runs: &[(usize, Run)],
        rows: &[u8],
    ) {
        let sb = &self.slots[layer][slot];
        let row_bytes = sb.placement.row_bytes as usize;
        let used = sb.row_elems * self.spec.dtype().size();
        let rows = if used < row_bytes {
            self.scratch.clear();
            self.scratch.extend_from_slice(rows);
            for row in self.scratch.chunks_exact_mut(row_bytes) {
                row[used..].fill(0);
            }
            &self.scratch[..]
        } else {
            rows
        };
        for (first, run) in runs.iter().filter(|(_, run)| run.n_rows > 0) {
            let (offset, size) = sb.placement.bytes(run);
            let from = first * row_bytes;
            self.queue
                .write_buffer(&sb.buffer, offset, &rows[from..from + size as usize]);
        }
    }
}
