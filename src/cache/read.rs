//! Views of slot buffers for the app's own kernels, and readback to the host.

use std::sync::atomic::Ordering;

use super::{KvCache, SlotView};
use crate::codec::decode_scaled_rows;
use crate::device::read_ranges;
use crate::error::{Error, Result};

impl KvCache {
    /// The visible rows of a slot, for the app's own kernels.
    ///
    /// The view holds the slot's `wgpu::Buffer`, which the app must not destroy. Natively a
    /// destroyed slot buffer is found: every later call that uses the slot is refused with
    /// [`Error::UnusableSlot`] (asking costs about 0.5-2 us per viewed slot and call on CPU adapters;
    /// slots never viewed are not asked). In a browser WebGPU does not say, and reports it at submit.
    pub fn view(&self, layer: usize, slot: usize) -> Result<SlotView<'_>> {
        self.handed_out(layer, slot, false)
    }

    /// The whole capacity of a slot, visible or not: the escape hatch (as [`KvCache::view`]).
    pub fn full_view(&self, layer: usize, slot: usize) -> Result<SlotView<'_>> {
        self.handed_out(layer, slot, true)
    }

    /// A view for the app: from now on the slot is asked whether it was destroyed before each use.
    fn handed_out(&self, layer: usize, slot: usize, full: bool) -> Result<SlotView<'_>> {
        let view = self.slot_view(layer, slot, full)?;
        self.slots[layer][slot]
            .viewed
            .store(true, Ordering::Relaxed);
        Ok(view)
    }

    /// A view for kvgpu's own reads, after [`KvCache::check_layer_usable`] or the like.
    pub(crate) fn slot_view(&self, layer: usize, slot: usize, full: bool) -> Result<SlotView<'_>> {
        let sb = self.slot_buffer(layer, slot)?;
        let rows = if full {
            self.capacity()
        } else {
            self.ledger.visible(layer)?
        };
        Ok(SlotView {
            buffer: &sb.buffer,
            offset: 0,
            size: sb.placement.offset(rows),
            rows,
            row_bytes: sb.placement.row_bytes,
        })
    }

    async fn read_slot_words(&self, layer: usize, slot: usize, full: bool) -> Result<Vec<u32>> {
        let view = self.slot_view(layer, slot, full)?;
        self.read_range_words(layer, slot, &[(view.offset, view.size)])
            .await
    }

    /// The words of byte ranges `(offset, size)` of a slot buffer, one after the other, in one
    /// readback (a paged sequence's rows, page by page). Each range lies inside the slot buffer and
    /// holds whole words.
    pub(crate) async fn read_range_words(
        &self,
        layer: usize,
        slot: usize,
        ranges: &[(u64, u64)],
    ) -> Result<Vec<u32>> {
        let buffer = &self.slot_buffer(layer, slot)?.buffer;
        self.check_slot_usable(layer, slot)?;
        read_ranges(&self.device, &self.queue, buffer, ranges)
            .await
            .map_err(|failure| {
                failure.or(|reason| Error::Readback {
                    layer,
                    slot,
                    reason,
                })
            })
    }

    /// The visible rows of a slot as stored: 32-bit words, 16-bit types packed, rows padded.
    pub async fn read_words_async(&self, layer: usize, slot: usize) -> Result<Vec<u32>> {
        self.read_slot_words(layer, slot, false).await
    }

    /// Every word of a slot buffer, visible or not.
    pub async fn read_full_words_async(&self, layer: usize, slot: usize) -> Result<Vec<u32>> {
        self.read_slot_words(layer, slot, true).await
    }

    /// The visible rows of a slot as f32, `[visible, ...trailing]` row-major, padding removed.
    pub async fn read_f32_async(&self, layer: usize, slot: usize) -> Result<Vec<f32>> {
        let words = self.read_words_async(layer, slot).await?;
        let sb = self.slot_buffer(layer, slot)?;
        decoded(&words, sb.dtype, sb.row_elems, sb.scale)
    }

    /// [`KvCache::read_words_async`], blocking.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn read_words(&self, layer: usize, slot: usize) -> Result<Vec<u32>> {
        pollster::block_on(self.read_words_async(layer, slot))
    }

    /// [`KvCache::read_full_words_async`], blocking.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn read_full_words(&self, layer: usize, slot: usize) -> Result<Vec<u32>> {
        pollster::block_on(self.read_full_words_async(layer, slot))
    }

    /// [`KvCache::read_f32_async`], blocking.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn read_f32(&self, layer: usize, slot: usize) -> Result<Vec<f32>> {
        pollster::block_on(self.read_f32_async(layer, slot))
    }
}

/// The f32 values of whole stored rows read back ([`decode_scaled_rows`]), or
/// [`Error::OutOfMemory`] where this process cannot allocate them (rows are never empty, so an
/// empty result of words is that).
pub(crate) fn decoded(
    words: &[u32],
    dtype: crate::codec::DType,
    row_elems: usize,
    scale: Option<f32>,
) -> Result<Vec<f32>> {
    let values = decode_scaled_rows(words, dtype, row_elems, scale);
    if values.is_empty() && !words.is_empty() {
        let row_words = crate::codec::packed_row_words(dtype, row_elems).max(1) as u64;
        let bytes = (words.len() as u64 / row_words).saturating_mul(4 * row_elems as u64);
        return Err(Error::OutOfMemory {
            what: "the f32 values of the rows read back (host memory)".into(),
            bytes,
            reason: "this process could not allocate them".into(),
        });
    }
    Ok(values)
}
