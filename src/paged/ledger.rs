//! The host ledger of a paged pool, [`PageLedger`].

use std::collections::BTreeMap;
use std::collections::btree_map::Entry;

use crate::error::{Error, Result};
use crate::ledger::{SeqId, check_layer, slab_rows, slot_shapes_of};
use crate::placement::Run;
use crate::spec::CacheSpec;

/// One sequence: its pages in order, committed rows, and the rows appended to each layer in the
/// current step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Sequence {
    pub pages: Vec<u32>,
    pub len: usize,
    pub pending: Vec<usize>,
}

impl Sequence {
    /// Rows of `layer` the sequence sees: committed plus pending.
    pub(crate) fn visible(&self, layer: usize) -> usize {
        self.len + self.pending[layer]
    }
}

/// The private copy a write into a shared page needs: page `from` becomes page `to` for the writer,
/// with the rows `[0, rows[layer])` of each layer carried over (the rows the writer sees there).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct PageCopy {
    /// The page's index in the writer's table.
    pub index: usize,
    pub from: u32,
    pub to: u32,
    pub rows: Vec<usize>,
}

/// A checked append of `n_new` rows to `layer` of `seq` at rows `[start_row, start_row + n_new)`:
/// the pages it takes from the free list (fresh pages and copies), the copies to record first, and
/// where each part of the slabs lands (`(first slab row, run)`, the run in pool rows).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct PagedPlan {
    pub seq: SeqId,
    pub layer: usize,
    pub start_row: usize,
    pub n_new: usize,
    /// Pages appended to the table, in order.
    pub fresh: Vec<u32>,
    pub copies: Vec<PageCopy>,
    pub runs: Vec<(usize, Run)>,
}

/// Host truth of a paged pool: the free list, each page's reference count, and per sequence its page
/// table, committed length and pending rows per layer. No wgpu types.
///
/// A page holds `page_size` consecutive token rows of a sequence in every (layer, slot) at once, so one
/// page table serves every layer. Row `r` of a sequence lies in its page `pages[r / page_size]`, row
/// `r % page_size` of it. A page shared by several sequences (after a fork) is never written: a write
/// into it first gives the writer a private copy of the rows it can see (copy-on-write), so the rows
/// the other sequences see never change.
///
/// Full pages can also be published under the tokens their rows hold
/// ([`PagedCache::publish_prefix`](crate::PagedCache::publish_prefix)): the ledger keeps them, as
/// one more holder, in a trie whose nodes are pages keyed by their parent page and their own
/// tokens, so that a new sequence whose tokens start the same way starts from those pages
/// ([`PagedCache::add_sequence_with_prefix`](crate::PagedCache::add_sequence_with_prefix)) after
/// its sequence is gone. Pages only the trie holds go back to the pool when evicted, least recently
/// used first.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PageLedger {
    shapes: Vec<Vec<Vec<usize>>>,
    page_size: usize,
    max_seq_len: usize,
    /// Holders of each page (0: free): sequences, the published prefixes' trie, and pins.
    refs: Vec<u32>,
    /// Free pages; the next one taken is the last.
    free: Vec<u32>,
    seqs: BTreeMap<SeqId, Sequence>,
    /// The tag of every id this ledger hands out ([`crate::seq::pool_tag`]).
    pool: u32,
    next_id: u32,
    prefixes: Prefixes,
    /// Pages recorded copies of shared pages read when their encoders run, and pages sequences let
    /// go while encoders still read or write them ([`PageLedger::hold`]): each pin counts in `refs`
    /// as one more holder until [`PageLedger::unpin`].
    pins: BTreeMap<u32, Pin>,
    /// Pinned pages a scrubbing removal or truncation left to their pins: the first row from which
    /// no holder but the pins sees the page, zeroed when the last pin goes.
    scrub_at_unpin: BTreeMap<u32, usize>,
}

/// The recorded copies and the held encoders that read a page ([`PageLedger::pin`],
/// [`PageLedger::hold`]): how many, and per layer the rows they read (the most of any).
#[derive(Clone, Debug, PartialEq, Eq)]
struct Pin {
    count: u32,
    rows: Vec<usize>,
}

/// What a removal or truncation leaves with no holder ([`PageLedger::orphaned_rows`]).
#[derive(Debug, Default)]
pub(crate) struct Orphans {
    /// Rows to zero now, in merged runs.
    pub now: Vec<Run>,
    /// Pinned pages and the row from which only their pins hold them: zeroed at the last unpin.
    pub pinned: Vec<(u32, usize)>,
}

/// Published pages: see [`PageLedger`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Prefixes {
    /// Parent page (`None`: the first page of a prefix), then the page's tokens, to the page.
    by_key: BTreeMap<Option<u32>, BTreeMap<Vec<u32>, u32>>,
    nodes: BTreeMap<u32, PrefixNode>,
    /// Counts publications and matches, for least recently used first.
    clock: u64,
}

impl Prefixes {
    /// The page published after `parent` for `tokens`.
    fn child(&self, parent: Option<u32>, tokens: &[u32]) -> Option<u32> {
        self.by_key.get(&parent)?.get(tokens).copied()
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct PrefixNode {
    parent: Option<u32>,
    tokens: Vec<u32>,
    children: usize,
    used: u64,
}

impl PageLedger {
    /// A pool of `n_pages` pages of `page_size` rows for `spec`'s layers; a sequence holds at most
    /// `spec.max_seq_len()` rows. Both counts are non-zero (checked by the caller).
    pub(crate) fn new(spec: &CacheSpec, page_size: usize, n_pages: usize) -> Self {
        Self {
            shapes: slot_shapes_of(spec),
            page_size,
            max_seq_len: spec.max_seq_len(),
            refs: vec![0; n_pages],
            free: (0..n_pages as u32).rev().collect(),
            seqs: BTreeMap::new(),
            pool: crate::seq::pool_tag(),
            next_id: 0,
            prefixes: Prefixes::default(),
            pins: BTreeMap::new(),
            scrub_at_unpin: BTreeMap::new(),
        }
    }

    /// Rows per page.
    pub fn page_size(&self) -> usize {
        self.page_size
    }

    /// Pages in the pool, free or not.
    pub fn n_pages(&self) -> usize {
        self.refs.len()
    }

    /// Pages that neither a sequence, a published prefix nor a pin (an encoder) holds
    /// ([`PageLedger::page_refs`]), which appends and imports take.
    pub fn free_pages(&self) -> usize {
        self.free.len()
    }

    /// Pages that are not free: held by a sequence, a published prefix or a pin (an encoder), the
    /// published pages no sequence holds ([`PageLedger::cached_pages`]) included.
    pub fn pages_in_use(&self) -> usize {
        self.n_pages() - self.free_pages()
    }

    /// Most rows one sequence may hold.
    pub fn max_seq_len(&self) -> usize {
        self.max_seq_len
    }

    /// The number of layers, those without slots included.
    pub fn n_layers(&self) -> usize {
        self.shapes.len()
    }

    /// The live sequences, in creation order.
    pub fn sequences(&self) -> impl Iterator<Item = SeqId> + '_ {
        self.seqs.keys().copied()
    }

    /// Holders of `page`: the sequences whose tables name it, the published prefixes when it is one
    /// of theirs, and the encoders not yet done that read it (a recorded copy of it, or one recorded
    /// over a sequence that let it go; 0 for a free page).
    pub fn page_refs(&self, page: u32) -> Option<u32> {
        self.refs.get(page as usize).copied()
    }

    pub(crate) fn seq(&self, seq: SeqId) -> Result<&Sequence> {
        self.check_pool(seq)?;
        self.seqs.get(&seq).ok_or(Error::UnknownSequence { seq })
    }

    /// The tag of this pool's ids (`sequence 3 of pool 7` in errors).
    pub(crate) fn pool(&self) -> u32 {
        self.pool
    }

    /// Refuses an id another pool handed out.
    pub(crate) fn check_pool(&self, seq: SeqId) -> Result<()> {
        if seq.pool == self.pool {
            Ok(())
        } else {
            Err(Error::ForeignSequence { seq })
        }
    }

    /// Committed rows of `seq`.
    pub fn len(&self, seq: SeqId) -> Result<usize> {
        Ok(self.seq(seq)?.len)
    }

    /// The pages of `seq`, in row order.
    pub fn pages(&self, seq: SeqId) -> Result<&[u32]> {
        Ok(&self.seq(seq)?.pages)
    }

    /// Rows `[0, visible)` of `layer` of `seq` are what reads and attention see.
    pub fn visible(&self, seq: SeqId, layer: usize) -> Result<usize> {
        let s = self.seq(seq)?;
        self.check_layer(layer)?;
        Ok(s.visible(layer))
    }

    /// Rows appended to `layer` of `seq` in the current step.
    pub fn pending(&self, seq: SeqId, layer: usize) -> Result<usize> {
        let s = self.seq(seq)?;
        self.check_layer(layer)?;
        Ok(s.pending[layer])
    }

    /// The trailing shapes of `layer`'s slots.
    pub fn slot_shapes(&self, layer: usize) -> Result<&[Vec<usize>]> {
        self.check_layer(layer)?;
        Ok(&self.shapes[layer])
    }

    fn check_layer(&self, layer: usize) -> Result<()> {
        check_layer(layer, self.shapes.len())
    }

    /// Refuses a new sequence when its id would be the last one (`u32::MAX`, which `next_id`
    /// cannot pass): [`PageLedger::add`] and the ways that share pages fail exactly then.
    pub(crate) fn check_add(&self) -> Result<()> {
        if self.next_id == u32::MAX {
            return Err(Error::SequenceIdsExhausted);
        }
        Ok(())
    }

    /// A new, empty sequence (it takes no page until it is written).
    pub(crate) fn add(&mut self) -> Result<SeqId> {
        self.check_add()?;
        let id = SeqId {
            pool: self.pool,
            n: self.next_id,
        };
        self.next_id += 1;
        self.seqs.insert(
            id,
            Sequence {
                pages: Vec::new(),
                len: 0,
                pending: vec![0; self.shapes.len()],
            },
        );
        Ok(id)
    }

    /// Removes `seq`; the pages it alone held return to the pool (a published page stays cached).
    pub(crate) fn remove(&mut self, seq: SeqId) -> Result<()> {
        self.check_pool(seq)?;
        let s = self
            .seqs
            .remove(&seq)
            .ok_or(Error::UnknownSequence { seq })?;
        for page in s.pages {
            self.release(page);
        }
        Ok(())
    }

    fn release(&mut self, page: u32) {
        let r = &mut self.refs[page as usize];
        *r -= 1;
        if *r == 0 {
            self.free.push(page);
        }
    }

    /// Pages holding rows `[0, rows)`.
    fn pages_for(&self, rows: usize) -> usize {
        rows.div_ceil(self.page_size)
    }

    /// Whether `fork(parent, at_len)` would be taken: `parent` is held and has `at_len` committed rows.
    pub(crate) fn check_fork(&self, parent: SeqId, at_len: usize) -> Result<()> {
        let len = self.len(parent)?;
        if at_len > len {
            return Err(Error::ForkBeyondLength {
                seq: parent,
                at_len,
                len,
            });
        }
        Ok(())
    }

    /// A new sequence that shares the first `at_len` committed rows of `parent` (its pages, by
    /// reference; none is copied until one side writes into a shared page).
    pub(crate) fn fork(&mut self, parent: SeqId, at_len: usize) -> Result<SeqId> {
        self.check_fork(parent, at_len)?;
        let pages = self.seqs[&parent].pages[..self.pages_for(at_len)].to_vec();
        self.add_sharing(pages, at_len)
    }

    /// A new sequence of `len` committed rows in `pages`, which it shares with their other holders.
    fn add_sharing(&mut self, pages: Vec<u32>, len: usize) -> Result<SeqId> {
        let seq = self.add()?;
        for &page in &pages {
            self.refs[page as usize] += 1;
        }
        let s = self.seqs.get_mut(&seq).expect("just added");
        s.pages = pages;
        s.len = len;
        Ok(seq)
    }

    /// The rows `remove(seq)` (`new_len` None) or `truncate(seq, new_len)` would leave in the pool
    /// with no holder, changing nothing: the pages that return to the pool (those `seq` alone
    /// holds), and on a truncate the rows past `new_len` in its last page kept, where it alone holds
    /// that page. Pages another sequence or a published prefix holds keep their rows. Where the
    /// only other holders are pins, the rows are left to the last unpin
    /// ([`PageLedger::scrub_when_unpinned`]). Refused as the call itself would be.
    pub(crate) fn orphaned_rows(&self, seq: SeqId, new_len: Option<usize>) -> Result<Orphans> {
        let new_len = new_len.unwrap_or(0);
        let s = self.truncatable(seq, new_len)?;
        let p = self.page_size;
        let keep = self.pages_for(new_len);
        let partial = (!new_len.is_multiple_of(p)).then(|| (s.pages[keep - 1], new_len % p));
        let whole = s.pages[keep..].iter().map(|&page| (page, 0));
        let mut orphans = Orphans::default();
        for (page, from) in partial.into_iter().chain(whole) {
            if self.holders(page) != 1 {
                continue;
            }
            match self.pins.contains_key(&page) {
                false => orphans.now.push(self.page_run(page, from)),
                true => orphans.pinned.push((page, from)),
            }
        }
        orphans.now = merged(orphans.now);
        Ok(orphans)
    }

    /// Leaves the rows of `pinned` ([`Orphans::pinned`]) to be zeroed when their pages' last pins go.
    pub(crate) fn scrub_when_unpinned(&mut self, pinned: &[(u32, usize)]) {
        for &(page, from) in pinned
            .iter()
            .filter(|(page, _)| self.pins.contains_key(page))
        {
            let at = self.scrub_at_unpin.entry(page).or_insert(from);
            *at = (*at).min(from);
        }
    }

    /// Counts `copy.from` as held by a recorded copy that reads it (rows `[0, copy.rows[layer])` of
    /// each layer) when its encoder runs, until [`PageLedger::unpin`]: it does not return to the
    /// pool meanwhile, and a write into those rows goes into a private copy
    /// ([`PageLedger::must_copy`]).
    pub(crate) fn pin(&mut self, copy: &PageCopy) {
        self.pin_rows(copy.from, &copy.rows);
    }

    /// Pins every page of `seq` for encoders recorded over it that may still read or write them
    /// (before `seq` is removed or truncated), each with the rows of it `seq` sees per layer, as
    /// [`PageLedger::pin`] does for a recorded copy, until [`PageLedger::unpin`]: a page does not
    /// return to the pool meanwhile, its zeroing waits, and every holder, `seq` too, writes into
    /// those rows through a private copy. Returns the pages pinned.
    pub(crate) fn hold(&mut self, seq: SeqId) -> Result<Vec<u32>> {
        let s = self.seq(seq)?;
        let held: Vec<(u32, Vec<usize>)> = (s.pages.iter().enumerate())
            .map(|(i, &page)| (page, self.rows_seen(s, i)))
            .collect();
        for (page, rows) in &held {
            self.pin_rows(*page, rows);
        }
        Ok(held.into_iter().map(|(page, _)| page).collect())
    }

    /// Whether removing `seq` (`new_len` None) or truncating it to `new_len` rows drops a row it
    /// sees, committed or pending, if it may be truncated so.
    pub(crate) fn drops_rows(&self, seq: SeqId, new_len: Option<usize>) -> Result<bool> {
        let s = self.truncatable(seq, new_len.unwrap_or(0))?;
        Ok(new_len.is_none_or(|n| (0..self.shapes.len()).any(|layer| s.visible(layer) > n)))
    }

    /// Per layer, the rows of its page `i` that `s` sees (0 for a layer without slots).
    fn rows_seen(&self, s: &Sequence, i: usize) -> Vec<usize> {
        let p = self.page_size;
        (0..self.shapes.len())
            .map(|l| match self.shapes[l].is_empty() {
                true => 0,
                false => s.visible(l).saturating_sub(i * p).min(p),
            })
            .collect()
    }

    /// One more pin of `page`, whose writes below `rows` (per layer) go into a private copy.
    fn pin_rows(&mut self, page: u32, rows: &[usize]) {
        self.refs[page as usize] += 1;
        let pin = self.pins.entry(page).or_insert_with(|| Pin {
            count: 0,
            rows: vec![0; rows.len()],
        });
        pin.count += 1;
        for (most, &rows) in pin.rows.iter_mut().zip(rows) {
            *most = (*most).max(rows);
        }
    }

    /// Holders of `page` but the pins: the sequences and the published prefixes' trie.
    fn holders(&self, page: u32) -> u32 {
        self.refs[page as usize] - self.pins.get(&page).map_or(0, |pin| pin.count)
    }

    /// Whether a write into `layer` of `page` from its row `from` on goes into a private copy: the
    /// page has another holder, a pin (a recorded copy, a held encoder) still reads row `from` of
    /// it, or a zeroing waits for its pins ([`PageLedger::scrub_when_unpinned`], which would reach
    /// the rows written).
    fn must_copy(&self, page: u32, layer: usize, from: usize) -> bool {
        self.holders(page) > 1
            || self.scrub_waits(page)
            || self
                .pins
                .get(&page)
                .is_some_and(|pin| from < pin.rows[layer])
    }

    /// Drops one pin of each of `pages` ([`PageLedger::pin`]); a page no one else holds returns to
    /// the pool. Returns the rows to zero before anything takes them, in merged runs: where a scrub
    /// left a page to its pins, the whole page if it is free now, else its rows no holder sees.
    pub(crate) fn unpin(&mut self, pages: &[u32]) -> Vec<Run> {
        let mut runs = Vec::new();
        for &page in pages {
            let Some(pin) = self.pins.get_mut(&page) else {
                debug_assert!(false, "page {page} unpinned more often than pinned");
                continue;
            };
            pin.count -= 1;
            let last = pin.count == 0;
            self.release(page);
            if !last {
                continue;
            }
            self.pins.remove(&page);
            if let Some(from) = self.scrub_at_unpin.remove(&page) {
                let free = self.refs[page as usize] == 0;
                runs.push(self.page_run(page, if free { 0 } else { from }));
            }
        }
        merged(runs)
    }

    /// Whether a scrub waits for `page`'s pins to go ([`PageLedger::scrub_when_unpinned`]).
    pub(crate) fn scrub_waits(&self, page: u32) -> bool {
        self.scrub_at_unpin.contains_key(&page)
    }

    /// Whole `pages` as runs of pool rows, neighbours merged ([`merged`]).
    pub(crate) fn page_runs(&self, pages: &[u32]) -> Vec<Run> {
        merged(pages.iter().map(|&page| self.page_run(page, 0)).collect())
    }

    /// The rows of `page` from its row `from` on, as a run of pool rows.
    fn page_run(&self, page: u32, from: usize) -> Run {
        Run {
            page: 0,
            first_row: page as usize * self.page_size + from,
            n_rows: self.page_size - from,
        }
    }

    /// `seq`, if it may be truncated to `new_len` rows (at most its length).
    fn truncatable(&self, seq: SeqId, new_len: usize) -> Result<&Sequence> {
        let s = self.seq(seq)?;
        if new_len > s.len {
            return Err(Error::TruncateBeyondLength {
                seq: Some(seq),
                new_len,
                len: s.len,
            });
        }
        Ok(s)
    }

    /// Drops the rows of `seq` from `new_len` on (pending rows included) and returns the pages no
    /// longer needed to the pool.
    pub(crate) fn truncate(&mut self, seq: SeqId, new_len: usize) -> Result<()> {
        self.truncatable(seq, new_len)?;
        let keep = self.pages_for(new_len);
        let s = self.seqs.get_mut(&seq).expect("checked");
        let dropped = s.pages.split_off(keep);
        s.len = new_len;
        s.pending.iter_mut().for_each(|p| *p = 0);
        for page in dropped {
            self.release(page);
        }
        Ok(())
    }

    /// Commits `n` rows of `seq`: every layer with slots must hold exactly `n` pending rows.
    pub(crate) fn advance(&mut self, seq: SeqId, n: usize) -> Result<()> {
        self.check_advance(seq, n)?;
        self.commit(seq, n);
        Ok(())
    }

    /// Commits `n` rows of each `(seq, n)` at once, a sequence named more than once taking the sum
    /// of its counts: every sequence is checked first, in the order named, and a refusal commits
    /// none.
    pub(crate) fn advance_batch(&mut self, batch: &[(SeqId, usize)]) -> Result<()> {
        // Each sequence's sum, in the order first named (a map from sequence to its place: a batch
        // of thousands of sequences is not searched once per entry).
        let mut sums: Vec<(SeqId, usize)> = Vec::new();
        let mut place: BTreeMap<SeqId, usize> = BTreeMap::new();
        for &(seq, n) in batch {
            match place.get(&seq) {
                Some(&i) => sums[i].1 = sums[i].1.saturating_add(n),
                None => {
                    place.insert(seq, sums.len());
                    sums.push((seq, n));
                }
            }
        }
        for &(seq, n) in &sums {
            self.check_advance(seq, n)?;
        }
        for (seq, n) in sums {
            self.commit(seq, n);
        }
        Ok(())
    }

    /// Refuses to commit `n` rows of `seq` unless every layer with slots holds exactly `n` pending.
    fn check_advance(&self, seq: SeqId, n: usize) -> Result<()> {
        let s = self.seq(seq)?;
        let uneven =
            (0..self.shapes.len()).find(|&l| !self.shapes[l].is_empty() && s.pending[l] != n);
        if let Some(layer) = uneven {
            return Err(Error::UnevenAdvance {
                seq: Some(seq),
                layer,
                pending: s.pending[layer],
                expected: n,
                len: s.len,
            });
        }
        Ok(())
    }

    /// Commits the `n` pending rows of `seq` ([`PageLedger::check_advance`]ed).
    fn commit(&mut self, seq: SeqId, n: usize) {
        let s = self.seqs.get_mut(&seq).expect("checked");
        s.len += n;
        s.pending.iter_mut().for_each(|p| *p = 0);
    }

    /// Checks an append of slabs shaped `shape_of(s)` to `layer` of `seq` and plans it, changing
    /// nothing: the pages it takes, the copies of shared pages it writes into, and its runs.
    pub(crate) fn plan_append<'s>(
        &self,
        seq: SeqId,
        layer: usize,
        n_slabs: usize,
        shape_of: impl Fn(usize) -> &'s [usize],
    ) -> Result<PagedPlan> {
        let s = self.seq(seq)?;
        let n_new = slab_rows(layer, self.slot_shapes(layer)?, n_slabs, shape_of)?;
        let start_row = s.visible(layer);
        if n_new > self.max_seq_len - start_row {
            return Err(Error::CapacityExceeded {
                seq: Some(seq),
                layer,
                position: start_row,
                n_new,
                capacity: self.max_seq_len,
                remaining: self.max_seq_len - start_row,
            });
        }
        let mut plan = PagedPlan {
            seq,
            layer,
            start_row,
            n_new,
            fresh: Vec::new(),
            copies: Vec::new(),
            runs: Vec::new(),
        };
        if n_new == 0 {
            return Ok(plan);
        }
        let p = self.page_size;
        let (first, last) = (start_row / p, (start_row + n_new - 1) / p);
        // Fresh pages past those held, then held pages shared with another sequence: counted over
        // the pages held, so an append of far more rows than the pool holds is refused at once.
        let held = s.pages.len();
        let from = |i: usize| (i * p).max(start_row) - i * p;
        let shared = (first..(last + 1).min(held))
            .filter(|&i| self.must_copy(s.pages[i], layer, from(i)))
            .count();
        let needed = (last + 1).saturating_sub(held.max(first)) + shared;
        if needed > self.free.len() {
            return Err(Error::OutOfPages {
                needed,
                free: self.free.len(),
            });
        }
        let mut taken = self.free.iter().rev().copied();
        for i in first..=last {
            let page = if i >= s.pages.len() {
                let page = taken.next().expect("counted");
                plan.fresh.push(page);
                page
            } else if self.must_copy(s.pages[i], layer, from(i)) {
                let to = taken.next().expect("counted");
                plan.copies.push(PageCopy {
                    index: i,
                    from: s.pages[i],
                    to,
                    rows: self.rows_seen(s, i),
                });
                to
            } else {
                s.pages[i]
            };
            let lo = (i * p).max(start_row);
            let hi = ((i + 1) * p).min(start_row + n_new);
            plan.runs.push((
                lo - start_row,
                Run {
                    page: 0,
                    first_row: page as usize * p + lo - i * p,
                    n_rows: hi - lo,
                },
            ));
        }
        Ok(plan)
    }

    /// Records a plan from [`PageLedger::plan_append`] on this ledger, unchanged since.
    pub(crate) fn commit_append(&mut self, plan: &PagedPlan) {
        let taken = plan.fresh.len() + plan.copies.len();
        debug_assert!(taken <= self.free.len());
        self.free.truncate(self.free.len() - taken);
        for c in &plan.copies {
            self.refs[c.from as usize] -= 1;
            self.refs[c.to as usize] = 1;
        }
        for &page in &plan.fresh {
            self.refs[page as usize] = 1;
        }
        let s = self.seqs.get_mut(&plan.seq).expect("planned");
        for c in &plan.copies {
            s.pages[c.index] = c.to;
        }
        s.pages.extend(&plan.fresh);
        s.pending[plan.layer] += plan.n_new;
    }

    /// Plans appends of `n` rows to each `(seq, n)` of `batch` in `layer` (a sequence may come more
    /// than once), each as if the ones before it were committed, of slabs whose trailing dimensions
    /// are `trailing(s)`; changes nothing. The plans are made and committed here one after another,
    /// then undone in reverse order ([`PageLedger::revert_append`]): no copy of the ledger, whose
    /// published prefixes and other sequences a serving pool's batch does not touch.
    pub(crate) fn plan_batch<'s>(
        &mut self,
        layer: usize,
        batch: &[(SeqId, usize)],
        n_slabs: usize,
        trailing: impl Fn(usize) -> &'s [usize],
    ) -> Result<Vec<PagedPlan>> {
        let mut plans = Vec::with_capacity(batch.len());
        let mut refused = None;
        for &(seq, n) in batch {
            let shapes: Vec<Vec<usize>> = (0..n_slabs)
                .map(|s| [&[n][..], trailing(s)].concat())
                .collect();
            match self.plan_append(seq, layer, n_slabs, |s| &shapes[s]) {
                Ok(plan) => {
                    self.commit_append(&plan);
                    plans.push(plan);
                }
                Err(e) => {
                    refused = Some(e);
                    break;
                }
            }
        }
        for plan in plans.iter().rev() {
            self.revert_append(plan);
        }
        match refused {
            Some(e) => Err(e),
            None => Ok(plans),
        }
    }

    /// Undoes [`PageLedger::commit_append`] of `plan`, the last plan committed.
    fn revert_append(&mut self, plan: &PagedPlan) {
        let Some(s) = self.seqs.get_mut(&plan.seq) else {
            return;
        };
        s.pending[plan.layer] -= plan.n_new;
        s.pages.truncate(s.pages.len() - plan.fresh.len());
        for c in &plan.copies {
            s.pages[c.index] = c.from;
            self.refs[c.from as usize] += 1;
            self.refs[c.to as usize] = 0;
        }
        for &page in &plan.fresh {
            self.refs[page as usize] = 0;
        }
        // The plan took its pages from the end of the free list in page order, the copies (pages
        // the sequence held) before the fresh ones: they go back in reverse.
        self.free.extend(plan.fresh.iter().rev());
        self.free.extend(plan.copies.iter().rev().map(|c| c.to));
    }

    /// Publishes the full pages of `seq` that hold `tokens` (the token ids of its first
    /// `tokens.len()` committed rows, as the app says), so that [`PageLedger::add_with_prefix`] can
    /// start later sequences from them; the published pages stay in the pool, held by the ledger,
    /// after `seq` is gone. A page whose tokens follow a published prefix that already has a page for
    /// them is not published twice. Returns the rows of `tokens` that are published now (whole pages;
    /// a partly filled last page is not). Publishing stops, with what it did, at a page of `seq` that
    /// is published already under other tokens.
    pub(crate) fn publish(&mut self, seq: SeqId, tokens: &[u32]) -> Result<usize> {
        let s = self.seq(seq)?;
        if tokens.len() > s.len {
            return Err(Error::PrefixBeyondLength {
                seq,
                tokens: tokens.len(),
                len: s.len,
            });
        }
        let pages = s.pages[..tokens.len() / self.page_size].to_vec();
        let mut parent = None;
        let mut published = 0;
        for (own, chunk) in pages.into_iter().zip(tokens.chunks_exact(self.page_size)) {
            let page = match self.prefixes.child(parent, chunk) {
                Some(page) => page,
                None if self.prefixes.nodes.contains_key(&own) => break,
                None => {
                    let siblings = self.prefixes.by_key.entry(parent).or_default();
                    siblings.insert(chunk.to_vec(), own);
                    self.prefixes.nodes.insert(
                        own,
                        PrefixNode {
                            parent,
                            tokens: chunk.to_vec(),
                            children: 0,
                            used: 0,
                        },
                    );
                    if let Some(node) = parent.and_then(|p| self.prefixes.nodes.get_mut(&p)) {
                        node.children += 1;
                    }
                    self.refs[own as usize] += 1;
                    own
                }
            };
            self.touch(page);
            parent = Some(page);
            published += self.page_size;
        }
        Ok(published)
    }

    /// Marks a published page as used now.
    fn touch(&mut self, page: u32) {
        self.prefixes.clock += 1;
        if let Some(node) = self.prefixes.nodes.get_mut(&page) {
            node.used = self.prefixes.clock;
        }
    }

    /// The published pages of the longest published prefix of `tokens`, in order.
    pub(crate) fn published_prefix(&self, tokens: &[u32]) -> Vec<u32> {
        let mut pages = Vec::new();
        let limit = self.max_seq_len / self.page_size;
        for chunk in tokens.chunks_exact(self.page_size).take(limit) {
            match self.prefixes.child(pages.last().copied(), chunk) {
                Some(page) => pages.push(page),
                None => break,
            }
        }
        pages
    }

    /// A new sequence holding the longest published prefix of `tokens` (whole pages, shared as a
    /// fork shares them), and its length in rows.
    pub(crate) fn add_with_prefix(&mut self, tokens: &[u32]) -> Result<(SeqId, usize)> {
        let pages = self.published_prefix(tokens);
        let len = pages.len() * self.page_size;
        let seq = self.add_sharing(pages.clone(), len)?;
        for page in pages {
            self.touch(page);
        }
        Ok((seq, len))
    }

    /// Rows of `tokens` a sequence started from them would hold now: the longest published prefix,
    /// in whole pages.
    pub fn published_rows(&self, tokens: &[u32]) -> usize {
        self.published_prefix(tokens).len() * self.page_size
    }

    /// Published pages, held by sequences or not.
    pub fn published_pages(&self) -> usize {
        self.prefixes.nodes.len()
    }

    /// Published pages no sequence or pin holds: pages eviction can return to the pool (those
    /// [`PageLedger::evictable_pages`] counts now).
    pub fn cached_pages(&self) -> usize {
        self.prefixes
            .nodes
            .keys()
            .filter(|&&p| self.refs[p as usize] == 1)
            .count()
    }

    /// The pages `evict_prefixes(usize::MAX)` would return to the pool now: the cached pages but
    /// those on the way to a published page a sequence holds (see
    /// [`PagedCache::evictable_pages`](crate::PagedCache::evictable_pages) for what admission can
    /// count on).
    pub fn evictable_pages(&self) -> usize {
        let mut kept = std::collections::BTreeSet::new();
        for &page in self.prefixes.nodes.keys() {
            if self.refs[page as usize] > 1 {
                let mut at = Some(page);
                while let Some(p) = at.filter(|&p| kept.insert(p)) {
                    at = self.prefixes.nodes[&p].parent;
                }
            }
        }
        self.prefixes.nodes.len() - kept.len()
    }

    /// Returns up to `n` published pages that no sequence holds to the pool, least recently used
    /// first; a page goes only after the pages published after it on the same prefix. Returns how
    /// many went.
    pub(crate) fn evict_prefixes(&mut self, n: usize) -> usize {
        self.evict_prefix_pages(n).len()
    }

    /// [`PageLedger::evict_prefixes`], returning the pages it freed.
    pub(crate) fn evict_prefix_pages(&mut self, n: usize) -> Vec<u32> {
        use std::cmp::Reverse;
        use std::collections::BinaryHeap;
        let evictable = |l: &Self, page: u32| {
            l.prefixes.nodes[&page].children == 0 && l.refs[page as usize] == 1
        };
        let mut heap: BinaryHeap<Reverse<(u64, u32)>> = self
            .prefixes
            .nodes
            .iter()
            .filter(|&(&p, _)| evictable(self, p))
            .map(|(&p, node)| Reverse((node.used, p)))
            .collect();
        let mut evicted = Vec::new();
        while evicted.len() < n {
            let Some(Reverse((_, page))) = heap.pop() else {
                break;
            };
            let node = self.prefixes.nodes.remove(&page).expect("in the trie");
            if let Some(siblings) = self.prefixes.by_key.get_mut(&node.parent) {
                siblings.remove(&node.tokens);
                if siblings.is_empty() {
                    self.prefixes.by_key.remove(&node.parent);
                }
            }
            self.release(page);
            evicted.push(page);
            if let Some(parent) = node.parent {
                let p = self
                    .prefixes
                    .nodes
                    .get_mut(&parent)
                    .expect("parents outlive children");
                p.children -= 1;
                if evictable(self, parent) {
                    heap.push(Reverse((self.prefixes.nodes[&parent].used, parent)));
                }
            }
        }
        evicted
    }

    /// Whether appending `n` more rows to every layer of each `(seq, n)` fits at once, pages and
    /// lengths both; a sequence named twice takes the sum of its counts. Refuses with the first
    /// length past `max_seq_len` in id order, else with the pages the whole growth lacks. Changes
    /// nothing. Where several writers of a page do not all write from the same row of it, or one
    /// writes into the rows a pin reads (a recorded copy, a held encoder) or into a page whose
    /// zeroing waits, each writer counts a private copy: which one writes last, and where, depends
    /// on the order of the appends, and in a recorded step an earlier writer's copy pins the page
    /// with the rows it read, so a later writer below them copies it too.
    pub fn admits(&self, growth: &[(SeqId, usize)]) -> Result<()> {
        let mut per_seq: BTreeMap<SeqId, usize> = BTreeMap::new();
        for &(seq, n) in growth {
            self.seq(seq)?;
            let total = per_seq.entry(seq).or_default();
            *total = total.saturating_add(n);
        }
        // Pages written into: how many writers, whether one writes below the rows a pin
        // reads (or into a page whose zeroing waits for its pins), and the row of the page each
        // layer of the first writer writes from (None where they differ between writers).
        type Starts = Option<Vec<Option<usize>>>;
        let mut writers: BTreeMap<u32, (u32, bool, Starts)> = BTreeMap::new();
        let mut needed = 0usize;
        for (&seq, &n) in &per_seq {
            let s = &self.seqs[&seq];
            // The highest visible row of any layer, and the first layer that has it.
            let (layer, top) = (0..self.shapes.len())
                .filter(|&l| !self.shapes[l].is_empty())
                .map(|l| (l, s.visible(l)))
                .fold(None, |best: Option<(usize, usize)>, (l, v)| match best {
                    Some((_, b)) if b >= v => best,
                    _ => Some((l, v)),
                })
                .unwrap_or((0, s.len));
            if n > self.max_seq_len - top {
                return Err(Error::CapacityExceeded {
                    seq: Some(seq),
                    layer,
                    position: top,
                    n_new: n,
                    capacity: self.max_seq_len,
                    remaining: self.max_seq_len - top,
                });
            }
            if n == 0 {
                continue;
            }
            // Every layer writes rows up to top + n; the lowest first write is at the lowest
            // visible row of any layer.
            let low = (0..self.shapes.len())
                .filter(|&l| !self.shapes[l].is_empty())
                .map(|l| s.visible(l))
                .min()
                .unwrap_or(s.len);
            let (first, end) = (low / self.page_size, self.pages_for(top + n));
            // Saturating: a sequence may ask for more rows than any count of pages holds.
            needed = needed.saturating_add(end.saturating_sub(s.pages.len()));
            for (i, &page) in s.pages.iter().enumerate().take(end).skip(first) {
                let p = self.page_size;
                // Per layer, the row of the page its first write lands on, if it writes here.
                let starts: Vec<Option<usize>> = (0..self.shapes.len())
                    .map(|l| {
                        let v = s.visible(l);
                        (!self.shapes[l].is_empty() && v < (i + 1) * p)
                            .then(|| v.max(i * p) - i * p)
                    })
                    .collect();
                let below = self.scrub_waits(page)
                    || self.pins.get(&page).is_some_and(|pin| {
                        (starts.iter().zip(&pin.rows)).any(|(s, &rows)| s.is_some_and(|s| s < rows))
                    });
                match writers.entry(page) {
                    Entry::Vacant(e) => {
                        e.insert((1, below, Some(starts)));
                    }
                    Entry::Occupied(mut e) => {
                        let (n, b, first) = e.get_mut();
                        *n += 1;
                        *b |= below;
                        if first.as_ref() != Some(&starts) {
                            *first = None;
                        }
                    }
                }
            }
        }
        // Each writer of a page copies it but the last one holding it; every writer copies where one
        // writes below a pin's rows, or where they write from different rows (the order of the
        // writes, layer by layer, decides which writer is last, and whether it writes below them).
        for (&page, (n, below, starts)) in &writers {
            let (n, below) = (*n, *below || starts.is_none());
            let copies = if below || self.holders(page) > n {
                n
            } else {
                n - 1
            };
            needed = needed.saturating_add(copies as usize);
        }
        if needed > self.free.len() {
            return Err(Error::OutOfPages {
                needed,
                free: self.free.len(),
            });
        }
        Ok(())
    }
}

/// `runs` of pool rows sorted, neighbours (a free list often hands out pages in order) merged into
/// one run: a zeroing dispatch per run and slot.
fn merged(mut runs: Vec<Run>) -> Vec<Run> {
    runs.sort_by_key(|r| r.first_row);
    let mut merged: Vec<Run> = Vec::with_capacity(runs.len());
    for r in runs {
        match merged.last_mut() {
            Some(last) if last.first_row + last.n_rows == r.first_row => last.n_rows += r.n_rows,
            _ => merged.push(r),
        }
    }
    merged
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::DType;
    use crate::spec::LayerSpec;
    use std::collections::HashMap;

    fn spec(max_seq_len: usize) -> CacheSpec {
        CacheSpec::new(
            vec![
                LayerSpec::kv(1, 2, 2),
                LayerSpec::empty(),
                LayerSpec::mla(3, 1),
            ],
            DType::F32,
            max_seq_len,
        )
        .unwrap()
    }

    #[test]
    fn the_last_sequence_id_is_refused_and_changes_nothing() {
        let mut l = PageLedger::new(&spec(8), 2, 4);
        l.next_id = u32::MAX - 1;
        let last = SeqId {
            pool: l.pool,
            n: u32::MAX - 1,
        };
        assert_eq!(l.check_add(), Ok(()));
        assert_eq!(l.add(), Ok(last));
        let before = l.clone();
        assert_eq!(l.check_add(), Err(Error::SequenceIdsExhausted));
        assert_eq!(l.add(), Err(Error::SequenceIdsExhausted));
        assert_eq!(l.fork(last, 0), Err(Error::SequenceIdsExhausted));
        assert_eq!(l.add_with_prefix(&[]), Err(Error::SequenceIdsExhausted));
        assert_eq!(l, before);
    }

    /// A refused admission names the first layer with slots, not layer 0 (which has none here).
    #[test]
    fn admission_names_a_layer_that_has_slots() {
        let mut l = PageLedger::new(&CacheSpec::hybrid(DType::F32, 16).unwrap(), 4, 8);
        let seq = l.add().unwrap();
        let before = l.clone();
        assert!(
            matches!(
                l.admits(&[(seq, 17)]),
                Err(Error::CapacityExceeded {
                    layer: 3,
                    position: 0,
                    n_new: 17,
                    ..
                })
            ),
            "{:?}",
            l.admits(&[(seq, 17)])
        );
        assert_eq!(l, before);
    }

    /// Appends and admissions of far more rows than the pool has pages for are refused at once,
    /// counted without walking their pages and without overflow (2^46 pages, or a sum past
    /// `usize::MAX`).
    #[test]
    #[cfg(target_pointer_width = "64")]
    fn growth_past_every_page_is_refused_at_once() {
        let huge = 1usize << 50;
        let mut l = PageLedger::new(&spec(huge), 16, 64);
        let a = l.add().unwrap();
        let before = l.clone();
        let s: Vec<Vec<usize>> = l.shapes[0]
            .iter()
            .map(|t| [&[huge][..], t].concat())
            .collect();
        assert_eq!(
            l.plan_append(a, 0, 2, |i| &s[i]).unwrap_err(),
            Error::OutOfPages {
                needed: huge / 16,
                free: 64
            }
        );
        assert_eq!(l, before);
        // One scalar row each: 129 sequences of 2^57 rows in pages of one row ask for more pages
        // than usize counts.
        let scalar = LayerSpec::new(vec![crate::spec::SlotSpec::new("s", &[1])]);
        let spec = CacheSpec::new(vec![scalar], DType::F32, 1 << 57).unwrap();
        let mut l = PageLedger::new(&spec, 1, 16);
        let seqs: Vec<_> = (0..129).map(|_| l.add().unwrap()).collect();
        let growth: Vec<_> = seqs.iter().map(|&q| (q, 1 << 57)).collect();
        assert_eq!(
            l.admits(&growth).unwrap_err(),
            Error::OutOfPages {
                needed: usize::MAX,
                free: 16
            }
        );
        assert_eq!(l.admits(&[(seqs[0], 16)]), Ok(()));
    }

    /// A refused admission of many sequences names the one that would not fit.
    #[test]
    fn admission_names_the_sequence_that_does_not_fit() {
        let mut l = PageLedger::new(&spec(8), 4, 8);
        let (a, b) = (l.add().unwrap(), l.add().unwrap());
        let e = l.admits(&[(a, 2), (b, 9)]).unwrap_err();
        assert_eq!(
            e,
            Error::CapacityExceeded {
                seq: Some(b),
                layer: 0,
                position: 0,
                n_new: 9,
                capacity: 8,
                remaining: 8,
            }
        );
        assert_eq!(
            e.to_string(),
            format!(
                "{b}, layer 0: appending 9 rows at position 0 exceeds the capacity of 8 rows (8 left)"
            )
        );
    }

    /// A pool's refused advance and truncate name the sequence, and change nothing.
    #[test]
    fn advance_and_truncate_name_the_sequence() {
        let mut l = PageLedger::new(&spec(8), 4, 8);
        let (a, b) = (l.add().unwrap(), l.add().unwrap());
        let plan = l.plan_append(b, 0, 2, |_| &[2, 1, 2][..]).unwrap();
        l.commit_append(&plan);
        let before = l.clone();
        let e = l.advance(b, 2).unwrap_err();
        assert_eq!(
            e,
            Error::UnevenAdvance {
                seq: Some(b),
                layer: 2,
                pending: 0,
                expected: 2,
                len: 0,
            }
        );
        assert!(
            e.to_string().starts_with(&format!("{b}, advance(2)")),
            "{e}"
        );
        let e = l.truncate(a, 1).unwrap_err();
        assert_eq!(
            e,
            Error::TruncateBeyondLength {
                seq: Some(a),
                new_len: 1,
                len: 0,
            }
        );
        assert!(
            e.to_string().starts_with(&format!("{a}, cannot truncate")),
            "{e}"
        );
        assert_eq!(l, before);
    }

    /// Pool contents by (layer, pool row): a value naming what was written there.
    type Pool = HashMap<(usize, usize), u64>;

    /// What a plan does to the pool: the copies first, then the rows.
    fn apply(pool: &mut Pool, plan: &PagedPlan, page_size: usize, values: &[u64]) {
        COPIES.with(|c| c.set(c.get() + plan.copies.len()));
        for c in &plan.copies {
            for (layer, &rows) in c.rows.iter().enumerate() {
                for r in 0..rows {
                    let from = pool.get(&(layer, c.from as usize * page_size + r)).copied();
                    let to = (layer, c.to as usize * page_size + r);
                    match from {
                        Some(v) => pool.insert(to, v),
                        None => pool.remove(&to),
                    };
                }
            }
        }
        for (first, run) in &plan.runs {
            for k in 0..run.n_rows {
                pool.insert((plan.layer, run.first_row + k), values[first + k]);
            }
        }
    }

    /// Published token prefixes (whole pages) and the rows of every layer they hold.
    type Published = BTreeMap<Vec<u32>, Vec<Vec<u64>>>;

    /// Every invariant of the ledger, every sequence's rows read through its page table, and every
    /// published prefix's rows read through its pages.
    fn check(
        l: &PageLedger,
        pool: &Pool,
        model: &BTreeMap<SeqId, Vec<Vec<u64>>>,
        published: &Published,
    ) {
        let mut refs = vec![0u32; l.n_pages()];
        let t = &l.prefixes;
        for (&page, node) in &t.nodes {
            refs[page as usize] += 1;
            assert_eq!(
                t.child(node.parent, &node.tokens).unwrap(),
                page,
                "trie key"
            );
            assert_eq!(node.tokens.len(), l.page_size);
            let children = t.nodes.values().filter(|n| n.parent == Some(page)).count();
            assert_eq!(node.children, children, "children of {page}");
            assert!(node.parent.is_none_or(|p| t.nodes.contains_key(&p)));
        }
        assert_eq!(
            t.by_key.values().map(|s| s.len()).sum::<usize>(),
            t.nodes.len()
        );
        assert!(t.by_key.values().all(|s| !s.is_empty()));
        for (tokens, rows) in published {
            let pages = l.published_prefix(tokens);
            assert_eq!(
                pages.len() * l.page_size,
                tokens.len(),
                "published {tokens:?}"
            );
            for (layer, rows) in rows.iter().enumerate() {
                if l.shapes[layer].is_empty() {
                    continue;
                }
                for (r, v) in rows.iter().enumerate() {
                    let at = pages[r / l.page_size] as usize * l.page_size + r % l.page_size;
                    assert_eq!(
                        pool.get(&(layer, at)),
                        Some(v),
                        "published layer {layer} row {r}"
                    );
                }
            }
        }
        for (&id, s) in &l.seqs {
            let top = (0..l.n_layers())
                .filter(|&layer| !l.shapes[layer].is_empty())
                .map(|layer| s.visible(layer))
                .max()
                .unwrap_or(s.len);
            assert_eq!(s.pages.len(), top.div_ceil(l.page_size), "{id}: pages");
            let mut seen = s.pages.clone();
            seen.sort();
            seen.dedup();
            assert_eq!(seen.len(), s.pages.len(), "{id}: a page twice");
            for &p in &s.pages {
                refs[p as usize] += 1;
            }
            let want = &model[&id];
            for (layer, rows) in want.iter().enumerate() {
                if l.shapes[layer].is_empty() {
                    continue;
                }
                assert_eq!(s.visible(layer), rows.len(), "{id} layer {layer}: visible");
                for (r, v) in rows.iter().enumerate() {
                    let at = s.pages[r / l.page_size] as usize * l.page_size + r % l.page_size;
                    assert_eq!(
                        pool.get(&(layer, at)),
                        Some(v),
                        "{id} layer {layer} row {r}"
                    );
                }
            }
        }
        for (&page, n) in &l.pins {
            refs[page as usize] += n.count;
        }
        assert_eq!(refs, l.refs, "reference counts");
        let mut free: Vec<u32> = (0..l.n_pages() as u32)
            .filter(|&p| refs[p as usize] == 0)
            .collect();
        let mut listed = l.free.clone();
        listed.sort();
        free.sort();
        assert_eq!(listed, free, "free list");
        assert_eq!(model.len(), l.seqs.len());
    }

    /// A scrub of `runs`: their rows leave the pool (no row a sequence sees may be among them).
    fn zero(pool: &mut Pool, runs: &[Run]) {
        for run in runs {
            for layer in 0..3 {
                for r in run.first_row..run.first_row + run.n_rows {
                    pool.remove(&(layer, r));
                }
            }
        }
    }

    /// Pinned copies with the rows they read when pinned.
    type Pinned = Vec<(PageCopy, Vec<Option<u64>>)>;

    /// The rows `copy` reads from its page, every layer's.
    fn copied_rows(pool: &Pool, page_size: usize, copy: &PageCopy) -> Vec<Option<u64>> {
        let first = copy.from as usize * page_size;
        (copy.rows.iter().enumerate())
            .flat_map(|(layer, &n)| (first..first + n).map(move |r| (layer, r)))
            .map(|at| pool.get(&at).copied())
            .collect()
    }

    /// Pins the pages committed `plans` copy, as a recorded append does; returns how many.
    fn pin_copies(
        l: &mut PageLedger,
        pool: &Pool,
        pinned: &mut Pinned,
        plans: &[PagedPlan],
    ) -> usize {
        let copies: Vec<&PageCopy> = plans.iter().flat_map(|p| &p.copies).collect();
        for &copy in &copies {
            l.pin(copy);
            pinned.push((copy.clone(), copied_rows(pool, l.page_size, copy)));
        }
        copies.len()
    }

    /// A quarter of the time where removing `seq` (`new_len` None) or truncating it drops rows, holds
    /// every page of it as for an encoder recorded over it ([`PageLedger::hold`]), each pin with
    /// the rows of the page `seq` sees and those rows' values now; returns how many pages.
    fn hold_sometimes(
        l: &mut PageLedger,
        pool: &Pool,
        pinned: &mut Pinned,
        (seq, new_len): (SeqId, Option<usize>),
        rng: &mut crate::reference::Xorshift,
    ) -> usize {
        if rng.below(4) != 0 || l.drops_rows(seq, new_len) != Ok(true) {
            return 0;
        }
        let (s, p) = (&l.seqs[&seq], l.page_size);
        let held: Vec<PageCopy> = (s.pages.iter().enumerate())
            .map(|(index, &page)| PageCopy {
                index,
                from: page,
                to: page,
                rows: (0..l.shapes.len())
                    .map(|layer| s.visible(layer).saturating_sub(index * p).min(p))
                    .collect(),
            })
            .collect();
        assert_eq!(
            l.hold(seq).unwrap(),
            held.iter().map(|h| h.from).collect::<Vec<_>>()
        );
        for h in &held {
            pinned.push((h.clone(), copied_rows(pool, p, h)));
        }
        held.len()
    }

    thread_local! {
        /// Private page copies the random test's plans made.
        static COPIES: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
    }

    #[test]
    fn random_operations_keep_pages_counts_and_rows_consistent() {
        let (page_size, n_pages, max_len) = (4, 24, 40);
        let spec = spec(max_len);
        let shapes = slot_shapes_of(&spec);
        let slot_layers: Vec<usize> = (0..3).filter(|&l| !shapes[l].is_empty()).collect();
        let mut out_of_pages = 0;
        let mut matched = 0;
        // Pages pinned as if by recorded copies, and unpins that returned rows a scrub left.
        let (mut pins, mut scrubbed) = (0, 0);
        // Pages held as if for encoders recorded over sequences removed or truncated.
        let mut holds = 0;
        for seed in 1..=40u64 {
            let mut rng = crate::reference::Xorshift::new(seed);
            let mut l = PageLedger::new(&spec, page_size, n_pages);
            let mut pool = Pool::new();
            let mut model: BTreeMap<SeqId, Vec<Vec<u64>>> = BTreeMap::new();
            let mut published = Published::new();
            let mut counter = 0u64;
            let mut refused = 0;
            let mut out_of_pages_seen = false;
            // Pages pinned by copies taken as if recorded, with their rows when pinned.
            let mut pinned: Pinned = Vec::new();
            for _ in 0..800 {
                // Now and then a recorded copy is done: its page kept the rows it reads, and the rows a
                // scrub left to it are rows no holder sees (zeroed here, gone from the pool).
                if !pinned.is_empty() && rng.below(40) == 0 {
                    let (copy, rows) = pinned.swap_remove(rng.below(pinned.len()));
                    let page = copy.from;
                    assert_eq!(
                        copied_rows(&pool, page_size, &copy),
                        rows,
                        "seed {seed}: rows of page {page} a copy reads written"
                    );
                    for run in l.unpin(&[page]) {
                        scrubbed += 1;
                        let (page, from) = (run.first_row / page_size, run.first_row % page_size);
                        assert!(l.refs[page] > 0 || from == 0, "a free page zeroed whole");
                        for s in l.seqs.values() {
                            for (i, _) in s
                                .pages
                                .iter()
                                .enumerate()
                                .filter(|&(_, &p)| p as usize == page)
                            {
                                for layer in 0..3 {
                                    assert!(
                                        s.visible(layer) <= i * page_size + from,
                                        "seed {seed}: a seen row zeroed"
                                    );
                                }
                            }
                        }
                        zero(&mut pool, &[run]);
                    }
                    check(&l, &pool, &model, &published);
                }
                let ids: Vec<SeqId> = model.keys().copied().collect();
                // Mostly live sequences; sometimes one never added.
                let pick = |rng: &mut crate::reference::Xorshift| {
                    if ids.is_empty() || rng.below(20) == 0 {
                        SeqId {
                            pool: l.pool,
                            n: 1000 + rng.below(5) as u32,
                        }
                    } else {
                        ids[rng.below(ids.len())]
                    }
                };
                let before = l.clone();
                // Every step: the pages eviction would free now, counted without evicting.
                let evictable = before.clone().evict_prefixes(usize::MAX);
                assert_eq!(l.evictable_pages(), evictable, "seed {seed}");
                assert!(evictable <= l.cached_pages());
                // The token ids of a sequence's rows: its layer-0 values (each row's is unique).
                let tokens_of = |model: &BTreeMap<SeqId, Vec<Vec<u64>>>, seq: SeqId, n: usize| {
                    let rows = model.get(&seq).map_or(&[][..], |m| &m[0][..]);
                    (0..n)
                        .map(|r| rows.get(r).map_or(u32::MAX, |&v| v as u32))
                        .collect::<Vec<u32>>()
                };
                let result = match rng.below(15) {
                    0 => l.add().map(|id| {
                        model.insert(id, vec![Vec::new(); 3]);
                    }),
                    1 | 10 => {
                        // Half the time with a scrub: what pins hold waits for them.
                        let seq = pick(&mut rng);
                        let scrub = rng.below(2) == 0;
                        holds += hold_sometimes(&mut l, &pool, &mut pinned, (seq, None), &mut rng);
                        let orphans = l.orphaned_rows(seq, None);
                        l.remove(seq).map(|()| {
                            model.remove(&seq);
                            if scrub {
                                let orphans = orphans.unwrap();
                                zero(&mut pool, &orphans.now);
                                l.scrub_when_unpinned(&orphans.pinned);
                            }
                        })
                    }
                    2 | 11 => {
                        let seq = pick(&mut rng);
                        let len = l.len(seq).unwrap_or(0);
                        let at = rng.below(len + 2);
                        l.fork(seq, at).map(|child| {
                            let rows = model[&seq]
                                .iter()
                                .map(|r| r[..at.min(r.len())].to_vec())
                                .collect();
                            model.insert(child, rows);
                        })
                    }
                    3 => {
                        let seq = pick(&mut rng);
                        let len = l.len(seq).unwrap_or(0);
                        let new_len = rng.below(len + 2);
                        let scrub = rng.below(2) == 0;
                        let at = (seq, Some(new_len));
                        holds += hold_sometimes(&mut l, &pool, &mut pinned, at, &mut rng);
                        let orphans = l.orphaned_rows(seq, Some(new_len));
                        l.truncate(seq, new_len).map(|()| {
                            for rows in model.get_mut(&seq).unwrap() {
                                rows.truncate(new_len);
                            }
                            if scrub {
                                let orphans = orphans.unwrap();
                                zero(&mut pool, &orphans.now);
                                l.scrub_when_unpinned(&orphans.pinned);
                            }
                        })
                    }
                    4..=6 if rng.below(3) == 0 => {
                        // A batch: each sequence's rows planned after the ones before it (one
                        // sequence may come twice), as on a copy committing each plan in turn.
                        let layer = slot_layers[rng.below(slot_layers.len())];
                        let batch: Vec<(SeqId, usize)> = (0..1 + rng.below(3))
                            .map(|_| (pick(&mut rng), rng.below(page_size + 2)))
                            .collect();
                        let trailing = &shapes[layer];
                        let shapes_of = |n: usize| -> Vec<Vec<usize>> {
                            trailing.iter().map(|t| [&[n][..], t].concat()).collect()
                        };
                        let mut copy = l.clone();
                        let want: Result<Vec<PagedPlan>> = batch
                            .iter()
                            .map(|&(seq, n)| {
                                let shapes_of = shapes_of(n);
                                let plan = copy.plan_append(seq, layer, 2, |s| &shapes_of[s])?;
                                copy.commit_append(&plan);
                                Ok(plan)
                            })
                            .collect();
                        let got = l.plan_batch(layer, &batch, 2, |s| &trailing[s]);
                        assert_eq!(got, want, "seed {seed}: {batch:?}");
                        assert_eq!(
                            l, before,
                            "seed {seed}: planning a batch changed the ledger"
                        );
                        let recorded = rng.below(2) == 0;
                        got.map(|plans| {
                            for (plan, &(seq, n)) in plans.iter().zip(&batch) {
                                let values: Vec<u64> = (0..n as u64).map(|k| counter + k).collect();
                                counter += n as u64;
                                apply(&mut pool, plan, page_size, &values);
                                l.commit_append(plan);
                                model.get_mut(&seq).unwrap()[layer].extend(&values);
                            }
                            if recorded {
                                pins += pin_copies(&mut l, &pool, &mut pinned, &plans);
                            }
                        })
                    }
                    4..=6 => {
                        let seq = pick(&mut rng);
                        let layer = if rng.below(15) == 0 {
                            rng.below(4)
                        } else {
                            slot_layers[rng.below(slot_layers.len())]
                        };
                        let n = rng.below(2 * page_size + 2);
                        let shapes_of: Vec<Vec<usize>> = shapes
                            .get(layer)
                            .map(|s| s.iter().map(|t| [&[n][..], t].concat()).collect())
                            .unwrap_or_default();
                        let values: Vec<u64> = (0..n as u64).map(|k| counter + k).collect();
                        counter += n as u64;
                        let recorded = rng.below(2) == 0;
                        l.plan_append(seq, layer, shapes_of.len(), |s| &shapes_of[s])
                            .map(|plan| {
                                apply(&mut pool, &plan, page_size, &values);
                                l.commit_append(&plan);
                                model.get_mut(&seq).unwrap()[layer].extend(&values);
                                if recorded {
                                    pins += pin_copies(&mut l, &pool, &mut pinned, &[plan]);
                                }
                            })
                    }
                    7 => {
                        let seq = pick(&mut rng);
                        let pending = l.pending(seq, 0).unwrap_or(0);
                        let n = if rng.below(3) == 0 {
                            rng.below(3)
                        } else {
                            pending
                        };
                        l.advance(seq, n)
                    }
                    8 | 9 if rng.below(2) == 0 => {
                        // A whole step: every layer, then advance (when every layer took its rows).
                        let seq = pick(&mut rng);
                        let n = 1 + rng.below(page_size + 1);
                        let mut step = Ok(());
                        for &layer in &slot_layers {
                            let shapes_of: Vec<Vec<usize>> = shapes[layer]
                                .iter()
                                .map(|t| [&[n][..], t].concat())
                                .collect();
                            let values: Vec<u64> = (0..n as u64).map(|k| counter + k).collect();
                            counter += n as u64;
                            match l.plan_append(seq, layer, 2, |s| &shapes_of[s]) {
                                Ok(plan) => {
                                    apply(&mut pool, &plan, page_size, &values);
                                    l.commit_append(&plan);
                                    model.get_mut(&seq).unwrap()[layer].extend(&values);
                                    if rng.below(2) == 0 {
                                        pins += pin_copies(&mut l, &pool, &mut pinned, &[plan]);
                                    }
                                }
                                Err(e) => {
                                    step = Err(e);
                                    break;
                                }
                            }
                        }
                        if step.is_ok() && l.pending(seq, 0) == l.pending(seq, 2) {
                            let pending = l.pending(seq, 0).unwrap();
                            l.advance(seq, pending).unwrap();
                        }
                        // A refused step may have changed earlier layers: check, then move on.
                        check(&l, &pool, &model, &published);
                        continue;
                    }
                    12 => {
                        // Publish some of a sequence's committed rows (sometimes more than it has).
                        let seq = pick(&mut rng);
                        let len = l.len(seq).unwrap_or(0);
                        let tokens = tokens_of(&model, seq, rng.below(len + 2));
                        l.publish(seq, &tokens).map(|rows| {
                            assert_eq!(rows % page_size, 0);
                            assert!(rows <= tokens.len() / page_size * page_size);
                            for end in (page_size..=rows).step_by(page_size) {
                                let held: Vec<Vec<u64>> = model[&seq]
                                    .iter()
                                    .map(|r| r[..end.min(r.len())].to_vec())
                                    .collect();
                                let old = published.insert(tokens[..end].to_vec(), held.clone());
                                assert!(old.is_none_or(|o| o == held), "same tokens, other rows");
                            }
                        })
                    }
                    13 => {
                        // A sequence from a published prefix, a live sequence's tokens, or new ones.
                        let mut tokens = match rng.below(3) {
                            0 if !published.is_empty() => {
                                let keys: Vec<&Vec<u32>> = published.keys().collect();
                                keys[rng.below(keys.len())].clone()
                            }
                            1 => {
                                let seq = pick(&mut rng);
                                let len = l.len(seq).unwrap_or(0);
                                tokens_of(&model, seq, len)
                            }
                            _ => Vec::new(),
                        };
                        tokens.extend((0..rng.below(2 * page_size)).map(|_| rng.below(3) as u32));
                        let want = (0..=tokens.len() / page_size)
                            .rev()
                            .map(|k| k * page_size)
                            .find(|&n| n == 0 || published.contains_key(&tokens[..n]))
                            .unwrap();
                        l.add_with_prefix(&tokens).map(|(id, len)| {
                            assert_eq!(len, want, "seed {seed}: the longest published prefix");
                            matched += usize::from(len > 0);
                            let rows = match len {
                                0 => vec![Vec::new(); 3],
                                _ => published[&tokens[..len]].clone(),
                            };
                            model.insert(id, rows);
                        })
                    }
                    14 => {
                        let n = rng.below(4);
                        let (free, cached) = (l.free_pages(), l.cached_pages());
                        let evicted = l.evict_prefixes(n);
                        assert!(evicted <= n.min(cached));
                        assert_eq!(l.free_pages(), free + evicted);
                        assert_eq!(l.cached_pages(), cached - evicted);
                        if evicted < n {
                            assert_eq!(l.clone().evict_prefixes(1), 0, "an evictable page left");
                        }
                        published.retain(|tokens, _| {
                            l.published_prefix(tokens).len() * page_size == tokens.len()
                        });
                        Ok(())
                    }
                    _ => {
                        // Admission says whether every layer can take n more rows; the appends agree.
                        let seq = pick(&mut rng);
                        let n = rng.below(3 * page_size);
                        match l.admits(&[(seq, n)]) {
                            Ok(()) => {
                                for &layer in &slot_layers {
                                    let grow = n;
                                    let shapes_of: Vec<Vec<usize>> = shapes[layer]
                                        .iter()
                                        .map(|t| [&[grow][..], t].concat())
                                        .collect();
                                    let values: Vec<u64> =
                                        (0..grow as u64).map(|k| counter + k).collect();
                                    counter += grow as u64;
                                    let plan = l
                                        .plan_append(seq, layer, 2, |s| &shapes_of[s])
                                        .expect("admitted");
                                    apply(&mut pool, &plan, page_size, &values);
                                    l.commit_append(&plan);
                                    model.get_mut(&seq).unwrap()[layer].extend(&values);
                                }
                                Ok(())
                            }
                            Err(e) => {
                                // Exact, not cautious: the same appends on a copy meet a refusal.
                                let mut trial = l.clone();
                                let fails = slot_layers.iter().any(|&layer| {
                                    let shapes_of: Vec<Vec<usize>> = shapes[layer]
                                        .iter()
                                        .map(|t| [&[n][..], t].concat())
                                        .collect();
                                    match trial.plan_append(seq, layer, 2, |s| &shapes_of[s]) {
                                        Ok(plan) => {
                                            trial.commit_append(&plan);
                                            false
                                        }
                                        Err(_) => true,
                                    }
                                });
                                assert!(fails, "seed {seed}: admits refused ({e}) what fits");
                                Err(e)
                            }
                        }
                    }
                };
                if let Err(e) = result {
                    refused += 1;
                    out_of_pages_seen |= matches!(e, Error::OutOfPages { .. });
                    assert_eq!(l, before, "seed {seed}: a refusal changed the ledger: {e}");
                }
                check(&l, &pool, &model, &published);
            }
            assert!(refused > 10, "seed {seed}: only {refused} refusals");
            out_of_pages += usize::from(out_of_pages_seen);
            for (copy, rows) in pinned {
                assert_eq!(copied_rows(&pool, page_size, &copy), rows, "seed {seed}");
                l.unpin(&[copy.from]);
            }
            for id in model.keys() {
                l.remove(*id).unwrap();
            }
            assert_eq!(l.cached_pages(), l.published_pages());
            let held = l.published_pages();
            assert_eq!(l.evict_prefixes(usize::MAX), held, "seed {seed}");
            assert_eq!(l.published_pages(), 0);
            assert_eq!(l.free_pages(), n_pages, "seed {seed}: pages leaked");
        }
        // The runs reached the interesting states: private copies, and a full pool.
        let copies = COPIES.with(|c| c.get());
        eprintln!(
            "{copies} page copies; {out_of_pages} of 40 runs ran out of pages; {matched} sequences \
             started from published pages; {pins} pins, {holds} held pages, {scrubbed} scrubs at an \
             unpin"
        );
        assert!(
            copies > 100
                && out_of_pages > 10
                && matched > 100
                && pins > 20
                && holds > 50
                && scrubbed > 3,
            "{copies} copies, {out_of_pages} full pools, {matched} sequences from published pages, \
             {pins} pins, {holds} held pages, {scrubbed} scrubs at an unpin"
        );
    }

    /// Appends `n` rows to every layer with slots of `seq`, leaving them pending.
    fn append_pending(l: &mut PageLedger, seq: SeqId, n: usize) {
        for layer in [0, 2] {
            let s: Vec<Vec<usize>> = l.shapes[layer]
                .iter()
                .map(|t| [&[n][..], t].concat())
                .collect();
            let plan = l.plan_append(seq, layer, 2, |i| &s[i]).unwrap();
            l.commit_append(&plan);
        }
    }

    /// A batch advance commits every sequence's step at once, a sequence named twice taking the sum;
    /// a refusal of any of them (a count that is not its pending rows, a sequence it does not know)
    /// names it and commits none, not even those named before it.
    #[test]
    fn a_batch_advance_commits_all_or_none() {
        let mut l = PageLedger::new(&spec(16), 4, 16);
        let (a, b, c) = (l.add().unwrap(), l.add().unwrap(), l.add().unwrap());
        append_pending(&mut l, a, 1);
        append_pending(&mut l, b, 3);
        let before = l.clone();
        let uneven = Error::UnevenAdvance {
            seq: Some(b),
            layer: 0,
            pending: 3,
            expected: 2,
            len: 0,
        };
        assert_eq!(l.advance_batch(&[(a, 1), (b, 2)]), Err(uneven));
        assert_eq!(l, before);
        let gone = SeqId {
            pool: l.pool,
            n: 99,
        };
        assert_eq!(
            l.advance_batch(&[(a, 1), (b, 3), (gone, 1)]),
            Err(Error::UnknownSequence { seq: gone })
        );
        assert_eq!(l, before);
        // b named twice: 1 + 2 of its 3 pending rows; c, with nothing pending, commits 0.
        l.advance_batch(&[(b, 1), (a, 1), (b, 2), (c, 0)]).unwrap();
        assert_eq!((l.len(a), l.len(b), l.len(c)), (Ok(1), Ok(3), Ok(0)));
        assert_eq!((l.visible(a, 0), l.visible(b, 2)), (Ok(1), Ok(3)));
        // One sequence alone is advance.
        append_pending(&mut l, a, 2);
        let mut one = l.clone();
        one.advance(a, 2).unwrap();
        l.advance_batch(&[(a, 2)]).unwrap();
        assert_eq!(l, one);
    }

    /// The rows a remove or truncate would orphan: the pages the sequence alone holds and the tail
    /// of its last page kept, neighbours merged into one run; a fork's pages are not among them;
    /// nothing changes, and a truncate past the length is refused.
    #[test]
    fn orphaned_rows_are_the_sequence_s_alone_in_merged_runs() {
        let mut l = PageLedger::new(&spec(32), 4, 8);
        let a = l.add().unwrap();
        grow(&mut l, a, 10);
        assert_eq!(l.pages(a).unwrap(), &[0, 1, 2]);
        let rows = |first_row, n_rows| Run {
            page: 0,
            first_row,
            n_rows,
        };
        // The rows to zero now (no page is pinned here).
        let now = |l: &PageLedger, seq, new_len| l.orphaned_rows(seq, new_len).map(|o| o.now);
        let before = l.clone();
        assert_eq!(now(&l, a, None), Ok(vec![rows(0, 12)]));
        assert_eq!(now(&l, a, Some(5)), Ok(vec![rows(5, 7)]));
        assert_eq!(now(&l, a, Some(8)), Ok(vec![rows(8, 4)]));
        assert_eq!(now(&l, a, Some(10)), Ok(vec![rows(10, 2)]));
        assert!(matches!(
            l.orphaned_rows(a, Some(11)),
            Err(Error::TruncateBeyondLength { .. })
        ));
        assert_eq!(l, before);
        // A fork at 6 shares pages 0 and 1: only page 2 is a's alone.
        let b = l.fork(a, 6).unwrap();
        assert_eq!(now(&l, a, None), Ok(vec![rows(8, 4)]));
        assert_eq!(now(&l, a, Some(5)), Ok(vec![rows(8, 4)]));
        assert_eq!(l.orphaned_rows(b, None).map(|o| o.now), Ok(vec![]));
        // Whole pages, neighbours merged in any order.
        assert_eq!(
            l.page_runs(&[5, 1, 7, 2]),
            [rows(4, 8), rows(20, 4), rows(28, 4)]
        );
        assert_eq!(l.page_runs(&[3, 1, 2]), vec![rows(4, 12)]);
    }

    /// A pinned page (the source of a recorded copy yet to run) is held: its sequence's next row
    /// goes into a copy of it, it stays out of the pool when its sequence goes, and eviction does
    /// not take it. A scrub that leaves it to its pins waits for the last unpin, which returns it
    /// with the rows to zero: those past a truncation while the sequence still holds it, the whole
    /// page once it is free.
    #[test]
    fn a_pinned_page_is_held_until_its_last_unpin() {
        let mut l = PageLedger::new(&spec(32), 4, 8);
        let rows = |first_row, n_rows| Run {
            page: 0,
            first_row,
            n_rows,
        };
        let a = l.add().unwrap();
        grow(&mut l, a, 6);
        assert_eq!(l.pages(a).unwrap(), &[0, 1]);
        // Two copies of page 1, reading rows 4-5 of both layers with slots.
        let copy = PageCopy {
            index: 1,
            from: 1,
            to: 7,
            rows: vec![2, 0, 2],
        };
        l.pin(&copy);
        l.pin(&copy);
        assert_eq!((l.page_refs(1), l.free_pages()), (Some(3), 6));
        // a's row 6 goes into the page, after the rows the copies read; after a truncation to 5,
        // its row 5 goes into a copy of it, and admission counts that copy.
        assert_eq!(copied_by_a_row(&l, a), []);
        let mut shorter = l.clone();
        shorter.truncate(a, 5).unwrap();
        assert_eq!(copied_by_a_row(&shorter, a), [1]);
        // With every free page taken by sequences of their own.
        let full = |l: &PageLedger| {
            let mut full = l.clone();
            while full.free_pages() > 0 {
                let b = full.add().unwrap();
                grow(&mut full, b, 1);
            }
            full
        };
        let out_of_pages = |l: &PageLedger, seq| {
            matches!(
                full(l).admits(&[(seq, 1)]),
                Err(Error::OutOfPages { needed: 1, .. })
            )
        };
        assert!(out_of_pages(&shorter, a));
        assert!(full(&shorter).admits(&[(a, 0)]).is_ok());

        // Truncated to 5 with a scrub: row 5 on is left to the pins.
        let orphans = l.orphaned_rows(a, Some(5)).unwrap();
        assert_eq!((orphans.now, &orphans.pinned[..]), (vec![], &[(1, 1)][..]));
        l.truncate(a, 5).unwrap();
        l.scrub_when_unpinned(&orphans.pinned);
        assert!(l.scrub_waits(1));
        assert_eq!(l.unpin(&[1]), vec![]);
        assert_eq!(l.unpin(&[1]), vec![rows(5, 3)]);
        assert_eq!(
            (l.page_refs(1), l.free_pages(), l.scrub_waits(1)),
            (Some(1), 6, false)
        );

        // Removed with a scrub while pinned: page 0 is zeroed now, page 1 at its unpin.
        l.pin(&copy);
        let orphans = l.orphaned_rows(a, None).unwrap();
        assert_eq!(
            (orphans.now, &orphans.pinned[..]),
            (vec![rows(0, 4)], &[(1, 0)][..])
        );
        l.remove(a).unwrap();
        l.scrub_when_unpinned(&orphans.pinned);
        assert_eq!((l.page_refs(1), l.free_pages()), (Some(1), 7));
        assert_eq!(l.unpin(&[1]), vec![rows(4, 4)]);
        assert_eq!((l.page_refs(1), l.free_pages()), (Some(0), 8));

        // A published page pinned: its sequence gone, it is not cached or evicted until unpinned.
        let b = l.add().unwrap();
        grow(&mut l, b, 4);
        let page = l.pages(b).unwrap()[0];
        assert_eq!(l.publish(b, &[1, 2, 3, 4]).unwrap(), 4);
        l.pin(&PageCopy {
            from: page,
            ..copy.clone()
        });
        l.remove(b).unwrap();
        assert_eq!((l.cached_pages(), l.evictable_pages()), (0, 0));
        assert_eq!(l.evict_prefixes(usize::MAX), 0);
        assert_eq!(l.unpin(&[page]), vec![], "no scrub waited");
        assert_eq!((l.cached_pages(), l.evictable_pages()), (1, 1));
        assert_eq!(l.evict_prefixes(usize::MAX), 1);
        assert_eq!(l.free_pages(), 8);

        // A page whose zeroing waits for its pins takes no write in place, past the copy's rows
        // too: the zeroing at the unpin would reach the rows written.
        let c = l.add().unwrap();
        grow(&mut l, c, 3);
        let page = l.pages(c).unwrap()[0];
        l.pin(&PageCopy {
            index: 0,
            from: page,
            to: 7,
            rows: vec![1, 0, 1],
        });
        let orphans = l.orphaned_rows(c, Some(2)).unwrap();
        assert_eq!(orphans.pinned, [(page, 2)]);
        l.truncate(c, 2).unwrap();
        l.scrub_when_unpinned(&orphans.pinned);
        assert_eq!(copied_by_a_row(&l, c), [page]);
        assert!(out_of_pages(&l, c));
    }

    /// A sequence's pages held for its encoders ([`PageLedger::hold`]) stay out of the pool until
    /// their unpin, and every holder, the sequence itself and a fork sharing a page, writes into the
    /// rows the sequence saw there through a private copy, past them into the page.
    #[test]
    fn held_pages_stay_out_of_the_pool_and_keep_the_rows_their_sequence_saw() {
        let mut l = PageLedger::new(&spec(32), 4, 8);
        let a = l.add().unwrap();
        grow(&mut l, a, 6);
        assert_eq!(l.pages(a).unwrap(), &[0, 1]);
        assert!(matches!(
            l.drops_rows(a, Some(7)),
            Err(Error::TruncateBeyondLength { new_len: 7, .. })
        ));
        assert!(!l.drops_rows(a, Some(6)).unwrap());
        assert!(l.drops_rows(a, Some(5)).unwrap() && l.drops_rows(a, None).unwrap());
        // Held, then truncated to 3: page 1 stays out of the pool, and a's row 3 goes into a copy
        // of page 0 (the encoder reads its rows 0-3).
        assert_eq!(l.hold(a).unwrap(), [0, 1]);
        l.truncate(a, 3).unwrap();
        assert_eq!((l.page_refs(1), l.free_pages()), (Some(1), 6));
        assert_eq!(copied_by_a_row(&l, a), [0]);
        assert_eq!(l.unpin(&[0, 1]), vec![], "no zeroing waited");
        assert_eq!(
            (l.page_refs(0), l.page_refs(1), l.free_pages()),
            (Some(1), Some(0), 7)
        );
        assert_eq!(copied_by_a_row(&l, a), [], "unheld, into the page itself");

        // A fork of all 6 rows (a has 6 again) shares both pages; a is removed with both held.
        grow(&mut l, a, 3);
        let c = l.fork(a, 6).unwrap();
        assert_eq!(l.hold(a).unwrap(), [0, 1]);
        l.remove(a).unwrap();
        // c's row 6 lies past a's rows of its second page (4 and 5): into the page itself.
        assert_eq!(copied_by_a_row(&l, c), []);
        // Truncated to 5, its row 5 lies within them: into a private copy.
        let mut shorter = l.clone();
        shorter.truncate(c, 5).unwrap();
        assert_eq!(copied_by_a_row(&shorter, c), [1]);
        assert_eq!(l.unpin(&[0, 1]), vec![]);
        assert_eq!(
            (l.page_refs(0), l.page_refs(1), l.free_pages()),
            (Some(1), Some(1), 6)
        );
    }

    /// The pages a one-row append to layer 0 of `seq` would copy first (planned, not made).
    fn copied_by_a_row(l: &PageLedger, seq: SeqId) -> Vec<u32> {
        let one: Vec<Vec<usize>> = l.shapes[0].iter().map(|t| [&[1][..], t].concat()).collect();
        let plan = l.plan_append(seq, 0, one.len(), |i| &one[i]).unwrap();
        plan.copies.iter().map(|c| c.from).collect()
    }

    /// Appends `n` rows to every layer with slots of `seq` and commits them.
    fn grow(l: &mut PageLedger, seq: SeqId, n: usize) {
        append_pending(l, seq, n);
        l.advance(seq, n).unwrap();
    }

    /// Two sequences of pages of their own holding the same tokens: the second's publication finds
    /// the first's pages and publishes none of its own (its pages stay its own alone), and once both
    /// are gone the published pages are evicted, parents after children, every page free again. A
    /// fork or truncation at a sequence's length is taken, one row past it refused.
    #[test]
    fn the_same_tokens_on_pages_of_their_own_are_published_once() {
        let mut l = PageLedger::new(&spec(64), 4, 10);
        let (a, b) = (l.add().unwrap(), l.add().unwrap());
        grow(&mut l, a, 8);
        grow(&mut l, b, 8);
        assert_eq!(
            (l.pages(a).unwrap(), l.pages(b).unwrap()),
            (&[0, 1][..], &[2, 3][..])
        );
        let tokens = [1, 2, 3, 4, 5, 6, 7, 8];
        assert_eq!(l.publish(a, &tokens), Ok(8));
        assert_eq!(l.publish(b, &tokens), Ok(8));
        assert_eq!(l.published_pages(), 2);
        assert_eq!((l.page_refs(2), l.page_refs(3)), (Some(1), Some(1)));
        // Forks and truncations at the length itself are taken; a row past it is refused.
        let before = l.clone();
        assert_eq!(
            l.fork(b, 9),
            Err(Error::ForkBeyondLength {
                seq: b,
                at_len: 9,
                len: 8
            })
        );
        assert_eq!(
            l.truncate(b, 9),
            Err(Error::TruncateBeyondLength {
                seq: Some(b),
                new_len: 9,
                len: 8
            })
        );
        assert_eq!(l, before);
        let c = l.fork(b, 8).unwrap();
        l.truncate(c, 8).unwrap();
        l.remove(c).unwrap();
        l.remove(a).unwrap();
        l.remove(b).unwrap();
        assert_eq!(l.evict_prefixes(usize::MAX), 2);
        assert_eq!(l.free_pages(), 10);
    }

    #[test]
    fn published_prefixes_outlive_their_sequence_and_go_least_recently_used_first() {
        let mut l = PageLedger::new(&spec(64), 4, 10);
        let a = l.add().unwrap();
        grow(&mut l, a, 10);
        assert_eq!(l.pages(a).unwrap(), &[0, 1, 2]);
        // Token ids of a's rows: two whole pages and a partly filled one.
        let ta = [1, 2, 3, 4, 9, 9, 9, 9, 5, 5];
        let before = l.clone();
        assert_eq!(
            l.publish(a, &[ta.as_slice(), &[5]].concat()),
            Err(Error::PrefixBeyondLength {
                seq: a,
                tokens: 11,
                len: 10
            })
        );
        assert_eq!(l, before);
        assert_eq!(l.publish(a, &ta), Ok(8));
        assert_eq!((l.published_pages(), l.cached_pages()), (2, 0));
        assert_eq!((l.page_refs(0), l.page_refs(2)), (Some(2), Some(1)));
        // Again: nothing more is published.
        assert_eq!(l.publish(a, &ta), Ok(8));
        assert_eq!(l.published_pages(), 2);

        // Another sequence whose second page has the same tokens after another first page.
        let b = l.add().unwrap();
        grow(&mut l, b, 8);
        assert_eq!(l.pages(b).unwrap(), &[3, 4]);
        assert_eq!(l.publish(b, &[7, 7, 7, 7, 9, 9, 9, 9]), Ok(8));
        // A sequence with a's first page: its second is found, and b's pages are not published twice.
        let c = l.fork(a, 8).unwrap();
        assert_eq!(l.publish(c, &ta[..8]), Ok(8));
        assert_eq!(l.published_pages(), 4);
        // A page of b's already published under b's tokens ends a publication under others.
        assert_eq!(l.publish(b, &[7, 7, 7, 7, 8, 8, 8, 8]), Ok(4));
        assert_eq!(l.publish(b, &[6, 6, 6, 6]), Ok(0));

        l.remove(a).unwrap();
        l.remove(b).unwrap();
        l.remove(c).unwrap();
        assert_eq!((l.cached_pages(), l.free_pages()), (4, 6));

        // The longest published prefix, through the right parent.
        let (d, len) = l.add_with_prefix(&[7, 7, 7, 7, 9, 9, 9, 9, 1]).unwrap();
        assert_eq!((len, l.pages(d).unwrap()), (8, &[3, 4][..]));
        let (e, len) = l.add_with_prefix(&[1, 2, 3, 4, 9, 9, 9, 8]).unwrap();
        assert_eq!((len, l.pages(e).unwrap()), (4, &[0][..]));
        let (f, len) = l.add_with_prefix(&[1, 2, 3]).unwrap();
        assert_eq!((len, l.pages(f).unwrap()), (0, &[][..]));
        assert_eq!(l.cached_pages(), 1, "page 1 alone is held by no sequence");
        assert_eq!(l.evictable_pages(), 1);
        // A write into a published page copies it, as a write into a forked page does.
        l.truncate(e, 2).unwrap();
        let s: Vec<Vec<usize>> = l.shapes[0].iter().map(|t| [&[1][..], t].concat()).collect();
        let plan = l.plan_append(e, 0, 2, |i| &s[i]).unwrap();
        assert_eq!(plan.copies.len(), 1);
        l.commit_append(&plan);
        assert_eq!(l.page_refs(0), Some(1));

        // Eviction: leaves no sequence holds, least recently used first. Page 1 (a's second, last
        // used when c published) goes first; then page 4 and its parent 3 (matched by d), before
        // page 0 (matched by e after d), which a page published after it kept until page 1 went.
        l.remove(d).unwrap();
        let free = l.free_pages();
        assert_eq!(l.cached_pages(), 4);
        assert_eq!(l.evict_prefixes(1), 1);
        assert_eq!(l.page_refs(1), Some(0));
        assert_eq!(l.evict_prefixes(2), 2);
        assert_eq!(
            (l.page_refs(4), l.page_refs(3), l.page_refs(0)),
            (Some(0), Some(0), Some(1))
        );
        assert_eq!(l.free_pages(), free + 3);
        // A page a sequence holds stays.
        let (g, len) = l.add_with_prefix(&ta).unwrap();
        assert_eq!((len, l.cached_pages(), l.evict_prefixes(9)), (4, 0, 0));

        l.remove(g).unwrap();
        assert_eq!(l.evict_prefixes(9), 1);
        assert_eq!((l.published_pages(), l.cached_pages()), (0, 0));
    }

    /// Two sequences computed the same tokens on pages of their own, the first fewer: the second's
    /// second page is published after the first's page. Once the first is gone its page is cached
    /// (no sequence holds it) but not evictable while the second holds the page after it.
    #[test]
    fn a_cached_page_on_the_way_to_a_held_one_is_not_evictable() {
        let mut l = PageLedger::new(&spec(64), 4, 8);
        let (x, y) = (l.add().unwrap(), l.add().unwrap());
        grow(&mut l, x, 4);
        grow(&mut l, y, 8);
        let tokens = [1, 2, 3, 4, 5, 6, 7, 8];
        assert_eq!(l.publish(x, &tokens[..4]), Ok(4));
        assert_eq!(l.publish(y, &tokens), Ok(8));
        l.remove(x).unwrap();
        assert_eq!((l.cached_pages(), l.evictable_pages()), (1, 0));
        assert_eq!(l.clone().evict_prefixes(usize::MAX), 0);
        l.remove(y).unwrap();
        assert_eq!((l.cached_pages(), l.evictable_pages()), (2, 2));
        assert_eq!(l.evict_prefixes(usize::MAX), 2);
        assert_eq!(l.free_pages(), 8);
    }

    #[test]
    fn a_write_into_a_shared_page_copies_the_rows_the_writer_sees() {
        let mut l = PageLedger::new(&spec(64), 4, 8);
        let a = l.add().unwrap();
        for layer in [0, 2] {
            let shapes = &l.shapes[layer].clone();
            let s: Vec<Vec<usize>> = shapes.iter().map(|t| [&[6][..], t].concat()).collect();
            let plan = l.plan_append(a, layer, 2, |i| &s[i]).unwrap();
            // Pages hold every layer: the first layer's append takes them.
            let fresh: &[u32] = if layer == 0 { &[0, 1] } else { &[] };
            assert_eq!(plan.fresh, fresh);
            l.commit_append(&plan);
        }
        l.advance(a, 6).unwrap();
        let b = l.fork(a, 5).unwrap();
        assert_eq!((l.pages(b).unwrap(), l.free_pages()), (&[0, 1][..], 6));
        let s: Vec<Vec<usize>> = l.shapes[0].iter().map(|t| [&[1][..], t].concat()).collect();
        let plan = l.plan_append(b, 0, 2, |i| &s[i]).unwrap();
        // Row 5 lies in page 1, shared: b copies rows 4..5 of each layer into page 2 first.
        assert_eq!(
            plan.copies,
            vec![PageCopy {
                index: 1,
                from: 1,
                to: 2,
                rows: vec![1, 0, 1]
            }]
        );
        assert_eq!(
            plan.runs,
            vec![(
                0,
                Run {
                    page: 0,
                    first_row: 9,
                    n_rows: 1
                }
            )]
        );
        l.commit_append(&plan);
        assert_eq!(l.pages(b).unwrap(), &[0, 2]);
        assert_eq!(
            (l.page_refs(0), l.page_refs(1), l.page_refs(2)),
            (Some(2), Some(1), Some(1))
        );
        // Out of pages: named with what is needed and free.
        let s: Vec<Vec<usize>> = l.shapes[0]
            .iter()
            .map(|t| [&[30][..], t].concat())
            .collect();
        assert_eq!(
            l.plan_append(a, 0, 2, |i| &s[i]).unwrap_err(),
            Error::OutOfPages { needed: 7, free: 5 }
        );
        assert_eq!(
            l.fork(a, 7).unwrap_err(),
            Error::ForkBeyondLength {
                seq: a,
                at_len: 7,
                len: 6
            }
        );
        l.remove(a).unwrap();
        assert_eq!(l.remove(a).unwrap_err(), Error::UnknownSequence { seq: a });
        l.remove(b).unwrap();
        assert_eq!(l.free_pages(), 8);
    }

    /// A parent and its fork that share a partly filled page: admitting a row for each needs one
    /// page, since after the first writer's copy the second holds the shared page alone.
    #[test]
    fn admission_counts_one_copy_of_a_page_two_writers_share() {
        let mut l = PageLedger::new(&spec(64), 4, 4);
        let a = l.add().unwrap();
        grow(&mut l, a, 6);
        let b = l.fork(a, 6).unwrap();
        let c = l.add().unwrap();
        grow(&mut l, c, 4);
        assert_eq!(l.free_pages(), 1);
        assert_eq!(l.admits(&[(a, 1), (b, 1)]), Ok(()));
        assert_eq!(l.admits(&[(b, 1), (a, 1)]), Ok(()));
        // A row for c as well, whose only page is full: two pages.
        assert_eq!(
            l.admits(&[(a, 1), (b, 1), (c, 1)]),
            Err(Error::OutOfPages { needed: 2, free: 1 })
        );
        // Writers from different rows of the page (b at its row 1, a at its row 2): each counts a
        // copy. Recorded, a's copy would pin the page with rows 0-1 of it (in every layer), and
        // b's rows in the next layer would go into a copy of their own.
        l.truncate(b, 5).unwrap();
        for step in [[(a, 1), (b, 1)], [(b, 1), (a, 1)]] {
            assert_eq!(
                l.admits(&step),
                Err(Error::OutOfPages { needed: 2, free: 1 })
            );
        }
    }

    /// A sequence named twice in an admission takes the sum of its counts.
    #[test]
    fn admission_adds_the_counts_of_a_sequence_named_twice() {
        let mut l = PageLedger::new(&spec(8), 4, 8);
        let a = l.add().unwrap();
        assert_eq!(l.admits(&[(a, 4), (a, 4)]), Ok(()));
        assert_eq!(
            l.admits(&[(a, 5), (a, 5)]),
            Err(Error::CapacityExceeded {
                seq: Some(a),
                layer: 0,
                position: 0,
                n_new: 10,
                capacity: 8,
                remaining: 8,
            })
        );
    }

    /// Publishing counts as a use: of two published pages no sequence holds, the one published
    /// again last goes last.
    #[test]
    fn publishing_again_keeps_a_prefix_longest() {
        let mut l = PageLedger::new(&spec(64), 4, 4);
        let (a, b) = (l.add().unwrap(), l.add().unwrap());
        grow(&mut l, a, 4);
        grow(&mut l, b, 4);
        assert_eq!(
            (l.pages(a).unwrap(), l.pages(b).unwrap()),
            (&[0][..], &[1][..])
        );
        let (ta, tb) = ([1, 2, 3, 4], [5, 6, 7, 8]);
        assert_eq!(l.publish(a, &ta), Ok(4));
        assert_eq!(l.publish(b, &tb), Ok(4));
        assert_eq!(l.publish(a, &ta), Ok(4));
        l.remove(a).unwrap();
        l.remove(b).unwrap();
        assert_eq!(l.evict_prefixes(1), 1);
        assert_eq!((l.page_refs(0), l.page_refs(1)), (Some(1), Some(0)));
    }

    /// A pool's refused append names the position after the rows already pending, and the room left
    /// there.
    #[test]
    fn a_refused_append_counts_the_pending_rows() {
        let mut l = PageLedger::new(&spec(8), 4, 8);
        let a = l.add().unwrap();
        grow(&mut l, a, 5);
        let rows = |n: usize| -> Vec<Vec<usize>> {
            l.shapes[0].iter().map(|t| [&[n][..], t].concat()).collect()
        };
        let two = rows(2);
        let plan = l.plan_append(a, 0, 2, |i| &two[i]).unwrap();
        l.commit_append(&plan);
        let before = l.clone();
        assert_eq!(
            l.plan_append(a, 0, 2, |i| &two[i]).unwrap_err(),
            Error::CapacityExceeded {
                seq: Some(a),
                layer: 0,
                position: 7,
                n_new: 2,
                capacity: 8,
                remaining: 1,
            }
        );
        assert_eq!(l, before);
    }
}
