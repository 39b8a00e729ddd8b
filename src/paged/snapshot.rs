//! Snapshots of one sequence of a paged pool: its committed rows gathered through its page table
//! into the bytes of [`crate::snapshot`], and a snapshot restored as a new sequence.

use std::io::Write;

use super::PagedCache;
use crate::device::read_ranges;
use crate::error::{Error, Result};
use crate::seq::SeqId;
use crate::snapshot::{Snapshot, SnapshotWriter};

impl PagedCache {
    /// Writes a snapshot of the committed rows of `seq` to `out` (as [`crate::KvCache::export_async`]:
    /// pending rows are not part of it) and returns its length in bytes. Each slot's rows are
    /// gathered from the sequence's pages on the GPU and read back in one map, one slot at a time.
    pub async fn export_sequence_async<W: Write + ?Sized>(
        &self,
        seq: SeqId,
        out: &mut W,
    ) -> Result<u64> {
        let len = self.ledger.len(seq)?;
        let pages = self.ledger.pages(seq)?;
        let p = self.page_size();
        let mut writer = SnapshotWriter::new(out, &self.spec, len, p)?;
        for layer in 0..self.spec.n_layers() {
            for slot in 0..self.spec.layers()[layer].slots.len() {
                let view = self.store.full_view(layer, slot)?;
                let row_bytes = view.row_bytes;
                let ranges: Vec<(u64, u64)> = (0..len.div_ceil(p))
                    .map(|i| {
                        let rows = (len - i * p).min(p) as u64;
                        let first = pages[i] as u64 * p as u64;
                        (first * row_bytes, rows * row_bytes)
                    })
                    .collect();
                let rows = read_ranges(self.device(), self.queue(), view.buffer, &ranges)
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

    /// A snapshot of `seq` (see [`PagedCache::export_sequence_async`]) in one `Vec`.
    pub async fn snapshot_sequence_async(&self, seq: SeqId) -> Result<Vec<u8>> {
        let mut bytes = Vec::new();
        self.export_sequence_async(seq, &mut bytes).await?;
        Ok(bytes)
    }

    /// [`PagedCache::export_sequence_async`], blocking.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn export_sequence<W: Write + ?Sized>(&self, seq: SeqId, out: &mut W) -> Result<u64> {
        pollster::block_on(self.export_sequence_async(seq, out))
    }

    /// [`PagedCache::snapshot_sequence_async`], blocking.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn snapshot_sequence(&self, seq: SeqId) -> Result<Vec<u8>> {
        pollster::block_on(self.snapshot_sequence_async(seq))
    }

    /// Restores a snapshot (of a pool's sequence or of a single-sequence cache; the page size may
    /// differ) as a new sequence of fresh pages, holding its rows bit for bit. Everything is checked
    /// first — the bytes ([`Error::Snapshot`]), the pages and the longest sequence (as
    /// [`PagedCache::admits`]: [`Error::OutOfPages`], [`Error::CapacityExceeded`]) and the page
    /// table ([`Error::TooManySequences`]) — and a refusal changes nothing. The rows reach the GPU
    /// at the next queue submission, like host appends.
    pub fn import_sequence(&mut self, bytes: &[u8]) -> Result<SeqId> {
        let snap = Snapshot::parse_for(bytes, &self.spec)?;
        let len = snap.header.len;
        // Planned on a copy of the ledger, which replaces it once everything is written.
        let mut ledger = self.ledger.clone();
        let seq = ledger.add()?;
        ledger.admits(&[(seq, len)])?;
        let mut plans = Vec::new();
        for (layer, spec) in self.spec.layers().iter().enumerate() {
            if spec.slots.is_empty() {
                continue;
            }
            let shapes: Vec<Vec<usize>> = spec
                .slots
                .iter()
                .map(|s| [&[len][..], &s.trailing].concat())
                .collect();
            let plan = ledger.plan_append(seq, layer, shapes.len(), |s| &shapes[s])?;
            ledger.commit_append(&plan);
            plans.push(plan);
        }
        ledger.advance(seq, len)?;
        let row = self.take_table_row()?;
        for plan in &plans {
            for (slot, rows) in snap.sections[plan.layer].iter().enumerate() {
                self.store.write_stored(plan.layer, slot, &plan.runs, rows);
            }
        }
        self.ledger = ledger;
        self.table_rows.insert(seq, row);
        self.write_table(seq, 0);
        Ok(seq)
    }
}
