//! Host truth of a paged pool: the free list, each page's reference count, and per sequence its page
//! table, committed length and pending rows per layer. No wgpu types.
//!
//! A page holds `page_size` consecutive token rows of a sequence in every (layer, slot) at once, so one
//! page table serves every layer. Row `r` of a sequence lies in its page `pages[r / page_size]`, row
//! `r % page_size` of it. A page shared by several sequences (after a fork) is never written: a write
//! into it first gives the writer a private copy of the rows it can see (copy-on-write), so the rows
//! the other sequences see never change.

use std::collections::BTreeMap;

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

/// Host bookkeeping of a paged pool; see the module docs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PageLedger {
    shapes: Vec<Vec<Vec<usize>>>,
    page_size: usize,
    max_seq_len: usize,
    /// Sequences holding each page (0: free).
    refs: Vec<u32>,
    /// Free pages; the next one taken is the last.
    free: Vec<u32>,
    seqs: BTreeMap<SeqId, Sequence>,
    next_id: u32,
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
            next_id: 0,
        }
    }

    pub fn page_size(&self) -> usize {
        self.page_size
    }

    pub fn n_pages(&self) -> usize {
        self.refs.len()
    }

    pub fn free_pages(&self) -> usize {
        self.free.len()
    }

    pub fn pages_in_use(&self) -> usize {
        self.n_pages() - self.free_pages()
    }

    /// Most rows one sequence may hold.
    pub fn max_seq_len(&self) -> usize {
        self.max_seq_len
    }

    pub fn n_layers(&self) -> usize {
        self.shapes.len()
    }

    /// The live sequences, in creation order.
    pub fn sequences(&self) -> impl Iterator<Item = SeqId> + '_ {
        self.seqs.keys().copied()
    }

    /// Sequences holding `page` (0 for a free page).
    pub fn page_refs(&self, page: u32) -> Option<u32> {
        self.refs.get(page as usize).copied()
    }

    pub(crate) fn seq(&self, seq: SeqId) -> Result<&Sequence> {
        self.seqs.get(&seq).ok_or(Error::UnknownSequence { seq })
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

    pub fn slot_shapes(&self, layer: usize) -> Result<&[Vec<usize>]> {
        self.check_layer(layer)?;
        Ok(&self.shapes[layer])
    }

    fn check_layer(&self, layer: usize) -> Result<()> {
        check_layer(layer, self.shapes.len())
    }

    /// A new, empty sequence (it takes no page until it is written).
    pub(crate) fn add(&mut self) -> Result<SeqId> {
        let id = SeqId(self.next_id);
        self.next_id = self
            .next_id
            .checked_add(1)
            .ok_or(Error::SequenceIdsExhausted)?;
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

    /// Removes `seq`; the pages it alone held return to the pool.
    pub(crate) fn remove(&mut self, seq: SeqId) -> Result<()> {
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
        let child = self.add()?;
        for &page in &pages {
            self.refs[page as usize] += 1;
        }
        let c = self.seqs.get_mut(&child).expect("just added");
        c.pages = pages;
        c.len = at_len;
        Ok(child)
    }

    /// Drops the rows of `seq` from `new_len` on (pending rows included) and returns the pages no
    /// longer needed to the pool.
    pub(crate) fn truncate(&mut self, seq: SeqId, new_len: usize) -> Result<()> {
        let s = self.seq(seq)?;
        if new_len > s.len {
            return Err(Error::TruncateBeyondLength {
                new_len,
                len: s.len,
            });
        }
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
        let s = self.seq(seq)?;
        let uneven =
            (0..self.shapes.len()).find(|&l| !self.shapes[l].is_empty() && s.pending[l] != n);
        if let Some(layer) = uneven {
            return Err(Error::UnevenAdvance {
                layer,
                pending: s.pending[layer],
                expected: n,
                len: s.len,
            });
        }
        let s = self.seqs.get_mut(&seq).expect("checked");
        s.len += n;
        s.pending.iter_mut().for_each(|p| *p = 0);
        Ok(())
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
        let needed = (first..=last)
            .filter(|&i| i >= s.pages.len() || self.refs[s.pages[i] as usize] > 1)
            .count();
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
            } else if self.refs[s.pages[i] as usize] > 1 {
                let to = taken.next().expect("counted");
                let rows = (0..self.shapes.len())
                    .map(|l| match self.shapes[l].is_empty() {
                        true => 0,
                        false => s.visible(l).saturating_sub(i * p).min(p),
                    })
                    .collect();
                plan.copies.push(PageCopy {
                    index: i,
                    from: s.pages[i],
                    to,
                    rows,
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

    /// Whether appending `n` more rows to every layer of each `(seq, n)` fits at once, pages and
    /// lengths both; a sequence named twice takes the sum of its counts. Changes nothing.
    pub fn admits(&self, growth: &[(SeqId, usize)]) -> Result<()> {
        let mut per_seq: BTreeMap<SeqId, usize> = BTreeMap::new();
        for &(seq, n) in growth {
            self.seq(seq)?;
            let total = per_seq.entry(seq).or_default();
            *total = total.saturating_add(n);
        }
        // Shared pages a write would copy: each writer but the last one holding a page copies it.
        let mut refs: BTreeMap<u32, u32> = BTreeMap::new();
        let mut needed = 0usize;
        for (&seq, &n) in &per_seq {
            let s = &self.seqs[&seq];
            let top = (0..self.shapes.len())
                .filter(|&l| !self.shapes[l].is_empty())
                .map(|l| s.visible(l))
                .max()
                .unwrap_or(s.len);
            if n > self.max_seq_len - top {
                return Err(Error::CapacityExceeded {
                    layer: 0,
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
            needed += end.saturating_sub(s.pages.len());
            for &page in s.pages.iter().take(end).skip(first) {
                let r = refs.entry(page).or_insert(self.refs[page as usize]);
                if *r > 1 {
                    *r -= 1;
                    needed += 1;
                }
            }
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
        assert_eq!(l.add(), Ok(SeqId(u32::MAX - 1)));
        let before = l.clone();
        assert_eq!(l.add(), Err(Error::SequenceIdsExhausted));
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

    /// Every invariant of the ledger, and every sequence's rows read through its page table.
    fn check(l: &PageLedger, pool: &Pool, model: &BTreeMap<SeqId, Vec<Vec<u64>>>) {
        let mut refs = vec![0u32; l.n_pages()];
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
        for seed in 1..=40u64 {
            let mut rng = crate::reference::Xorshift::new(seed);
            let mut l = PageLedger::new(&spec, page_size, n_pages);
            let mut pool = Pool::new();
            let mut model: BTreeMap<SeqId, Vec<Vec<u64>>> = BTreeMap::new();
            let mut counter = 0u64;
            let mut refused = 0;
            let mut out_of_pages_seen = false;
            for _ in 0..600 {
                let ids: Vec<SeqId> = model.keys().copied().collect();
                // Mostly live sequences; sometimes one never added.
                let pick = |rng: &mut crate::reference::Xorshift| {
                    if ids.is_empty() || rng.below(20) == 0 {
                        SeqId(1000 + rng.below(5) as u32)
                    } else {
                        ids[rng.below(ids.len())]
                    }
                };
                let before = l.clone();
                let result = match rng.below(12) {
                    0 => l.add().map(|id| {
                        model.insert(id, vec![Vec::new(); 3]);
                    }),
                    1 | 10 => {
                        let seq = pick(&mut rng);
                        l.remove(seq).map(|()| {
                            model.remove(&seq);
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
                        l.truncate(seq, new_len).map(|()| {
                            for rows in model.get_mut(&seq).unwrap() {
                                rows.truncate(new_len);
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
                        l.plan_append(seq, layer, shapes_of.len(), |s| &shapes_of[s])
                            .map(|plan| {
                                apply(&mut pool, &plan, page_size, &values);
                                l.commit_append(&plan);
                                model.get_mut(&seq).unwrap()[layer].extend(&values);
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
                        check(&l, &pool, &model);
                        continue;
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
                check(&l, &pool, &model);
            }
            assert!(refused > 10, "seed {seed}: only {refused} refusals");
            out_of_pages += usize::from(out_of_pages_seen);
            for id in model.keys() {
                l.remove(*id).unwrap();
            }
            assert_eq!(l.free_pages(), n_pages, "seed {seed}: pages leaked");
        }
        // The runs reached the interesting states: private copies, and a full pool.
        let copies = COPIES.with(|c| c.get());
        eprintln!("{copies} page copies; {out_of_pages} of 40 runs ran out of pages");
        assert!(
            copies > 100 && out_of_pages > 10,
            "{copies} copies, {out_of_pages} full pools"
        );
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
}
