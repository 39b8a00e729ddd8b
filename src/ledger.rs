//! Host truth of a cache: committed length, pending rows per layer, capacity and the plans that
//! turn a checked request into row ranges. No wgpu types: every rule is unit- and property-tested here.

use crate::error::{Error, Result};
use crate::placement::Run;
use crate::spec::CacheSpec;

pub use crate::seq::SeqId;

/// Rows `[start_row, start_row + n_new)` of sequence `seq` in every slot of `layer` receive an
/// append; [`AppendPlan::runs`] says where they lie in storage.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AppendPlan {
    pub seq: SeqId,
    pub layer: usize,
    pub start_row: usize,
    pub n_new: usize,
}

impl AppendPlan {
    /// Where the rows go: the one run of a single-sequence cache.
    pub fn runs(&self) -> [Run; 1] {
        [Run {
            page: 0,
            first_row: self.start_row,
            n_rows: self.n_new,
        }]
    }
}

/// Rows `[start, end)` of `layer` that a truncate drops (zeroed when the caller scrubs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct DroppedRows {
    pub layer: usize,
    pub start: usize,
    pub end: usize,
}

impl DroppedRows {
    /// The dropped rows as a run of the slot's storage.
    pub(crate) fn run(&self) -> Run {
        Run {
            page: 0,
            first_row: self.start,
            n_rows: self.end - self.start,
        }
    }
}

/// The trailing shape of every slot of `spec`, per layer.
pub(crate) fn slot_shapes_of(spec: &CacheSpec) -> Vec<Vec<Vec<usize>>> {
    spec.layers()
        .iter()
        .map(|l| l.slots.iter().map(|s| s.trailing.clone()).collect())
        .collect()
}

/// `layer` is one of `n_layers`.
pub(crate) fn check_layer(layer: usize, n_layers: usize) -> Result<()> {
    if layer < n_layers {
        Ok(())
    } else {
        Err(Error::LayerOutOfRange { layer, n_layers })
    }
}

/// Checks slabs shaped `[n_new, ...trailing[s]]` (`shape_of(s)`, `n_slabs` of them) against a layer's
/// slots and returns `n_new`: one slab per slot, each with its slot's trailing shape, all with the same
/// row count.
pub(crate) fn slab_rows<'s>(
    layer: usize,
    slots: &[Vec<usize>],
    n_slabs: usize,
    shape_of: impl Fn(usize) -> &'s [usize],
) -> Result<usize> {
    if n_slabs != slots.len() {
        return Err(Error::SlotCount {
            layer,
            expected: slots.len(),
            got: n_slabs,
        });
    }
    let mut n_new = None;
    for (slot, trailing) in slots.iter().enumerate() {
        let shape = shape_of(slot);
        let Some((&rows, rest)) = shape.split_first().filter(|(_, rest)| rest == trailing) else {
            return Err(Error::SlabShape {
                layer,
                slot,
                expected: trailing.clone(),
                got: shape.to_vec(),
            });
        };
        match n_new {
            None => n_new = Some(rows),
            Some(expected) if expected != rows => {
                return Err(Error::RowCountMismatch {
                    layer,
                    slot,
                    expected,
                    got: rows,
                });
            }
            Some(_) => {}
        }
        debug_assert_eq!(rest, trailing.as_slice());
    }
    Ok(n_new.unwrap_or(0))
}

/// Positions and pending rows of every layer; see the crate docs for the contract.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ledger {
    /// Trailing shape of every slot, per layer.
    shapes: Vec<Vec<Vec<usize>>>,
    capacity: usize,
    len: usize,
    pending: Vec<usize>,
}

impl Ledger {
    /// An empty ledger for `spec`: no committed or pending rows, capacity `spec.max_seq_len()`.
    pub fn new(spec: &CacheSpec) -> Self {
        let shapes = slot_shapes_of(spec);
        let pending = vec![0; shapes.len()];
        Self {
            shapes,
            capacity: spec.max_seq_len(),
            len: 0,
            pending,
        }
    }

    /// Committed rows, shared by every layer.
    pub fn len(&self) -> usize {
        self.len
    }

    /// No row is committed (pending rows do not count).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The most rows the cache holds.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// No committed row can be added.
    pub fn is_full(&self) -> bool {
        self.len == self.capacity
    }

    /// Rows that can still be committed.
    pub fn remaining(&self) -> usize {
        self.capacity - self.len
    }

    /// The number of layers, those without slots included.
    pub fn n_layers(&self) -> usize {
        self.shapes.len()
    }

    /// Rows appended to `layer` in the current step, not yet committed by `advance`.
    pub fn pending(&self, layer: usize) -> Result<usize> {
        self.check_layer(layer)?;
        Ok(self.pending[layer])
    }

    /// Rows `[0, visible)` of `layer` are what views, reads and attention see: committed plus pending.
    pub fn visible(&self, layer: usize) -> Result<usize> {
        Ok(self.len + self.pending(layer)?)
    }

    /// The trailing shapes of `layer`'s slots.
    pub fn slot_shapes(&self, layer: usize) -> Result<&[Vec<usize>]> {
        self.check_layer(layer)?;
        Ok(&self.shapes[layer])
    }

    fn check_layer(&self, layer: usize) -> Result<()> {
        check_layer(layer, self.shapes.len())
    }

    /// Checks one append of slabs shaped `[n_new, ...trailing[s]]`, without changing anything.
    pub fn plan_append(&self, layer: usize, slab_shapes: &[&[usize]]) -> Result<AppendPlan> {
        self.plan_append_with(layer, slab_shapes.len(), |s| slab_shapes[s])
    }

    /// `Ledger::plan_append` for `n_slabs` slabs whose shapes `shape_of(s)` gives, without collecting them.
    pub(crate) fn plan_append_with<'s>(
        &self,
        layer: usize,
        n_slabs: usize,
        shape_of: impl Fn(usize) -> &'s [usize],
    ) -> Result<AppendPlan> {
        let n_new = slab_rows(layer, self.slot_shapes(layer)?, n_slabs, shape_of)?;
        let start_row = self.len + self.pending[layer];
        if n_new > self.capacity - start_row {
            return Err(Error::CapacityExceeded {
                seq: None,
                layer,
                position: start_row,
                n_new,
                capacity: self.capacity,
                remaining: self.capacity - start_row,
            });
        }
        Ok(AppendPlan {
            seq: SeqId::FIRST,
            layer,
            start_row,
            n_new,
        })
    }

    /// Records a planned append. The plan must come from [`Ledger::plan_append`] on this ledger, unchanged since.
    pub(crate) fn commit_append(&mut self, plan: AppendPlan) {
        debug_assert_eq!(plan.start_row, self.len + self.pending[plan.layer]);
        self.pending[plan.layer] += plan.n_new;
    }

    /// Plans and records an append in one step.
    #[cfg(test)]
    pub(crate) fn append(&mut self, layer: usize, slab_shapes: &[&[usize]]) -> Result<AppendPlan> {
        let plan = self.plan_append(layer, slab_shapes)?;
        self.commit_append(plan);
        Ok(plan)
    }

    /// Commits `n` rows: every layer with slots must hold exactly `n` pending rows.
    pub(crate) fn advance(&mut self, n: usize) -> Result<()> {
        let uneven =
            (0..self.shapes.len()).find(|&l| !self.shapes[l].is_empty() && self.pending[l] != n);
        if let Some(layer) = uneven {
            return Err(Error::UnevenAdvance {
                seq: None,
                layer,
                pending: self.pending[layer],
                expected: n,
                len: self.len,
            });
        }
        self.len += n;
        self.pending.iter_mut().for_each(|p| *p = 0);
        Ok(())
    }

    /// Checks `truncate(new_len)` and lists, per layer with slots, the rows it drops (pending rows included).
    pub(crate) fn plan_truncate(&self, new_len: usize) -> Result<Vec<DroppedRows>> {
        if new_len > self.len {
            return Err(Error::TruncateBeyondLength {
                seq: None,
                new_len,
                len: self.len,
            });
        }
        Ok((0..self.shapes.len())
            .filter(|&l| !self.shapes[l].is_empty())
            .map(|l| DroppedRows {
                layer: l,
                start: new_len,
                end: self.len + self.pending[l],
            })
            .filter(|d| d.end > d.start)
            .collect())
    }

    /// Sets the committed length to `new_len` (not above the current one) and drops all pending rows.
    pub(crate) fn truncate(&mut self, new_len: usize) -> Result<Vec<DroppedRows>> {
        let dropped = self.plan_truncate(new_len)?;
        self.len = new_len;
        self.pending.iter_mut().for_each(|p| *p = 0);
        Ok(dropped)
    }

    /// Forgets every row.
    pub(crate) fn reset(&mut self) {
        self.len = 0;
        self.pending.iter_mut().for_each(|p| *p = 0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::DType;
    use crate::spec::LayerSpec;

    fn ledger(capacity: usize) -> Ledger {
        let spec = CacheSpec::new(
            vec![
                LayerSpec::mla(4, 2),
                LayerSpec::empty(),
                LayerSpec::kv(2, 3, 5),
            ],
            DType::F16,
            capacity,
        )
        .unwrap();
        Ledger::new(&spec)
    }

    #[test]
    fn appends_land_after_committed_and_pending_rows() {
        let mut l = ledger(10);
        assert_eq!(
            l.append(0, &[&[2, 4], &[2, 2]]).unwrap(),
            AppendPlan {
                seq: SeqId::FIRST,
                layer: 0,
                start_row: 0,
                n_new: 2
            }
        );
        assert_eq!(l.append(0, &[&[1, 4], &[1, 2]]).unwrap().start_row, 2);
        assert_eq!(l.visible(0).unwrap(), 3);
        assert_eq!(l.visible(2).unwrap(), 0);
        l.append(2, &[&[3, 2, 3], &[3, 2, 5]]).unwrap();
        l.advance(3).unwrap();
        assert_eq!((l.len(), l.visible(0).unwrap(), l.remaining()), (3, 3, 7));
        assert_eq!(l.append(2, &[&[1, 2, 3], &[1, 2, 5]]).unwrap().start_row, 3);
    }

    #[test]
    fn every_refusal_names_its_cause_and_changes_nothing() {
        let mut l = ledger(4);
        l.append(0, &[&[1, 4], &[1, 2]]).unwrap();
        let before = l.clone();
        let cases: Vec<(Result<AppendPlan>, Error)> = vec![
            (
                l.plan_append(3, &[]),
                Error::LayerOutOfRange {
                    layer: 3,
                    n_layers: 3,
                },
            ),
            (
                l.plan_append(0, &[&[1, 4]]),
                Error::SlotCount {
                    layer: 0,
                    expected: 2,
                    got: 1,
                },
            ),
            (
                l.plan_append(0, &[&[1, 4], &[1, 3]]),
                Error::SlabShape {
                    layer: 0,
                    slot: 1,
                    expected: vec![2],
                    got: vec![1, 3],
                },
            ),
            (
                l.plan_append(0, &[&[], &[1, 2]]),
                Error::SlabShape {
                    layer: 0,
                    slot: 0,
                    expected: vec![4],
                    got: vec![],
                },
            ),
            (
                l.plan_append(0, &[&[2, 4], &[1, 2]]),
                Error::RowCountMismatch {
                    layer: 0,
                    slot: 1,
                    expected: 2,
                    got: 1,
                },
            ),
            (
                l.plan_append(0, &[&[4, 4], &[4, 2]]),
                Error::CapacityExceeded {
                    seq: None,
                    layer: 0,
                    position: 1,
                    n_new: 4,
                    capacity: 4,
                    remaining: 3,
                },
            ),
        ];
        for (got, want) in cases {
            assert_eq!(got.unwrap_err(), want);
        }
        assert_eq!(
            l.advance(2).unwrap_err(),
            Error::UnevenAdvance {
                seq: None,
                layer: 0,
                pending: 1,
                expected: 2,
                len: 0
            }
        );
        assert_eq!(
            l.advance(1).unwrap_err(),
            Error::UnevenAdvance {
                seq: None,
                layer: 2,
                pending: 0,
                expected: 1,
                len: 0
            }
        );
        assert_eq!(
            l.truncate(1).unwrap_err(),
            Error::TruncateBeyondLength {
                seq: None,
                new_len: 1,
                len: 0,
            }
        );
        assert_eq!(l, before);
    }

    #[test]
    fn full_then_overflow_then_truncate_and_reappend() {
        let mut l = ledger(3);
        for _ in 0..3 {
            l.append(0, &[&[1, 4], &[1, 2]]).unwrap();
            l.append(2, &[&[1, 2, 3], &[1, 2, 5]]).unwrap();
            l.advance(1).unwrap();
        }
        assert!(l.is_full());
        assert_eq!(l.remaining(), 0);
        assert!(matches!(
            l.plan_append(0, &[&[1, 4], &[1, 2]]),
            Err(Error::CapacityExceeded { .. })
        ));
        // An empty append is still fine when full.
        assert_eq!(l.plan_append(0, &[&[0, 4], &[0, 2]]).unwrap().n_new, 0);
        l.append(0, &[&[0, 4], &[0, 2]]).unwrap();
        assert_eq!(
            l.truncate(1).unwrap(),
            vec![
                DroppedRows {
                    layer: 0,
                    start: 1,
                    end: 3
                },
                DroppedRows {
                    layer: 2,
                    start: 1,
                    end: 3
                }
            ]
        );
        assert_eq!(l.append(0, &[&[2, 4], &[2, 2]]).unwrap().start_row, 1);
        // Truncating drops pending rows too, and says so.
        assert_eq!(
            l.truncate(1).unwrap(),
            vec![DroppedRows {
                layer: 0,
                start: 1,
                end: 3
            }]
        );
        assert_eq!(l.pending(0).unwrap(), 0);
        l.reset();
        assert_eq!((l.len(), l.remaining()), (0, 3));
    }

    #[test]
    fn advance_zero_commits_nothing_and_layers_without_slots_are_ignored() {
        let mut l = ledger(3);
        l.advance(0).unwrap();
        assert_eq!(l.len(), 0);
        assert_eq!(l.slot_shapes(1).unwrap().len(), 0);
        assert_eq!(l.plan_append(1, &[]).unwrap().n_new, 0);
    }
}
