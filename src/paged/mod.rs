//! The paged pool of many sequences, [`PagedCache`].

mod ledger;
mod snapshot;

use std::borrow::Cow;
use std::sync::{Arc, Mutex, PoisonError, Weak};

use crate::cache::{GpuSlab, HOST_ROWS, HostRows, HostSlab, KvCache, Rows, SlotView};
use crate::error::{Error, Result};
use crate::kernels::{Kernels, Upload, check_staging};
use crate::ledger::slab_rows;
use crate::placement::{Paging, Run};
use crate::seq::SeqId;
use crate::spec::{CacheSpec, DeviceLimits};
pub use ledger::PageLedger;
use ledger::{PageCopy, PagedPlan};
pub use snapshot::SequenceImport;
use std::collections::BTreeMap;

/// A paged pool of many sequences: per (layer, slot) one pool buffer of `n_pages` pages of
/// `page_size` token rows, a [`PageLedger`] that owns the free list, the page tables, the reference
/// counts of shared pages and every sequence's length, and the commands that carry out its plans.
///
/// The pool's buffers are the slot buffers of an inner [`KvCache`] whose capacity is the pool's rows
/// (its own ledger is unused): row placement, host and GPU sources, conversion and the device checks
/// are the single-sequence cache's, applied to the runs a plan gives. Every operation is checked in
/// full by the ledger before anything is written or recorded, and a refusal changes nothing (but
/// for what finished encoders held, which every call returns to the pool first:
/// [`PagedCache::reclaim`]).
///
/// Ordering, as for [`KvCache`]: host appends reach the GPU at the next queue submission, ahead of the
/// commands submitted with it. A host append into a page shared after a fork first submits the copy
/// that gives the writer its private page, so the copy sees every earlier host append and every
/// command submitted before it. A recorded GPU append into a shared page records its copy, and the
/// pool keeps the shared page for it until the encoder is done (below). Submit an encoder holding
/// GPU appends to a sequence before host appends to it or its forks once it has been forked or
/// truncated: the host append's private copy of a shared (or held, below) page and its table entry
/// land first, so the copy lacks the recorded append's rows, or the recorded append's table entry,
/// copied later, points the sequence back at the shared page. The table entries a
/// recorded GPU append changes are copied into the table by a command recorded with it, so they
/// change where the append stands in its encoder: an
/// attention recorded before the append reads the pages it was recorded against, one recorded after
/// it the append's (a host append's entries, like its rows, land ahead of the next submission).
/// An encoder recorded over a sequence (attention over it, or GPU appends to it) reads and writes
/// its pages and its table row when it runs, so the sequence is held for the encoder until the
/// encoder's work is done: a `remove` or `truncate` (or a scrubbing form) meanwhile pins every page
/// of the sequence, each as one more holder ([`PageLedger::page_refs`]), with the rows the sequence
/// saw there, and keeps its table row out of reuse (a truncated sequence moves to a fresh row).
/// Until the encoder is done no other sequence gets those pages or that row, their zeroing waits,
/// and every write into those rows (a fork's that still shares a page, or the truncated sequence's
/// own as it grows again) goes into a private copy: the encoder reads and writes what it was
/// recorded against. A truncation that drops no row holds nothing.
///
/// The shared page a recorded GPU append copies is read when the encoder runs, so the pool keeps
/// it, as one more holder, until the encoder's work is done. Meanwhile
/// a holder that writes into the rows the copy reads (after a `truncate` into them), or into a page
/// whose zeroing waits for the copy, writes into a private copy of its own (other writes go into
/// the page, as before), and when its other
/// holders let it go (`remove` or `truncate` of the parent or a sibling, an eviction of the
/// published prefix holding it, or their scrubbing forms) it stays out of the pool, and a scrub
/// waits for it. wgpu reports the encoder done once its work has finished (natively at a later
/// poll or submission, in the browser from the event loop), or when the encoder is dropped
/// unsubmitted; the pool's next call after that, or [`PagedCache::reclaim`], returns the page
/// (zeroed first where a scrub waited, in a submission of its own), and so it returns the pages
/// and table rows kept for a sequence the encoder held. Until then [`PagedCache::free_pages`] and
/// [`PagedCache::admits`] count such pages as in use, and they are neither cached nor evictable.
/// An app that removes sequences after it has read the step's results (a poll) keeps nothing.
///
/// An encoder holding recorded GPU appends must be submitted. The ledger counts a recorded append
/// as made, and its rows, the copy of a shared page it writes into and the table entries of the
/// pages it takes are commands of that encoder; no later call writes those entries again. If the
/// encoder is dropped, [`PagedCache::remove`] the sequences it appended to (truncating them does not
/// repair their table): attention over them would read pages the ledger has not given them.
pub struct PagedCache {
    /// The pool's buffers: a cache of `page_size · n_pages` rows whose ledger stays empty.
    store: KvCache,
    spec: CacheSpec,
    ledger: PageLedger,
    /// One page of the widest slot, for copies between pages of one buffer (which wgpu refuses to
    /// copy directly); made on the first copy.
    staging: Option<wgpu::Buffer>,
    /// The page tables attention reads: one row of `table_width` entries per sequence, entry `i`
    /// holding the sequence's page `i`. Entries change only where a sequence's pages changed: with
    /// `Queue::write_buffer` for host calls, by a recorded copy for recorded GPU appends.
    table: wgpu::Buffer,
    /// The tables this one replaced as it grew, with their rows: commands recorded before a growth
    /// read them, so the entries of the rows they hold are written into them too, by host calls
    /// (landing ahead of the next submission there as well) and by recorded GPU appends (a copy
    /// into each, recorded with the one into the table). Kept for the pool's life: each holds half
    /// the rows of the next, so together fewer than twice the table's.
    retired: Vec<(wgpu::Buffer, usize)>,
    table_width: usize,
    /// The table row of each sequence, and the rows free for reuse.
    table_rows: BTreeMap<SeqId, TableRow>,
    free_rows: Vec<usize>,
    /// What sequences let go while encoders recorded over them were not done: kept until they are.
    released: Vec<Released>,
    /// Rows the table buffer holds, and the most one storage binding holds.
    row_capacity: usize,
    most_rows: usize,
    scatter: ScatterChoice,
    /// Pages pinned by recorded copies whose encoders are done (their work finished, or the encoder
    /// was dropped unsubmitted): filled by wgpu's callbacks, unpinned at the pool's next change
    /// ([`PagedCache::reclaim`]).
    unpinned: Arc<Mutex<Vec<u32>>>,
}

/// A sequence's table row, and the tokens of the encoders recorded over the sequence
/// ([`PagedCache::hold_until_done`]).
struct TableRow {
    row: usize,
    tokens: Tokens,
}

impl TableRow {
    fn new(row: usize) -> Self {
        Self {
            row,
            tokens: Tokens::default(),
        }
    }
}

/// The token each encoder recorded over a sequence holds until its work is done (`now`), and the
/// tokens of the table rows a truncation moved the sequence from (`before`, each held by its
/// [`Released`] and its encoders), whose encoders read the pages the sequence kept too.
#[derive(Default)]
struct Tokens {
    now: Arc<()>,
    before: Vec<Weak<()>>,
}

impl Tokens {
    /// Whether an encoder recorded over the sequence, through this row or an earlier one, may not
    /// be done yet.
    fn held(&self) -> bool {
        Arc::strong_count(&self.now) > 1 || self.before.iter().any(|t| t.strong_count() > 1)
    }

    /// Whether every encoder holding these tokens is done: `now` is held here alone, and the
    /// earlier tokens by their [`Released`] at most.
    fn done(&self) -> bool {
        Arc::strong_count(&self.now) == 1 && self.before.iter().all(|t| t.strong_count() <= 1)
    }

    /// The tokens of a fresh row that these tokens' sequence moves to: the earlier ones still held,
    /// and this row's.
    fn moved(&self) -> Self {
        let before = self.before.iter().filter(|t| t.strong_count() > 1).cloned();
        Self {
            now: Arc::default(),
            before: before.chain([Arc::downgrade(&self.now)]).collect(),
        }
    }
}

/// The pages and the table row a removal or truncation took from a sequence while encoders recorded
/// over it were not done (the tokens they hold): pinned ([`PageLedger::hold`]) and kept out of
/// reuse until they are.
struct Released {
    tokens: Tokens,
    pages: Vec<u32>,
    row: usize,
}

/// The pages a recorded encoder's copies read, pinned in the ledger ([`PageLedger::pin`]) until the
/// encoder is done with them: wgpu drops this once the encoder's work has finished, or with the
/// encoder (or its command buffer) if it is never submitted.
struct Pins {
    pages: Vec<u32>,
    done: Arc<Mutex<Vec<u32>>>,
    /// The tokens of the sequences the encoder appends to ([`PagedCache::hold_until_done`]).
    _sequences: Vec<Arc<()>>,
}

impl Drop for Pins {
    fn drop(&mut self) {
        let mut done = self.done.lock().unwrap_or_else(PoisonError::into_inner);
        done.append(&mut self.pages);
    }
}

/// How an append's rows reach their pages; see [`PagedCache::set_scatter`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ScatterChoice {
    /// Per call, whichever moves the rows with less overhead on this adapter (see the README).
    #[default]
    Auto,
    /// One scattered dispatch per slot for every append that has rows (a GPU source that can only
    /// be copied still moves run by run).
    Always,
    /// Run by run: `Queue::write_buffer`, or one copy or slab-write dispatch, per run of a page.
    Never,
}

/// `Auto`: runs above which host rows are uploaded once and scattered, on a GPU, or uploaded once and
/// copied into their pages run by run, on a CPU adapter (where a dispatch costs about a hundred
/// copies, and each `write_buffer` makes a staging buffer of its own).
const HOST_RUNS: usize = 8;
/// `Auto`: runs above which GPU rows that could be copied run by run are scattered instead, on a
/// GPU and on a CPU adapter (where one dispatch costs about a hundred copies). GPU rows that need the
/// slab-write kernel anyway are scattered whenever they make more than one run.
const COPY_RUNS_GPU: usize = 16;
const COPY_RUNS_CPU: usize = 128;

/// The runs of `plans` that move rows (`(first slab row, run)`), in slab order.
fn moving_runs(plans: &[PagedPlan]) -> Vec<(usize, Run)> {
    plans
        .iter()
        .flat_map(|p| p.runs.iter().copied())
        .filter(|(_, run)| run.n_rows > 0)
        .collect()
}

/// The encoder of a recorded commit and the upload its table entries go through.
type Recorded<'e> = (&'e mut wgpu::CommandEncoder, Upload);

/// The first table entry that committing `plan` changes, for a sequence of `held` pages: a private
/// copy's, or the first new page's.
fn changed_from(plan: &PagedPlan, held: usize) -> usize {
    plan.copies.iter().map(|c| c.index).fold(held, usize::min)
}

/// Where the first `rows` rows of a sequence holding `pages` lie in a slot of `row_bytes`-byte rows:
/// `(byte offset, bytes)` per page, in order.
fn page_ranges(pages: &[u32], page_size: usize, rows: usize, row_bytes: u64) -> Vec<(u64, u64)> {
    (0..rows.div_ceil(page_size))
        .map(|i| {
            let n = (rows - i * page_size).min(page_size) as u64;
            let first = pages[i] as u64 * page_size as u64;
            (first * row_bytes, n * row_bytes)
        })
        .collect()
}

/// The pool row of each of a slab's `rows` rows, from the runs (`(first slab row, run)`) covering
/// them. Pool rows fit a u32: the pool fits one binding.
fn row_map(rows: usize, runs: &[(usize, Run)]) -> Vec<u32> {
    let mut map = vec![0; rows];
    for &(first, run) in runs {
        for i in 0..run.n_rows {
            map[first + i] = (run.first_row + i) as u32;
        }
    }
    map
}

/// Table rows of a new pool; the table doubles when more sequences need one.
const FIRST_TABLE_ROWS: usize = 8;

impl std::fmt::Debug for PagedCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PagedCache")
            .field("pool", &self.ledger.pool())
            .field("dtype", &self.spec.dtype())
            .field("layers", &self.spec.n_layers())
            .field("page_size", &self.ledger.page_size())
            .field("n_pages", &self.ledger.n_pages())
            .field("free_pages", &self.ledger.free_pages())
            .field("sequences", &self.ledger.sequences().count())
            .field("table_capacity", &self.row_capacity)
            .finish_non_exhaustive()
    }
}

impl PagedCache {
    /// A pool of `n_pages` pages of `page_size` rows for the layers and storage type of `spec`, whose
    /// `max_seq_len` bounds one sequence. Each (layer, slot) pool must fit one storage binding: a
    /// larger pool is refused with [`Error::PoolTooLarge`], which names the most pages that fit.
    pub fn new(
        device: &wgpu::Device,
        queue: &wgpu::Queue,
        spec: CacheSpec,
        page_size: usize,
        n_pages: usize,
    ) -> Result<Self> {
        Self::with_kernels(Kernels::new(device, queue)?, spec, page_size, n_pages)
    }

    /// [`PagedCache::new`] with the kernel registry of its device.
    pub fn with_kernels(
        kernels: Arc<Kernels>,
        spec: CacheSpec,
        page_size: usize,
        n_pages: usize,
    ) -> Result<Self> {
        let empty = Error::EmptyPool { page_size, n_pages };
        if page_size == 0 || n_pages == 0 {
            return Err(empty);
        }
        let limits = DeviceLimits::from_wgpu(&kernels.device().limits());
        let too_large = |layer: usize, slot: usize, row_bytes: u64| Error::PoolTooLarge {
            layer,
            slot,
            n_pages,
            page_size,
            row_bytes,
            limit: limits.max_slot_bytes(),
            max_pages: usize::try_from(limits.max_slot_bytes() / row_bytes).unwrap_or(usize::MAX)
                / page_size,
        };
        let Some(rows) = page_size.checked_mul(n_pages) else {
            return Err(widest(&spec).map_or(empty, |(l, s, b)| too_large(l, s, b)));
        };
        let pool =
            CacheSpec::new(spec.layers().to_vec(), spec.dtype(), rows).map_err(|e| {
                match (&e, widest(&spec)) {
                    (Error::InvalidSpec { .. }, Some((l, s, b))) => too_large(l, s, b),
                    _ => e,
                }
            })?;
        pool.check_limits(&limits).map_err(|e| match e {
            Error::SlotTooLarge {
                layer,
                slot,
                row_bytes,
                ..
            } => too_large(layer, slot, row_bytes),
            e => e,
        })?;
        let mut store = KvCache::with_kernels(kernels, pool)?;
        let ledger = PageLedger::new(&spec, page_size, n_pages);
        // A sequence holds at most every page of the pool: a table row has room for that many, so
        // one row fits a binding whenever the pool does.
        let table_width = spec.max_seq_len().div_ceil(page_size).min(n_pages).max(1);
        let most_rows = usize::try_from(limits.max_slot_bytes() / (table_width as u64 * 4))
            .unwrap_or(usize::MAX);
        if most_rows == 0 {
            return Err(Error::TooManySequences { most: 0 });
        }
        let first_rows = FIRST_TABLE_ROWS.min(most_rows);
        let table = table_buffer(store.device(), table_width, first_rows)?;
        store.set_page_table(table.clone());
        Ok(Self {
            store,
            spec,
            ledger,
            staging: None,
            table,
            retired: Vec::new(),
            table_width,
            table_rows: BTreeMap::new(),
            free_rows: Vec::new(),
            released: Vec::new(),
            row_capacity: first_rows,
            most_rows,
            scatter: ScatterChoice::Auto,
            unpinned: Arc::default(),
        })
    }

    /// The cache whose slot buffers hold the pool's pages.
    pub(crate) fn store(&self) -> &KvCache {
        &self.store
    }

    /// Where the rows of `seq` lie, for attention.
    pub(crate) fn paging(&self, seq: SeqId) -> Result<Paging> {
        self.ledger.check_pool(seq)?;
        let row = self
            .table_rows
            .get(&seq)
            .ok_or(Error::UnknownSequence { seq })?
            .row;
        Ok(Paging {
            page_size: self.page_size(),
            table_base: row * self.table_width,
            n_pages: self.n_pages(),
        })
    }

    /// Whether a sequence can get a table row: a free one, or room to grow the table within the
    /// device's binding limit ([`Error::TooManySequences`] otherwise). Changes nothing.
    fn check_table_row(&self) -> Result<()> {
        if self.free_rows.is_empty() && self.busy_rows() == self.most_rows {
            return Err(Error::TooManySequences {
                most: self.most_rows,
            });
        }
        Ok(())
    }

    /// Table rows in use: the sequences', and those kept for encoders ([`Released`]). With no free
    /// row, they are rows `0..busy_rows()`.
    fn busy_rows(&self) -> usize {
        self.table_rows.len() + self.released.len()
    }

    /// A table row for a new sequence, growing the table when every row is taken. The grown table
    /// is written whole from the ledger with `Queue::write_buffer`, not copied from the old one on
    /// the GPU: a recorded GPU append not yet submitted writes its entries into the old table, and
    /// the new one must hold them too. The old table is retired, not dropped: commands recorded
    /// before the growth read it, and later host-side entries go into it too
    /// ([`PagedCache::write_table`]).
    fn take_table_row(&mut self) -> Result<usize> {
        self.check_table_row()?;
        if let Some(row) = self.free_rows.pop() {
            return Ok(row);
        }
        let row = self.busy_rows();
        if row == self.row_capacity {
            let rows = (self.row_capacity * 2).min(self.most_rows);
            let table = table_buffer(self.device(), self.table_width, rows)?;
            let mut entries = vec![0u32; self.table_width * self.row_capacity];
            check_staging(self.device(), TABLE, 4 * entries.len() as u64)?;
            for (&seq, row) in &self.table_rows {
                let pages = self.ledger.pages(seq).unwrap_or_default();
                let at = row.row * self.table_width;
                entries[at..at + pages.len()].copy_from_slice(pages);
            }
            self.queue()
                .write_buffer(&table, 0, bytemuck::cast_slice(&entries));
            self.store.set_page_table(table.clone());
            let old = std::mem::replace(&mut self.table, table);
            self.retired.push((old, self.row_capacity));
            self.row_capacity = rows;
        }
        Ok(row)
    }

    /// The table and every retired one that holds table row `row`.
    fn tables_holding(&self, row: usize) -> impl Iterator<Item = &wgpu::Buffer> {
        let retired = self.retired.iter().filter(move |(_, rows)| row < *rows);
        std::iter::once(&self.table).chain(retired.map(|(table, _)| table))
    }

    /// Writes the table entries of `seq` from page index `from` to its end: with
    /// `Queue::write_buffer` (landing at the next submission, ahead of its commands), into the
    /// table and every retired one that holds the sequence's row (commands recorded before the
    /// table grew read those: without it, one recorded over a sequence before a growth read its
    /// page from before a later host append copied it, and the rows that page's other holder wrote
    /// there next), or, for a
    /// recorded GPU append, through an upload reserved for them ([`PagedCache::table_uploads`]) and
    /// a copy recorded into its encoder (into the table and each retired one that holds the row), so
    /// that the commands recorded before the append still read the entries they were recorded
    /// against.
    fn write_table(&mut self, seq: SeqId, from: usize, recorded: Option<Recorded<'_>>) {
        let (Some(row), Ok(pages)) = (self.table_rows.get(&seq), self.ledger.pages(seq)) else {
            return;
        };
        let row = row.row;
        if from < pages.len() {
            let at = ((row * self.table_width + from) * 4) as u64;
            let bytes: &[u8] = bytemuck::cast_slice(&pages[from..]);
            match recorded {
                Some((encoder, upload)) => {
                    upload.write(self.store.queue(), bytes);
                    let size = bytes.len() as u64;
                    for table in self.tables_holding(row) {
                        encoder.copy_buffer_to_buffer(
                            &upload.buffer,
                            upload.offset,
                            table,
                            at,
                            size,
                        );
                    }
                }
                None => {
                    for table in self.tables_holding(row) {
                        self.queue().write_buffer(table, at, bytes);
                    }
                }
            }
        }
    }

    /// The uploads that recorded commits of `plans`, in order, write their table entries through
    /// ([`PagedCache::write_table`]): each from the first entry its commit changes (a private
    /// copy's, or the first new page's) to its sequence's end. Reserved before anything is
    /// recorded, so that a device that cannot hold them refuses the call ([`Error::OutOfMemory`])
    /// with nothing recorded.
    fn table_uploads(&mut self, plans: &[PagedPlan]) -> Result<Vec<Upload>> {
        // Pages each sequence holds when its plan commits: a batch may append to one twice.
        let mut held = BTreeMap::new();
        let mut uploads = Vec::with_capacity(plans.len());
        for plan in plans {
            let pages = held
                .entry(plan.seq)
                .or_insert_with(|| self.ledger.pages(plan.seq).map_or(0, <[u32]>::len));
            let entries = *pages + plan.fresh.len() - changed_from(plan, *pages);
            *pages += plan.fresh.len();
            uploads.push(
                self.store
                    .reserve_upload("a page table's entries", 4 * entries as u64)?,
            );
        }
        Ok(uploads)
    }

    /// How appends move their rows into pages: run by run, or by one scattered dispatch per slot
    /// from one upload of the rows and a destination-row map ([`ScatterChoice::Auto`] by default).
    /// Both store the same bits; the choice is only a matter of speed.
    pub fn set_scatter(&mut self, choice: ScatterChoice) {
        self.scatter = choice;
    }

    /// How appends move rows ([`PagedCache::set_scatter`]).
    pub fn scatter(&self) -> ScatterChoice {
        self.scatter
    }

    /// The layers, storage type and longest sequence.
    pub fn spec(&self) -> &CacheSpec {
        &self.spec
    }

    /// The host bookkeeping: pages, page tables, lengths, pending rows.
    pub fn ledger(&self) -> &PageLedger {
        &self.ledger
    }

    /// The device that holds the pool's buffers.
    pub fn device(&self) -> &wgpu::Device {
        self.store.device()
    }

    /// The queue the pool writes host rows and submits its own commands through.
    pub fn queue(&self) -> &wgpu::Queue {
        self.store.queue()
    }

    /// The kernel registry this pool records with.
    pub fn kernels(&self) -> &Arc<Kernels> {
        self.store.kernels()
    }

    /// Rows per page.
    pub fn page_size(&self) -> usize {
        self.ledger.page_size()
    }

    /// Pages in the pool, free or not.
    pub fn n_pages(&self) -> usize {
        self.ledger.n_pages()
    }

    /// Pages that neither a sequence nor a published prefix holds, which appends and imports take.
    /// A page a recorded GPU append copies, or one a removal or truncation kept for an encoder
    /// recorded over its sequence, is held until the pool's first call after the encoder is done
    /// (see [`PagedCache`]).
    pub fn free_pages(&self) -> usize {
        self.ledger.free_pages()
    }

    /// Pages that are not free: held by a sequence, a published prefix or an encoder (see
    /// [`PagedCache`]), the published pages no sequence holds ([`PagedCache::cached_pages`])
    /// included.
    pub fn pages_in_use(&self) -> usize {
        self.ledger.pages_in_use()
    }

    /// A new, empty sequence; it takes pages as it is written.
    pub fn add_sequence(&mut self) -> Result<SeqId> {
        self.open_sequence(|l| l.add().map(|seq| (seq, ())))
            .map(|(seq, ())| seq)
    }

    /// Runs `open` with a table row for a new sequence ([`PagedCache::take_table_row`]). When `open`
    /// refuses, the row goes back, and a table grown for it is let go for the old one: a refusal
    /// keeps no new memory. A row past the old table is not put among the free ones (the next
    /// sequence takes it again, and grows the table then).
    fn with_table_row<T>(&mut self, open: impl FnOnce(&mut Self, usize) -> Result<T>) -> Result<T> {
        let (table, capacity) = (self.table.clone(), self.row_capacity);
        let row = self.take_table_row()?;
        open(self, row).inspect_err(|_| {
            if self.row_capacity == capacity {
                self.free_rows.push(row);
            } else {
                self.store.set_page_table(table.clone());
                self.table = table;
                self.retired.pop();
                self.row_capacity = capacity;
            }
        })
    }

    /// A sequence the ledger makes with `make`, given a table row of its own
    /// ([`PagedCache::with_table_row`]) that holds its pages. The last sequence id is refused before
    /// the row is taken, so that a refusal does not grow the page table.
    fn open_sequence<T>(
        &mut self,
        make: impl FnOnce(&mut PageLedger) -> Result<(SeqId, T)>,
    ) -> Result<(SeqId, T)> {
        self.reclaim();
        self.ledger.check_add()?;
        let (seq, made) = self.with_table_row(|pool, row| {
            let (seq, made) = make(&mut pool.ledger)?;
            pool.table_rows.insert(seq, TableRow::new(row));
            Ok((seq, made))
        })?;
        self.write_table(seq, 0, None);
        Ok((seq, made))
    }

    /// Removes `seq`; the pages no other sequence shares return to the pool, but those also
    /// published as a prefix, which stay cached ([`PagedCache::cached_pages`]) until evicted. Where
    /// an encoder recorded over `seq` (attention, GPU appends) may not be done yet, its pages and
    /// table row return only once it is (see [`PagedCache`]).
    pub fn remove(&mut self, seq: SeqId) -> Result<()> {
        self.let_go(seq, None, false)
    }

    /// Removes `seq` (`new_len` None) or truncates it to `new_len` rows, zeroing the rows that no
    /// holder keeps where `scrub` says. Where an encoder recorded over `seq` may not be done yet
    /// ([`PagedCache::hold_until_done`], through its row or an earlier one) and the call drops rows
    /// of `seq`, every page of `seq` stays pinned with the rows `seq` saw there
    /// ([`PageLedger::hold`]: no one writes into them, `seq` included, but through a private copy)
    /// and its table row kept, until the encoder is done; a truncated sequence moves to a fresh
    /// row, written with `Queue::write_buffer`, its tokens remembering the old row's ([`Tokens`]).
    /// The encoder reads and writes what it was recorded against. Refused as
    /// [`PagedCache::take_rows`] refuses, or where a truncated sequence finds no fresh row
    /// ([`Error::TooManySequences`], or [`Error::OutOfMemory`] for a grown table), changing
    /// nothing.
    fn let_go(&mut self, seq: SeqId, new_len: Option<usize>, scrub: bool) -> Result<()> {
        self.reclaim();
        let drops = self.ledger.drops_rows(seq, new_len)?;
        let held = drops && self.table_rows.get(&seq).is_some_and(|r| r.tokens.held());
        if !held {
            self.take_rows(seq, new_len, scrub)?;
            if new_len.is_none() {
                let row = self.table_rows.remove(&seq);
                self.free_rows.extend(row.map(|r| r.row));
            }
            return Ok(());
        }
        let commit = |pool: &mut Self, fresh: Option<usize>| {
            // Pinned first, so that a scrub leaves them to their pins; a refused scrub puts the
            // ledger back (an unpin would leave the pins' rows raised).
            let before = scrub.then(|| pool.ledger.clone());
            let pages = pool.ledger.hold(seq)?;
            if let Err(e) = pool.take_rows(seq, new_len, scrub) {
                match before {
                    Some(ledger) => pool.ledger = ledger,
                    None => drop(pool.ledger.unpin(&pages)),
                }
                return Err(e);
            }
            let old = match (fresh, pool.table_rows.get_mut(&seq)) {
                (Some(row), Some(old)) => {
                    let tokens = old.tokens.moved();
                    Some(std::mem::replace(old, TableRow { row, tokens }))
                }
                (Some(_), None) => None,
                (None, _) => pool.table_rows.remove(&seq),
            };
            pool.write_table(seq, 0, None);
            match old {
                Some(old) => pool.released.push(Released {
                    tokens: old.tokens,
                    pages,
                    row: old.row,
                }),
                // The ledger and the table rows name the same sequences: not reached.
                None => drop(pool.ledger.unpin(&pages)),
            }
            Ok(())
        };
        match new_len {
            None => commit(self, None),
            Some(_) => self.with_table_row(|pool, row| commit(pool, Some(row))),
        }
    }

    /// The ledger's part of [`PagedCache::let_go`]: removes or truncates `seq`, first zeroing, in a
    /// submission of its own, the rows it leaves with no holder where `scrub` says (and leaving
    /// those of pinned pages to their last unpin). Refused with the ledger's error, or
    /// [`Error::OutOfMemory`] (or [`Error::DeviceLost`]) where the device cannot make the zeroing's
    /// parameters, changing nothing.
    fn take_rows(&mut self, seq: SeqId, new_len: Option<usize>, scrub: bool) -> Result<()> {
        let mut pinned = Vec::new();
        if scrub {
            let orphans = self.ledger.orphaned_rows(seq, new_len)?;
            self.scrub(&orphans.now)?;
            pinned = orphans.pinned;
        }
        match new_len {
            None => self.ledger.remove(seq)?,
            Some(new_len) => self.ledger.truncate(seq, new_len)?,
        }
        self.ledger.scrub_when_unpinned(&pinned);
        Ok(())
    }

    /// A new sequence holding the first `at_len` committed rows of `parent` without copying them: the
    /// pages are shared, and a page either side later writes into is copied for the writer first.
    /// Starting a conversation from a cached system prompt is `fork(prompt, prompt_len)`.
    pub fn fork(&mut self, parent: SeqId, at_len: usize) -> Result<SeqId> {
        // Checked first, so that a refused fork does not grow the page table.
        self.ledger.check_fork(parent, at_len)?;
        self.open_sequence(|l| l.fork(parent, at_len).map(|child| (child, ())))
            .map(|(child, ())| child)
    }

    /// Publishes the whole pages of `seq` that hold `tokens`, the token ids of its first committed
    /// rows, for [`PagedCache::add_sequence_with_prefix`]: a later request whose tokens start the same
    /// way starts from those pages instead of computing their rows again, also after `seq` is removed
    /// (the pool keeps published pages until [`PagedCache::evict_prefixes`] returns them). Returns the
    /// rows of `tokens` published now: whole pages, a partly filled last page is not. Nothing is
    /// copied or written on the GPU.
    ///
    /// The pool does not see tokens: `tokens` must be what the rows were computed from. Pages of
    /// tokens already published (by another sequence with the same prefix) are not published twice,
    /// and publishing stops, with what it did, at a page of `seq` already published under other
    /// tokens. More tokens than committed rows is [`Error::PrefixBeyondLength`], and publishes
    /// nothing.
    pub fn publish_prefix(&mut self, seq: SeqId, tokens: &[u32]) -> Result<usize> {
        self.reclaim();
        self.ledger.publish(seq, tokens)
    }

    /// A new sequence that starts from the longest published prefix of `tokens` (see
    /// [`PagedCache::publish_prefix`]), sharing its pages as [`PagedCache::fork`] does, and its length
    /// in rows: a multiple of the page size, 0 when no page matches. The app appends the rows of
    /// `tokens[len..]`. An app that needs the output of a prompt's last token passes the prompt
    /// without it, so that at least that token is computed again.
    pub fn add_sequence_with_prefix(&mut self, tokens: &[u32]) -> Result<(SeqId, usize)> {
        self.open_sequence(|l| l.add_with_prefix(tokens))
    }

    /// Rows of `tokens` that [`PagedCache::add_sequence_with_prefix`] would start a sequence with
    /// now (the longest published prefix, in whole pages); changes nothing.
    pub fn published_rows(&self, tokens: &[u32]) -> usize {
        self.ledger.published_rows(tokens)
    }

    /// Returns up to `n` published pages that no sequence holds to the pool, least recently published
    /// or matched first (a page goes only after the pages published after it on the same prefix);
    /// returns how many went, at most [`PagedCache::evictable_pages`]. A page an encoder not yet
    /// done still reads is not among them (see [`PagedCache`]).
    pub fn evict_prefixes(&mut self, n: usize) -> usize {
        self.reclaim();
        self.ledger.evict_prefixes(n)
    }

    /// [`PagedCache::evict_prefixes`], and the pages it returns to the pool zeroed in a submission of
    /// its own (neighbouring pages in one run), so that the next sequence to take one, or
    /// [`PagedCache::pool_view`], does not see the prefix's rows. Returns how many pages went. Refused
    /// with [`Error::OutOfMemory`] (or [`Error::DeviceLost`]), evicting nothing, where the device
    /// cannot make the zeroing's parameters.
    pub fn evict_prefixes_and_scrub(&mut self, n: usize) -> Result<usize> {
        self.reclaim();
        let mut ledger = self.ledger.clone();
        let pages = ledger.evict_prefix_pages(n);
        self.scrub(&ledger.page_runs(&pages))?;
        self.ledger = ledger;
        Ok(pages.len())
    }

    /// Published pages no sequence (or encoder) holds: kept for later requests, and returned
    /// to the pool by [`PagedCache::evict_prefixes`] (those [`PagedCache::evictable_pages`]
    /// counts). They are not [`PagedCache::free_pages`].
    pub fn cached_pages(&self) -> usize {
        self.ledger.cached_pages()
    }

    /// The pages `evict_prefixes(usize::MAX)` would return to the pool now: the cached pages but
    /// those on the way to a published page a sequence still holds (one another request published
    /// after them). What eviction can free for the running sequences' growth; a new request's own
    /// cached prefix is among them (evicting it shortens the prefix the request starts from).
    /// Changes nothing.
    pub fn evictable_pages(&self) -> usize {
        self.ledger.evictable_pages()
    }

    /// Rolls `seq` back to `new_len` committed rows, dropping pending rows, with no GPU work; pages
    /// past the new end return to the pool (their bytes stay until overwritten), one by one, but
    /// pages shared with another sequence or published as a prefix, which their other holders keep.
    /// Where an encoder recorded over `seq` (attention, GPU appends) may not be done yet and rows
    /// go, the pages that go return only once it is, `seq` writes into the rows it had through
    /// private copies until then, and `seq` moves to a fresh table row (see [`PagedCache`]):
    /// refused with [`Error::TooManySequences`] (or [`Error::OutOfMemory`] where the table would
    /// grow), changing nothing, where there is none.
    pub fn truncate(&mut self, seq: SeqId, new_len: usize) -> Result<()> {
        self.let_go(seq, Some(new_len), false)
    }

    /// [`PagedCache::truncate`], and the rows it leaves with no holder zeroed in a submission of its
    /// own, as [`KvCache::truncate_and_scrub`] does: the pages that return to the pool and the rows
    /// past `new_len` in the last page kept, where `seq` alone holds them. Pages another sequence or
    /// a published prefix holds keep their rows (theirs too); they are zeroed only if their last
    /// holder leaves through a scrub as well (a published prefix's pages, when
    /// [`PagedCache::evict_prefixes_and_scrub`] frees them), so a page this sequence alone held
    /// reaches the next sequence, or [`PagedCache::pool_view`], without its rows. A page a recorded
    /// GPU append still copies, or an encoder recorded over `seq` may still read, is zeroed once
    /// the pool lets it go (see [`PagedCache`]). Refused as [`PagedCache::truncate`] is, and with
    /// [`Error::OutOfMemory`] (or [`Error::DeviceLost`]) where the device cannot make the zeroing's
    /// parameters, changing nothing.
    pub fn truncate_and_scrub(&mut self, seq: SeqId, new_len: usize) -> Result<()> {
        self.let_go(seq, Some(new_len), true)
    }

    /// [`PagedCache::remove`], and the pages that return to the pool zeroed in a submission of its
    /// own: those `seq` alone held (see [`PagedCache::truncate_and_scrub`], also for the pages kept
    /// for encoders not yet done).
    pub fn remove_and_scrub(&mut self, seq: SeqId) -> Result<()> {
        self.let_go(seq, None, true)
    }

    /// Returns to the pool what encoders held where they are done (see [`PagedCache`]): the pages
    /// recorded GPU appends' copies read, and the pages and table rows that removals and
    /// truncations kept for encoders recorded over their sequences. Every call that changes the
    /// pool does this first; call it after
    /// a poll for [`PagedCache::free_pages`] or [`PagedCache::admits`] to count them. Where a scrub
    /// waited for a page, its rows are zeroed first, in a submission of their own; if the device
    /// refuses the zeroing, those pages stay held, to be returned at a later call.
    pub fn reclaim(&mut self) {
        let mut pages =
            std::mem::take(&mut *self.unpinned.lock().unwrap_or_else(PoisonError::into_inner));
        let done = |r: &mut Released| r.tokens.done();
        for released in self.released.extract_if(.., done) {
            pages.extend(released.pages);
            self.free_rows.push(released.row);
        }
        let (waiting, plain): (Vec<u32>, Vec<u32>) = pages
            .into_iter()
            .partition(|&page| self.ledger.scrub_waits(page));
        self.ledger.unpin(&plain);
        if waiting.is_empty() {
            return;
        }
        let mut ledger = self.ledger.clone();
        let runs = ledger.unpin(&waiting);
        match self.scrub(&runs) {
            Ok(()) => self.ledger = ledger,
            Err(_) => self
                .unpinned
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .extend(waiting),
        }
    }

    /// Zeroes `runs` of every slot buffer, in a submission of its own.
    fn scrub(&mut self, runs: &[Run]) -> Result<()> {
        if runs.is_empty() {
            return Ok(());
        }
        let mut encoder = self.encoder("kvgpu scrub");
        self.store.record_zero_runs(&mut encoder, runs)?;
        self.queue().submit([encoder.finish()]);
        Ok(())
    }

    /// Committed rows of `seq`.
    pub fn len(&self, seq: SeqId) -> Result<usize> {
        self.ledger.len(seq)
    }

    /// Rows of `layer` of `seq` that reads see: committed plus this step's appends.
    pub fn visible(&self, seq: SeqId, layer: usize) -> Result<usize> {
        self.ledger.visible(seq, layer)
    }

    /// `Ok` when `n` more rows in every layer of each `(seq, n)` fit at once (pages, private copies
    /// of shared pages, and the longest sequence), else why not: a sequence that is not the pool's
    /// (as every call refuses it), [`Error::CapacityExceeded`] for
    /// the first sequence (by id) that would pass `max_seq_len`, or else [`Error::OutOfPages`] for
    /// the whole growth. The appends would be refused too, but where both problems exist they may
    /// name the other one first (they meet them in their own order). One count is cautious: where a
    /// shared page has several writers in the growth that do not all write from the same row of it,
    /// each writer counts a private copy (in a recorded step the first writer's copy pins the page,
    /// and a later writer below its rows copies it too; host appends take one copy fewer there).
    /// So does each writer where one of them writes into the rows a recorded copy or a held encoder
    /// still reads (see [`PagedCache`]), or into a page whose zeroing waits. Changes nothing.
    pub fn admits(&self, growth: &[(SeqId, usize)]) -> Result<()> {
        self.ledger.admits(growth)
    }

    /// [`PagedCache::admits`] for a request not yet made a sequence: `Ok` when a new sequence of
    /// `len` rows in every layer, whose first rows are the longest published prefix of `tokens`
    /// now (as [`PagedCache::add_sequence_with_prefix`] would start it, sharing those pages; `&[]`
    /// for [`PagedCache::add_sequence`]), fits beside the `growth` of running sequences, with a
    /// page-table row; else why not, as `add_sequence_with_prefix` and `admits` name it, in their
    /// order. A prefix longer than `len` takes no more rows. Changes nothing: no sequence id is
    /// taken and no prefix's recency refreshed, as the sequence made and removed again would. (A
    /// page table that has to grow for the sequence can still be refused for memory when it is
    /// made.)
    pub fn admits_new(&self, tokens: &[u32], len: usize, growth: &[(SeqId, usize)]) -> Result<()> {
        self.ledger.check_add()?;
        self.check_table_row()?;
        let mut ledger = self.ledger.clone();
        let (seq, prefix) = ledger.add_with_prefix(tokens)?;
        let mut all = Vec::with_capacity(growth.len() + 1);
        all.extend_from_slice(growth);
        all.push((seq, len.saturating_sub(prefix)));
        ledger.admits(&all)
    }

    /// Appends one host slab per slot of `layer` to `seq` (as [`KvCache::append`]).
    pub fn append(&mut self, seq: SeqId, layer: usize, slabs: &[HostSlab<'_>]) -> Result<()> {
        self.reclaim();
        let plan = self
            .ledger
            .plan_append(seq, layer, slabs.len(), |s| slabs[s].shape)?;
        self.store.check_host_slabs(layer, slabs)?;
        self.check_usable(layer, std::slice::from_ref(&plan))?;
        self.write_host(layer, slabs, &[plan])
    }

    /// Appends one step of many sequences to `layer` from one host slab per slot: `batch` lists
    /// `(seq, n)`, and slab `s` is `[Σ n, ...trailing[s]]`, the rows of each sequence in turn (a
    /// sequence may appear more than once; its parts land in order). All or nothing: counts that do
    /// not add up to the slabs' rows ([`Error::BatchRows`]), or any sequence's append that would be
    /// refused on its own, refuse the whole batch and change nothing.
    pub fn append_batch(
        &mut self,
        layer: usize,
        batch: &[(SeqId, usize)],
        slabs: &[HostSlab<'_>],
    ) -> Result<()> {
        self.reclaim();
        let plans = self.plan_batch(layer, batch, slabs.len(), |s| slabs[s].shape)?;
        self.store.check_host_slabs(layer, slabs)?;
        self.check_usable(layer, &plans)?;
        self.write_host(layer, slabs, &plans)
    }

    /// Checks a batch of appends to `layer` and plans each, in order, as if the ones before it had
    /// happened; changes nothing. The runs are relative to the batch's slabs.
    fn plan_batch<'s>(
        &mut self,
        layer: usize,
        batch: &[(SeqId, usize)],
        n_slabs: usize,
        shape_of: impl Fn(usize) -> &'s [usize],
    ) -> Result<Vec<PagedPlan>> {
        let rows = slab_rows(layer, self.ledger.slot_shapes(layer)?, n_slabs, &shape_of)?;
        let counted = batch
            .iter()
            .try_fold(0usize, |sum, &(_, n)| sum.checked_add(n));
        if counted != Some(rows) {
            return Err(Error::BatchRows {
                layer,
                batch: counted.unwrap_or(usize::MAX),
                rows,
            });
        }
        let mut plans = self.ledger.plan_batch(layer, batch, n_slabs, |s| {
            shape_of(s).get(1..).unwrap_or_default()
        })?;
        // Runs name rows of the whole slabs: each sequence's part starts after the ones before.
        let mut first = 0;
        for (plan, &(_, n)) in plans.iter_mut().zip(batch) {
            for run in &mut plan.runs {
                run.0 += first;
            }
            first += n;
        }
        Ok(plans)
    }

    /// Refuses an append to `layer` by `plans` that would use a slot buffer the app destroyed
    /// through [`PagedCache::pool_view`]: the layer's, and every layer's when a shared page is copied.
    fn check_usable(&self, layer: usize, plans: &[PagedPlan]) -> Result<()> {
        if plans.iter().any(|p| !p.copies.is_empty()) {
            self.store.check_usable()
        } else {
            self.store.check_layer_usable(layer)
        }
    }

    /// The buffer each private copy of `plans` passes through (one page of the widest slot), where
    /// any plan copies a shared page. Made at the pool's first copy, under the out-of-memory check:
    /// before anything is recorded, so that a device that cannot hold it refuses the append
    /// ([`Error::OutOfMemory`]) with nothing changed. The pool keeps a new one only once the append
    /// that made it succeeds ([`PagedCache::keep_staging`]): a refused append keeps no new memory.
    fn page_staging(&self, plans: &[PagedPlan]) -> Result<Option<wgpu::Buffer>> {
        if plans.iter().all(|p| p.copies.is_empty()) {
            return Ok(None);
        }
        if let Some(staging) = &self.staging {
            return Ok(Some(staging.clone()));
        }
        let size = widest(&self.spec).map_or(4, |(_, _, b)| b) * self.page_size() as u64;
        let device = self.store.device();
        let staging =
            crate::kernels::allocated(device, "a page's copy-on-write staging", size, || {
                device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some("kvgpu page staging"),
                    size,
                    usage: wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST,
                    mapped_at_creation: false,
                })
            })?;
        Ok(Some(staging))
    }

    /// Keeps the staging buffer [`PagedCache::page_staging`] gave an append that succeeded.
    fn keep_staging(&mut self, staging: Option<wgpu::Buffer>) {
        if staging.is_some() {
            self.staging = staging;
        }
    }

    /// Writes checked host slabs as `plans` say and commits the plans. Each plan's private copies
    /// come first. Scattered rows are uploaded once and moved by one dispatch per slot, submitted
    /// with the copies; on a CPU adapter, rows of many runs are uploaded once and copied run by run,
    /// submitted with them too; otherwise they go straight into their pages with
    /// `Queue::write_buffer` (landing at the next submission, after the copies). Natively, more
    /// than 4 MiB of rows are checked for memory (the upload, or the staging of the writes) before
    /// anything is submitted: a refused one changes nothing.
    fn write_host(
        &mut self,
        layer: usize,
        slabs: &[HostSlab<'_>],
        plans: &[PagedPlan],
    ) -> Result<()> {
        let runs = moving_runs(plans);
        let mut encoder = None;
        let staging = self.page_staging(plans)?;
        if let Some(staging) = &staging {
            let encoder = encoder.insert(self.encoder("kvgpu page copy"));
            for plan in plans {
                self.record_copies(encoder, staging, &plan.copies);
            }
        }
        // (scatter, upload once and copy run by run): on a CPU adapter a dispatch costs about a
        // hundred copies, and each `write_buffer` makes a staging buffer of its own.
        let (many, cpu) = (runs.len() > HOST_RUNS, self.kernels().is_cpu());
        let (scatter, copy) = match self.scatter {
            ScatterChoice::Always => (!runs.is_empty(), false),
            ScatterChoice::Never => (false, false),
            ScatterChoice::Auto => (many && !cpu, many && cpu),
        };
        let scattered = scatter && {
            let encoder = encoder.get_or_insert_with(|| self.encoder("kvgpu paged append"));
            self.store.record_host_scatter(
                encoder,
                layer,
                slabs,
                &row_map(plans.iter().map(|p| p.n_new).sum(), &runs),
            )?
        };
        let jobs = [HostRows {
            layer,
            rows: Rows::Slabs(slabs),
            runs: Cow::Borrowed(&runs),
        }];
        let copied = copy && {
            let encoder = encoder.get_or_insert_with(|| self.encoder("kvgpu paged append"));
            self.store.record_host_copies(encoder, &jobs)?
        };
        let written = !scattered && !copied;
        if written {
            self.store.check_host_rows(&jobs, HOST_ROWS)?;
        }
        if let Some(encoder) = encoder {
            self.queue().submit([encoder.finish()]);
        }
        if written {
            self.store.write_host_rows(&jobs);
        }
        for plan in plans {
            self.commit(plan, None);
        }
        self.keep_staging(staging);
        Ok(())
    }

    /// Commits a plan to the ledger and writes the table entries it changed (see
    /// [`PagedCache::write_table`]).
    fn commit(&mut self, plan: &PagedPlan, recorded: Option<Recorded<'_>>) {
        let held = self.ledger.pages(plan.seq).map_or(0, <[u32]>::len);
        self.ledger.commit_append(plan);
        self.write_table(plan.seq, changed_from(plan, held), recorded);
    }

    /// Records an append from GPU buffers to `seq` into `encoder` (as
    /// [`KvCache::record_append_gpu`]), after the copies of any shared page it writes into. The
    /// pool keeps each page such a copy reads until the encoder's work is done (see [`PagedCache`]).
    pub fn record_append_gpu(
        &mut self,
        encoder: &mut wgpu::CommandEncoder,
        seq: SeqId,
        layer: usize,
        slabs: &[GpuSlab<'_>],
    ) -> Result<()> {
        self.gpu_append(encoder, true, seq, layer, slabs)
    }

    /// [`PagedCache::record_append_gpu`] into the app's encoder (`app`) or the pool's own, which is
    /// submitted at once.
    fn gpu_append(
        &mut self,
        encoder: &mut wgpu::CommandEncoder,
        app: bool,
        seq: SeqId,
        layer: usize,
        slabs: &[GpuSlab<'_>],
    ) -> Result<()> {
        self.reclaim();
        let plan = self
            .ledger
            .plan_append(seq, layer, slabs.len(), |s| slabs[s].shape)?;
        self.record_gpu(encoder, app, layer, slabs, plan.n_new, &[plan])
    }

    /// [`PagedCache::append_batch`] from GPU buffers, recorded into `encoder` (as
    /// [`PagedCache::record_append_gpu`]): each sequence's part of the slabs moves into its pages.
    pub fn record_append_gpu_batch(
        &mut self,
        encoder: &mut wgpu::CommandEncoder,
        layer: usize,
        batch: &[(SeqId, usize)],
        slabs: &[GpuSlab<'_>],
    ) -> Result<()> {
        self.gpu_append_batch(encoder, true, layer, batch, slabs)
    }

    /// [`PagedCache::record_append_gpu_batch`] into the app's encoder (`app`) or the pool's own.
    fn gpu_append_batch(
        &mut self,
        encoder: &mut wgpu::CommandEncoder,
        app: bool,
        layer: usize,
        batch: &[(SeqId, usize)],
        slabs: &[GpuSlab<'_>],
    ) -> Result<()> {
        self.reclaim();
        let plans = self.plan_batch(layer, batch, slabs.len(), |s| slabs[s].shape)?;
        let rows = plans.iter().map(|p| p.n_new).sum();
        self.record_gpu(encoder, app, layer, slabs, rows, &plans)
    }

    /// [`PagedCache::record_append_gpu_batch`] in its own submission.
    pub fn append_gpu_batch(
        &mut self,
        layer: usize,
        batch: &[(SeqId, usize)],
        slabs: &[GpuSlab<'_>],
    ) -> Result<()> {
        let mut encoder = self.encoder("kvgpu paged append_gpu_batch");
        self.gpu_append_batch(&mut encoder, false, layer, batch, slabs)?;
        self.queue().submit([encoder.finish()]);
        Ok(())
    }

    /// Checks GPU slabs of `rows` rows against `plans` (every source check first), records each
    /// plan's private copies, then the moves, and commits the plans. Rows scatter by one dispatch
    /// per slot when [`PagedCache::set_scatter`] says so and every source can be bound; otherwise
    /// they move run by run. In the app's encoder (`app`, submitted when the app says) the pages
    /// the copies read are pinned until its work is done; the pool's own encoder is submitted
    /// before anything else can write or take them.
    fn record_gpu(
        &mut self,
        encoder: &mut wgpu::CommandEncoder,
        app: bool,
        layer: usize,
        slabs: &[GpuSlab<'_>],
        rows: usize,
        plans: &[PagedPlan],
    ) -> Result<()> {
        self.check_usable(layer, plans)?;
        let staging = self.page_staging(plans)?;
        let runs = moving_runs(plans);
        let copy_runs = if self.kernels().is_cpu() {
            COPY_RUNS_CPU
        } else {
            COPY_RUNS_GPU
        };
        // (scatter at all, scatter rows that could be copied run by run)
        let (scatter, copies) = match self.scatter {
            ScatterChoice::Always => (!runs.is_empty(), true),
            ScatterChoice::Never => (false, false),
            ScatterChoice::Auto => (runs.len() > 1, runs.len() > copy_runs),
        };
        // The page tables' uploads are reserved first: a scattered move writes its map when it is
        // bound, the last step that may refuse. A refusal leaves the upload ring as it was.
        let mark = self.store.upload_mark();
        let prepared = self.table_uploads(plans).and_then(|tables| {
            let scatters = if scatter {
                let map = row_map(rows, &runs);
                self.store.prepare_gpu_scatter(layer, slabs, &map, copies)?
            } else {
                None
            };
            let moves = match scatters {
                Some(_) => Vec::new(),
                None => self.store.prepare_gpu_runs(layer, slabs, rows, &runs)?,
            };
            Ok((tables, scatters, moves))
        });
        let (tables, scatters, moves) = match prepared {
            Ok(prepared) => prepared,
            Err(e) => {
                self.store.upload_rewind(mark);
                return Err(e);
            }
        };
        if let Some(staging) = &staging {
            for plan in plans {
                self.record_copies(encoder, staging, &plan.copies);
            }
        }
        match scatters {
            Some(scatters) => self.store.record_scatters(encoder, scatters),
            None => self.store.record_gpu_moves(encoder, layer, slabs, moves),
        }
        for (plan, table) in plans.iter().zip(tables) {
            self.commit(plan, Some((&mut *encoder, table)));
        }
        self.keep_staging(staging);
        if app {
            let copies: Vec<&PageCopy> = plans.iter().flat_map(|p| &p.copies).collect();
            for &copy in &copies {
                self.ledger.pin(copy);
            }
            let pins = Pins {
                pages: copies.iter().map(|c| c.from).collect(),
                done: Arc::clone(&self.unpinned),
                _sequences: self.tokens(plans.iter().map(|p| p.seq)),
            };
            encoder.on_submitted_work_done(move || drop(pins));
        }
        Ok(())
    }

    /// Holds `seqs` for `encoder`, which reads or writes their pages and table rows when it runs,
    /// until its work is done (or it is dropped unsubmitted): a removal or truncation of one of
    /// them meanwhile keeps what it takes for the encoder ([`PagedCache::let_go`]). Attention
    /// recorded over a pool's sequences calls this; recorded GPU appends hold theirs through their
    /// [`Pins`].
    pub(crate) fn hold_until_done(
        &self,
        encoder: &mut wgpu::CommandEncoder,
        seqs: impl IntoIterator<Item = SeqId>,
    ) {
        let tokens = self.tokens(seqs);
        if !tokens.is_empty() {
            encoder.on_submitted_work_done(move || drop(tokens));
        }
    }

    /// The tokens of `seqs` ([`TableRow`]) for an encoder to hold.
    fn tokens(&self, seqs: impl IntoIterator<Item = SeqId>) -> Vec<Arc<()>> {
        seqs.into_iter()
            .filter_map(|seq| self.table_rows.get(&seq))
            .map(|row| Arc::clone(&row.tokens.now))
            .collect()
    }

    /// [`PagedCache::record_append_gpu`] in its own submission.
    pub fn append_gpu(&mut self, seq: SeqId, layer: usize, slabs: &[GpuSlab<'_>]) -> Result<()> {
        let mut encoder = self.encoder("kvgpu paged append_gpu");
        self.gpu_append(&mut encoder, false, seq, layer, slabs)?;
        self.queue().submit([encoder.finish()]);
        Ok(())
    }

    /// Commits `n` rows of `seq`: every layer with slots must hold exactly `n` pending rows of it.
    pub fn advance(&mut self, seq: SeqId, n: usize) -> Result<()> {
        self.reclaim();
        self.ledger.advance(seq, n)
    }

    /// Commits a step of many sequences at once: `n` rows of each `(seq, n)` (the `batch` of an
    /// [`PagedCache::append_batch`]; a sequence named more than once commits the sum of its counts).
    /// All or nothing: every sequence is checked as [`PagedCache::advance`] checks it, in the order
    /// named, and the first refusal commits none.
    pub fn advance_batch(&mut self, batch: &[(SeqId, usize)]) -> Result<()> {
        self.reclaim();
        self.ledger.advance_batch(batch)
    }

    /// The whole pool buffer of a slot, every page, for the app's own kernels (rows of page `p` start
    /// at row `p · page_size`; row `r` of a sequence lies on its page
    /// `ledger().pages(seq)[r / page_size]`, at row `r % page_size` of it, for the app to upload as
    /// its kernel's page table). The app must not destroy the buffer (see [`KvCache::view`]).
    pub fn pool_view(&self, layer: usize, slot: usize) -> Result<SlotView<'_>> {
        self.store.full_view(layer, slot)
    }

    /// Every word of a slot's pool buffer, as stored (16-bit types packed, rows padded).
    pub async fn read_pool_words_async(&self, layer: usize, slot: usize) -> Result<Vec<u32>> {
        self.store.read_full_words_async(layer, slot).await
    }

    /// The visible rows of `seq` in a slot as stored words, gathered through its page table: one
    /// readback of its pages' rows (not of the pool). Submit any encoder holding recorded appends to
    /// `seq` first (as for [`PagedCache::export_sequence_async`]): one that gave it a private copy
    /// of a shared page moved it to the new page at once, and the copy fills that page, earlier rows
    /// included, only when the encoder runs.
    pub async fn read_words_async(
        &self,
        seq: SeqId,
        layer: usize,
        slot: usize,
    ) -> Result<Vec<u32>> {
        let visible = self.ledger.visible(seq, layer)?;
        let row_bytes = self.spec.row_bytes(layer, slot)?;
        let ranges = page_ranges(
            self.ledger.pages(seq)?,
            self.page_size(),
            visible,
            row_bytes,
        );
        self.store.read_range_words(layer, slot, &ranges).await
    }

    /// The visible rows of `seq` in a slot as f32, `[visible, ...trailing]` row-major.
    pub async fn read_f32_async(&self, seq: SeqId, layer: usize, slot: usize) -> Result<Vec<f32>> {
        let words = self.read_words_async(seq, layer, slot).await?;
        let row_elems = self.spec.slot(layer, slot)?.row_elems();
        crate::cache::decoded(
            &words,
            self.spec.slot_dtype(layer, slot)?,
            row_elems,
            self.spec.slot_scale(layer, slot)?,
        )
    }

    /// [`PagedCache::read_pool_words_async`], blocking.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn read_pool_words(&self, layer: usize, slot: usize) -> Result<Vec<u32>> {
        pollster::block_on(self.read_pool_words_async(layer, slot))
    }

    /// [`PagedCache::read_words_async`], blocking.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn read_words(&self, seq: SeqId, layer: usize, slot: usize) -> Result<Vec<u32>> {
        pollster::block_on(self.read_words_async(seq, layer, slot))
    }

    /// [`PagedCache::read_f32_async`], blocking.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn read_f32(&self, seq: SeqId, layer: usize, slot: usize) -> Result<Vec<f32>> {
        pollster::block_on(self.read_f32_async(seq, layer, slot))
    }

    /// Records the private copies of shared pages: per layer the rows the writer sees there, through
    /// the staging buffer (wgpu copies nothing within one buffer).
    fn record_copies(
        &self,
        encoder: &mut wgpu::CommandEncoder,
        staging: &wgpu::Buffer,
        copies: &[PageCopy],
    ) {
        let p = self.page_size() as u64;
        for copy in copies {
            for (layer, &rows) in copy.rows.iter().enumerate() {
                for slot in 0..self.spec.layers()[layer].slots.len() {
                    let view = self
                        .store
                        .slot_view(layer, slot, true)
                        .expect("a slot of the spec");
                    let size = rows as u64 * view.row_bytes;
                    if size == 0 {
                        continue;
                    }
                    let page_bytes = p * view.row_bytes;
                    let (from, to) = (copy.from as u64 * page_bytes, copy.to as u64 * page_bytes);
                    encoder.copy_buffer_to_buffer(view.buffer, from, staging, 0, size);
                    encoder.copy_buffer_to_buffer(staging, 0, view.buffer, to, size);
                }
            }
        }
    }

    fn encoder(&self, label: &str) -> wgpu::CommandEncoder {
        self.store
            .device()
            .create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some(label) })
    }
}

/// What [`Error::OutOfMemory`] names where the device cannot hold the page table (made, or grown and
/// written whole).
const TABLE: &str = "the pool's page table";

/// A page table of `rows` rows of `width` entries, made under the out-of-memory check.
fn table_buffer(device: &wgpu::Device, width: usize, rows: usize) -> Result<wgpu::Buffer> {
    let size = (width * rows * 4).max(16) as u64;
    crate::kernels::allocated(device, TABLE, size, || {
        device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("kvgpu page table"),
            size,
            usage: wgpu::BufferUsages::STORAGE
                | wgpu::BufferUsages::COPY_DST
                | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        })
    })
}

/// The slot with the widest rows: `(layer, slot, row bytes)`.
fn widest(spec: &CacheSpec) -> Option<(usize, usize, u64)> {
    (0..spec.n_layers())
        .flat_map(|l| (0..spec.layers()[l].slots.len()).map(move |s| (l, s)))
        .filter_map(|(l, s)| spec.row_bytes(l, s).ok().map(|b| (l, s, b)))
        .max_by_key(|&(_, _, b)| b)
}
