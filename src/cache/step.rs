//! A whole step's host rows in one upload: every layer's slabs are encoded into one host buffer,
//! written once, and copied into their slots, where [`KvCache::append`] writes each slot on its own.
//! On adapters whose `write_buffer` costs a fixed overhead per call (OpenGL: six times faster for a
//! decode step of 64 slots) that overhead is paid once per step instead of once per slot.

use super::{HOST_ROWS, HostRows, HostSlab, KvCache, Rows};
use crate::error::{Error, Result};
use crate::ledger::AppendPlan;

impl KvCache {
    /// Appends rows to every layer from host memory: `slabs[layer]` is what [`KvCache::append`] takes
    /// for that layer (an empty list for a layer without slots, or to append nothing to it). Every
    /// layer is checked before anything is written; a refused call changes no layer.
    ///
    /// The rows of a step up to 4 MiB (or one storage binding of the device, where that is less) go
    /// up in one upload and are copied into place by commands recorded into `encoder`: they land
    /// when that encoder's commands run, after the commands recorded before them (a
    /// [`KvCache::record_truncate_and_scrub`], an attention over the rows they replace). A larger
    /// step goes up in pieces of that size, packed end to end and copied by commands of their own,
    /// so it lands in the same order; its uploads (as many bytes again as the step, rounded up to
    /// whole 4 MiB buffers, checked for memory before anything is written) are let go once the
    /// encoder's commands have run. Call
    /// [`KvCache::advance`] afterwards as usual.
    pub fn record_append_layers(
        &mut self,
        encoder: &mut wgpu::CommandEncoder,
        slabs: &[&[HostSlab<'_>]],
    ) -> Result<()> {
        self.append_layers_into(encoder, slabs, true)
    }

    /// Plans, checks and writes a step into `encoder`; a step over one upload goes up in pieces
    /// copied in `encoder`'s order where `in_order` says so, or else is written slot by slot with
    /// `Queue::write_buffer` (landing at the next submission, ahead of its commands).
    fn append_layers_into(
        &mut self,
        encoder: &mut wgpu::CommandEncoder,
        slabs: &[&[HostSlab<'_>]],
        in_order: bool,
    ) -> Result<()> {
        let plans = self.plan_layers(slabs)?;
        for plan in plans.iter().flatten() {
            self.check_layer_usable(plan.layer)?;
        }
        let jobs: Vec<HostRows<'_, '_>> = plans
            .iter()
            .flatten()
            .map(|p| HostRows::of_plan(p, Rows::Slabs(slabs[p.layer])))
            .collect();
        // In order: one upload, or pieces of the ring, copied in the encoder. Otherwise a step
        // over one upload is written slot by slot.
        if in_order {
            self.record_host_pieces(encoder, &jobs)?;
        } else if !self.record_host_copies(encoder, &jobs)? {
            self.check_host_rows(&jobs, HOST_ROWS)?;
            self.write_host_rows(&jobs);
        }
        for plan in plans.into_iter().flatten() {
            self.ledger.commit_append(plan);
        }
        Ok(())
    }

    /// [`KvCache::record_append_layers`] in its own submission: one upload, one command buffer of
    /// copies, submitted before this returns. A step over one upload is written slot by slot as
    /// [`KvCache::append`] writes them (checked for memory above 4 MiB), with no second copy of its
    /// bytes: nothing can be recorded before it in its own submission. A call whose every list is
    /// empty (once their count is checked) submits nothing.
    pub fn append_layers(&mut self, slabs: &[&[HostSlab<'_>]]) -> Result<()> {
        if slabs.iter().all(|layer| layer.is_empty()) {
            return self.plan_layers(slabs).map(|_| ());
        }
        let mut encoder = self.encoder("kvgpu append_layers");
        self.append_layers_into(&mut encoder, slabs, false)?;
        self.queue.submit([encoder.finish()]);
        Ok(())
    }

    /// Plans every layer's append (`None` for an empty list) and checks its host slabs.
    fn plan_layers(&self, slabs: &[&[HostSlab<'_>]]) -> Result<Vec<Option<AppendPlan>>> {
        let n_layers = self.spec.n_layers();
        if slabs.len() != n_layers {
            return Err(Error::LayerLists {
                expected: n_layers,
                got: slabs.len(),
            });
        }
        let mut plans = Vec::with_capacity(n_layers);
        for (layer, layer_slabs) in slabs.iter().enumerate() {
            if layer_slabs.is_empty() {
                plans.push(None);
                continue;
            }
            let plan = self
                .ledger
                .plan_append_with(layer, layer_slabs.len(), |s| layer_slabs[s].shape)?;
            self.check_host_slabs(layer, layer_slabs)?;
            plans.push(Some(plan));
        }
        Ok(plans)
    }
}
