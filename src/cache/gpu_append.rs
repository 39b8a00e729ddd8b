//! Appends from GPU buffers: each source is planned (`source.rs`), bound and checked against the
//! device, then recorded as a copy or a slab-write dispatch into the caller's encoder.

use super::source::{self, Destination, Source, SourceJob};
use super::{GpuSlab, KvCache};
use crate::error::{Error, Result};
use crate::kernels::{grid, scoped};
use crate::ledger::AppendPlan;

impl KvCache {
    /// Records an append from GPU buffers into `encoder`: a contiguous source of the storage type is
    /// copied with `copy_buffer_to_buffer`; any other is converted by the slab-write kernel.
    pub fn record_append_gpu(
        &mut self,
        encoder: &mut wgpu::CommandEncoder,
        layer: usize,
        slabs: &[GpuSlab<'_>],
    ) -> Result<AppendPlan> {
        let plan = self
            .ledger
            .plan_append_with(layer, slabs.len(), |s| slabs[s].shape)?;
        let jobs = slabs
            .iter()
            .enumerate()
            .map(|(slot, slab)| {
                let sb = &self.slots[layer][slot];
                let source = Source {
                    buffer_size: slab.buffer.size(),
                    usage: slab.buffer.usage(),
                    is_destination: slab.buffer == &sb.buffer,
                    mapped: crate::kernels::is_mapped(slab.buffer),
                    dtype: slab.dtype,
                    offset: slab.offset,
                    shape: slab.shape,
                    strides: slab.strides,
                };
                let destination = Destination {
                    storage: self.spec.dtype(),
                    row_elems: sb.row_elems,
                    row_bytes: sb.placement.row_bytes,
                    min_offset_alignment: self.min_storage_offset_alignment,
                    max_binding: self.max_binding,
                };
                source::plan_source(layer, slot, &source, &destination, plan.n_new)
            })
            .collect::<Result<Vec<_>>>()?;
        // Bind groups (and the device check of each source) before anything is recorded.
        let groups = slabs
            .iter()
            .zip(&jobs)
            .enumerate()
            .map(|(slot, (slab, job))| self.prepare_source(layer, slot, slab, job))
            .collect::<Result<Vec<_>>>()?;
        for (slot, ((slab, job), group)) in slabs.iter().zip(jobs).zip(groups).enumerate() {
            self.record_source(encoder, &plan, slot, slab, job, group);
        }
        self.ledger.commit_append(plan);
        Ok(plan)
    }

    /// [`KvCache::record_append_gpu`] in its own submission.
    pub fn append_gpu(&mut self, layer: usize, slabs: &[GpuSlab<'_>]) -> Result<AppendPlan> {
        let mut encoder = self.encoder("kvgpu append_gpu");
        let plan = self.record_append_gpu(&mut encoder, layer, slabs)?;
        self.queue.submit([encoder.finish()]);
        Ok(plan)
    }

    /// Makes (or finds) the bind group a kernel job needs, and checks that the source belongs to this
    /// device: wgpu refuses a bind group or a copy naming a buffer of another device, and the check
    /// runs here, inside an error scope, so the caller's encoder never sees the refusal.
    fn prepare_source(
        &mut self,
        layer: usize,
        slot: usize,
        slab: &GpuSlab<'_>,
        job: &SourceJob,
    ) -> Result<Option<wgpu::BindGroup>> {
        let foreign = |reason: String| Error::ForeignDevice {
            layer,
            what: format!("GPU source of slot {slot} (wgpu: {reason})"),
        };
        if !matches!(job, SourceJob::Nothing) {
            crate::verify::known_or_refused(&self.device, slab.buffer, layer, || {
                format!("GPU source of slot {slot}")
            })?;
        }
        match *job {
            SourceJob::Nothing => Ok(None),
            SourceJob::Copy { .. } => {
                let (device, probe) = (&self.device, &self.probe);
                self.copy_sources
                    .get_or_try_insert(slab.buffer.clone(), &[slab.buffer], || {
                        let (_, error) = scoped(device, || {
                            let mut encoder =
                                device.create_command_encoder(&wgpu::CommandEncoderDescriptor {
                                    label: Some("kvgpu source probe"),
                                });
                            encoder.copy_buffer_to_buffer(slab.buffer, 0, probe, 0, 4);
                            encoder.finish()
                        });
                        error.map_or(Ok(()), |e| Err(foreign(e)))
                    })?;
                Ok(None)
            }
            SourceJob::Kernel {
                bind_offset,
                bind_size,
                ..
            } => {
                let key = (slab.buffer.clone(), bind_offset, bind_size, layer, slot);
                let (device, kernels) = (&self.device, &self.kernels);
                let dst = &self.slots[layer][slot].buffer;
                let group = self
                    .source_groups
                    .get_or_try_insert(key, &[slab.buffer], || {
                        let (group, error) = scoped(device, || {
                            device.create_bind_group(&wgpu::BindGroupDescriptor {
                                label: Some("kvgpu slab_write"),
                                layout: kernels.write_layout(),
                                entries: &[
                                    wgpu::BindGroupEntry {
                                        binding: 0,
                                        resource: wgpu::BindingResource::Buffer(
                                            wgpu::BufferBinding {
                                                buffer: slab.buffer,
                                                offset: bind_offset,
                                                size: wgpu::BufferSize::new(bind_size),
                                            },
                                        ),
                                    },
                                    wgpu::BindGroupEntry {
                                        binding: 1,
                                        resource: dst.as_entire_binding(),
                                    },
                                ],
                            })
                        });
                        error.map_or(Ok(group), |e| Err(foreign(e)))
                    })?;
                Ok(Some(group))
            }
        }
    }

    fn record_source(
        &mut self,
        encoder: &mut wgpu::CommandEncoder,
        plan: &AppendPlan,
        slot: usize,
        slab: &GpuSlab<'_>,
        job: SourceJob,
        group: Option<wgpu::BindGroup>,
    ) {
        let (layer, storage) = (plan.layer, self.spec.dtype());
        let sb = &self.slots[layer][slot];
        let [run] = plan.runs();
        let (dst_offset, size) = sb.placement.bytes(&run);
        match (job, group) {
            (SourceJob::Copy { src_offset }, _) => {
                encoder.copy_buffer_to_buffer(
                    slab.buffer,
                    src_offset,
                    &sb.buffer,
                    dst_offset,
                    size,
                );
            }
            (
                SourceJob::Kernel {
                    mut params, vec4, ..
                },
                Some(group),
            ) => {
                let words = size / 4;
                let outputs = if vec4 { words / 4 } else { words };
                let (groups, stride) = grid(outputs, self.max_workgroups);
                params.thread_stride = stride;
                params.dst_word_offset = (dst_offset / 4) as u32;
                let pipeline = self.kernels.write(slab.dtype, storage, vec4);
                let params = self.ring.push(&self.queue, &params);
                let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
                    label: Some("kvgpu slab_write"),
                    timestamp_writes: None,
                });
                pass.set_pipeline(&pipeline);
                pass.set_bind_group(0, &group, &[]);
                pass.set_bind_group(1, &params.group, &[params.offset]);
                pass.dispatch_workgroups(groups, 1, 1);
            }
            _ => {}
        }
    }
}
