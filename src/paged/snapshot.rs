//! Snapshots of one sequence of a paged pool: its committed rows gathered through its page table
//! into the bytes of [`crate::snapshot`], and a snapshot restored as a new sequence.

use std::borrow::Cow;
use std::io::{Read, Write};

use super::ledger::PagedPlan;
use super::{PageLedger, PagedCache, page_ranges};
use crate::cache::{HostRows, Rows, SlotRows, StagedRows, pump, write_slots};
use crate::error::{Error, Result};
use crate::seq::SeqId;
use crate::snapshot::{RowSink, Snapshot, SnapshotHeader, SnapshotStream, SnapshotWriter};

impl PagedCache {
    /// Writes a snapshot of the committed rows of `seq` to `out` (as [`crate::KvCache::export_async`]:
    /// pending rows are not part of it) and returns its length in bytes. Each slot's rows are
    /// gathered from the sequence's pages on the GPU and read back in one map, one slot at a time.
    /// Submit any encoder holding recorded appends to `seq` first: a recorded append that gives it a
    /// private copy of a shared page moves it to the new page at once, and the copy fills the page
    /// only when that encoder runs.
    pub async fn export_sequence_async<W: Write + ?Sized>(
        &self,
        seq: SeqId,
        out: &mut W,
    ) -> Result<u64> {
        let len = self.ledger.len(seq)?;
        let pages = self.ledger.pages(seq)?;
        self.store.check_usable()?;
        // Each slot's rows through the sequence's pages.
        let mut slots = Vec::new();
        for layer in 0..self.spec.n_layers() {
            for slot in 0..self.spec.layers()[layer].slots.len() {
                let view = self.store.slot_view(layer, slot, true)?;
                slots.push(SlotRows {
                    layer,
                    slot,
                    buffer: view.buffer,
                    ranges: page_ranges(pages, self.page_size(), len, view.row_bytes),
                });
            }
        }
        let mut writer = SnapshotWriter::new(out, &self.spec, len, self.page_size())?;
        write_slots(self.device(), self.queue(), &mut writer, &slots).await?;
        writer.finish()
    }

    /// A snapshot of `seq` (see [`PagedCache::export_sequence_async`]) in one `Vec`.
    /// A snapshot the host cannot hold in one allocation (on wasm32, past 2 GiB) is refused with
    /// [`Error::OutOfMemory`]; [`PagedCache::export_sequence_async`] streams to any writer instead.
    pub async fn snapshot_sequence_async(&self, seq: SeqId) -> Result<Vec<u8>> {
        let mut bytes = crate::snapshot::SnapshotBytes::default();
        let exported = self.export_sequence_async(seq, &mut bytes).await;
        bytes.finish(exported)
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
    /// first — the bytes ([`Error::Snapshot`](crate::Error::Snapshot)), the pages and the longest sequence (as
    /// [`PagedCache::admits`]: [`Error::OutOfPages`](crate::Error::OutOfPages), [`Error::CapacityExceeded`](crate::Error::CapacityExceeded)) and the page
    /// table ([`Error::TooManySequences`](crate::Error::TooManySequences)) — and a refusal changes nothing. The rows reach the GPU
    /// at the next queue submission, like host appends (natively checked for memory above 4 MiB).
    /// As for [`crate::KvCache::import`], a write wgpu still cannot stage after that check
    /// ([`Error::OutOfMemory`](crate::Error::OutOfMemory)) leaves the rows written before it in
    /// pages that stay free.
    pub fn import_sequence(&mut self, bytes: &[u8]) -> Result<SeqId> {
        self.reclaim();
        let snap = Snapshot::parse_for(bytes, &self.spec)?;
        let plan = self.plan_import(snap.header.len)?;
        let jobs: Vec<HostRows<'_, '_>> = plan
            .plans
            .iter()
            .map(|p| HostRows {
                layer: p.layer,
                rows: Rows::Stored(&snap.sections[p.layer]),
                runs: Cow::Borrowed(&p.runs),
            })
            .collect();
        // The table row and the staging are checked before a row is taken, which may grow the
        // table, so a refusal leaves the table as it was. A table that grew took memory: the
        // staging is checked again. Where the rows still cannot be written, nothing is committed,
        // and the row and the table go back ([`PagedCache::with_table_row`]).
        self.check_table_row()?;
        self.store.check_snapshot_rows(&jobs)?;
        let capacity = self.row_capacity;
        let row = self
            .with_table_row(|pool, row| {
                if pool.row_capacity != capacity {
                    pool.store.check_snapshot_rows(&jobs)?;
                }
                pool.store.write_snapshot_rows(&jobs).map(|()| row)
            })
            // A row the table could not give keeps no conversion memory either.
            .inspect_err(|_| self.store.trim_scratch())?;
        Ok(self.commit_import(plan, row))
    }

    /// [`PagedCache::import_sequence`] of a snapshot that arrives in pieces:
    /// [`SequenceImport::push`] each piece, then [`SequenceImport::finish`] (as
    /// [`crate::KvCache::import_stream`]: the rows wait in GPU staging buffers until the whole
    /// checks out, and a snapshot that is incompatible, needs more pages than are free or finds
    /// every page-table row taken is refused as soon as its header arrives).
    pub fn import_sequence_stream(&mut self) -> SequenceImport<'_> {
        self.reclaim();
        SequenceImport {
            stream: SnapshotStream::new(&self.spec),
            pool: self,
            staged: None,
            plan: None,
        }
    }

    /// [`PagedCache::import_sequence_stream`] from a reader (a file), in pieces of 1 MiB.
    pub fn import_sequence_from(&mut self, reader: impl Read) -> Result<SeqId> {
        let mut import = self.import_sequence_stream();
        pump(reader, |piece| import.push(piece))?;
        import.finish()
    }

    /// A new sequence of `len` rows in every layer with slots, planned on a copy of the ledger
    /// (admission, pages, the longest sequence), which replaces it once the rows are written.
    fn plan_import(&self, len: usize) -> Result<ImportPlan> {
        self.store.check_usable()?;
        let mut ledger = self.ledger.clone();
        let seq = ledger.add()?;
        // The id is the copy's: a refusal names no sequence of the pool.
        ledger.admits(&[(seq, len)]).map_err(|mut e| {
            if let Error::CapacityExceeded { seq, .. } = &mut e {
                *seq = None;
            }
            e
        })?;
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
        Ok(ImportPlan { ledger, seq, plans })
    }

    /// Installs a planned import whose rows are written, in table row `row`.
    fn commit_import(&mut self, plan: ImportPlan, row: usize) -> SeqId {
        self.ledger = plan.ledger;
        self.table_rows.insert(plan.seq, super::TableRow::new(row));
        self.write_table(plan.seq, 0, None);
        plan.seq
    }
}

/// A checked import: the ledger with the new sequence, and where its rows go.
struct ImportPlan {
    ledger: PageLedger,
    seq: SeqId,
    plans: Vec<PagedPlan>,
}

/// A snapshot being restored as a new pool sequence piece by piece
/// ([`PagedCache::import_sequence_stream`]).
pub struct SequenceImport<'p> {
    pool: &'p mut PagedCache,
    stream: SnapshotStream,
    staged: Option<StagedRows>,
    plan: Option<ImportPlan>,
}

impl std::fmt::Debug for SequenceImport<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SequenceImport").finish_non_exhaustive()
    }
}

impl SequenceImport<'_> {
    /// Takes the next piece of the snapshot. A refusal is final: every later call repeats it, the
    /// pool is unchanged, and the rows staged so far (and the plan made for them) are let go at
    /// once.
    pub fn push(&mut self, piece: &[u8]) -> Result<()> {
        let mut sink = PoolSink {
            pool: self.pool,
            staged: &mut self.staged,
            plan: &mut self.plan,
        };
        self.stream.push(piece, &mut sink).inspect_err(|_| {
            self.staged = None;
            self.plan = None;
        })
    }

    /// Checks the length and the checksum of the whole, then copies the staged rows into fresh
    /// pages (in a submission of its own) and returns the new sequence.
    pub fn finish(self) -> Result<SeqId> {
        let header = self.stream.finish()?;
        let plan = match self.plan {
            Some(plan) => {
                // Planned when the header came; a slot buffer may have been destroyed since.
                self.pool.store.check_usable()?;
                plan
            }
            None => self.pool.plan_import(header.len)?,
        };
        let row = self.pool.take_table_row()?;
        if let Some(mut staged) = self.staged {
            staged.flush();
            let mut encoder = self.pool.encoder("kvgpu snapshot import");
            for p in &plan.plans {
                for slot in 0..self.pool.spec.layers()[p.layer].slots.len() {
                    if let Some(buffer) = staged.buffer(p.layer, slot) {
                        self.pool
                            .store
                            .record_staged(&mut encoder, p.layer, slot, &p.runs, buffer);
                    }
                }
            }
            self.pool.queue().submit([encoder.finish()]);
        }
        Ok(self.pool.commit_import(plan, row))
    }
}

struct PoolSink<'a> {
    pool: &'a PagedCache,
    staged: &'a mut Option<StagedRows>,
    plan: &'a mut Option<ImportPlan>,
}

impl RowSink for PoolSink<'_> {
    fn header(&mut self, header: &SnapshotHeader) -> Result<()> {
        let plan = self.pool.plan_import(header.len)?;
        // A full page table is refused here, before any row is staged (the stream holds the pool,
        // so no sequence takes a row before `finish`).
        self.pool.check_table_row()?;
        *self.plan = Some(plan);
        *self.staged = Some(StagedRows::new(
            self.pool.device(),
            self.pool.queue(),
            header,
        )?);
        Ok(())
    }

    fn rows(&mut self, layer: usize, slot: usize, offset: u64, bytes: &[u8]) -> Result<()> {
        match self.staged {
            Some(staged) => staged.rows(layer, slot, offset, bytes),
            None => Ok(()),
        }
    }
}
