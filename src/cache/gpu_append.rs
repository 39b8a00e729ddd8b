//! Appends from GPU buffers: each source is planned (`source.rs`), bound and checked against the
//! device, then recorded as a copy or a slab-write dispatch into the caller's encoder.

use super::source::{self, Destination, Source, SourceJob};
use super::{GpuSlab, KvCache, SourceKey};
use crate::error::{Error, Result};
use crate::kernels::{grid, scoped, write_outputs};
use crate::ledger::AppendPlan;
use crate::placement::Run;

/// One checked move of a part of a GPU slab into a run of its slot, with its bind group.
pub(crate) struct GpuMove {
    slot: usize,
    run: Run,
    job: SourceJob,
    group: Option<wgpu::BindGroup>,
    kept: Option<Kept>,
}

/// What checking a source made that the cache keeps for later appends: kept only when the append
/// is recorded ([`KvCache::keep_source`]), so that a refused append pins none of the app's buffers.
pub(crate) enum Kept {
    /// A copy source found to be this device's.
    Copy(wgpu::Buffer),
    /// A source's bind group, its key and the outside buffers it binds.
    Group(SourceKey, [wgpu::Buffer; 2], wgpu::BindGroup),
}

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
        let [run] = plan.runs();
        self.check_layer_usable(layer)?;
        let moves = self.prepare_gpu_runs(layer, slabs, plan.n_new, &[(0, run)])?;
        self.record_gpu_moves(encoder, layer, slabs, moves);
        self.ledger.commit_append(plan);
        Ok(plan)
    }

    /// Checks GPU slabs of `n_new` rows (shapes already checked against the layer's slots) for a move
    /// into `runs` of the slot buffers (`(first slab row, run)`, the runs covering the slabs' rows in
    /// order), and makes their bind groups (each source's device check); records nothing.
    pub(crate) fn prepare_gpu_runs(
        &mut self,
        layer: usize,
        slabs: &[GpuSlab<'_>],
        n_new: usize,
        runs: &[(usize, Run)],
    ) -> Result<Vec<GpuMove>> {
        // The whole slabs first, so an empty append still checks its sources.
        for (slot, slab) in slabs.iter().enumerate() {
            source::plan_source(
                layer,
                slot,
                &self.source_of(layer, slot, slab, slab.offset, slab.shape),
                &self.destination(layer, slot),
                n_new,
            )?;
        }
        // Then each run's part of each slab: rows [first, first + n_rows) start `first` row strides on.
        let mut parts = Vec::with_capacity(runs.len() * slabs.len());
        for &(first, run) in runs {
            for (slot, slab) in slabs.iter().enumerate() {
                let row_stride = match slab.strides {
                    Some(strides) => strides[0],
                    None => source::contiguous_strides(slab.shape)[0],
                };
                let mut shape = slab.shape.to_vec();
                shape[0] = run.n_rows;
                // Inside the whole slab, which was checked to lie in its buffer: no overflow.
                let offset = slab.offset + first as u64 * row_stride as u64;
                parts.push((slot, run, offset, shape));
            }
        }
        let jobs = parts
            .iter()
            .map(|(slot, run, offset, shape)| {
                source::plan_source(
                    layer,
                    *slot,
                    &self.source_of(layer, *slot, &slabs[*slot], *offset, shape),
                    &self.destination(layer, *slot),
                    run.n_rows,
                )
            })
            .collect::<Result<Vec<_>>>()?;
        // Bind groups (and the device check of each source) before anything is recorded; a copy
        // source is probed once, however many runs it fills.
        let mut probed: Vec<&wgpu::Buffer> = Vec::new();
        let mut groups = Vec::with_capacity(parts.len());
        for ((slot, ..), job) in parts.iter().zip(&jobs) {
            let slab = &slabs[*slot];
            if matches!(job, SourceJob::Copy { .. }) && probed.contains(&slab.buffer) {
                groups.push((None, None));
                continue;
            }
            let made = self.prepare_source(layer, *slot, slab, job, None)?;
            if matches!(made.1, Some(Kept::Copy(_))) {
                probed.push(slab.buffer);
            }
            groups.push(made);
        }
        let kernels = jobs
            .iter()
            .filter(|j| matches!(j, SourceJob::Kernel { .. }));
        self.ring.reserve(kernels.count() as u64)?;
        Ok(parts
            .into_iter()
            .zip(jobs)
            .zip(groups)
            .map(|(((slot, run, ..), job), (group, kept))| GpuMove {
                slot,
                run,
                job,
                group,
                kept,
            })
            .collect())
    }

    /// Records the moves [`KvCache::prepare_gpu_runs`] made for `slabs`.
    pub(crate) fn record_gpu_moves(
        &mut self,
        encoder: &mut wgpu::CommandEncoder,
        layer: usize,
        slabs: &[GpuSlab<'_>],
        moves: Vec<GpuMove>,
    ) {
        for m in moves {
            if let Some(kept) = m.kept {
                self.keep_source(kept);
            }
            self.record_source(
                encoder,
                layer,
                m.slot,
                &m.run,
                &slabs[m.slot],
                m.job,
                m.group,
            );
        }
    }

    /// Keeps what checking a source made ([`Kept`]), now that its append is recorded.
    pub(crate) fn keep_source(&mut self, kept: Kept) {
        match kept {
            Kept::Copy(buffer) => {
                let pins = [&buffer];
                self.copy_sources.keep(buffer.clone(), &pins, ());
            }
            Kept::Group(key, [source, map], group) => {
                self.source_groups.keep(key, &[&source, &map], group);
            }
        }
    }

    /// What the source planner needs to know of the part of `slab` at `offset` shaped `shape`.
    pub(crate) fn source_of<'a>(
        &self,
        layer: usize,
        slot: usize,
        slab: &GpuSlab<'a>,
        offset: u64,
        shape: &'a [usize],
    ) -> Source<'a> {
        Source {
            buffer_size: slab.buffer.size(),
            usage: slab.buffer.usage(),
            is_destination: slab.buffer == &self.slots[layer][slot].buffer,
            held: crate::kernels::held(slab.buffer),
            dtype: slab.dtype,
            offset,
            shape,
            strides: slab.strides,
        }
    }

    /// The destination slot of `layer` and the device's binding rules, for the source planner.
    pub(crate) fn destination(&self, layer: usize, slot: usize) -> Destination {
        let sb = &self.slots[layer][slot];
        Destination {
            storage: sb.dtype,
            inv_scale: sb.inv_scale_bits(),
            row_elems: sb.row_elems,
            row_bytes: sb.placement.row_bytes,
            min_offset_alignment: self.min_storage_offset_alignment,
            max_binding: self.max_binding,
        }
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
    /// runs here, inside an error scope, so the caller's encoder never sees the refusal. Then, the
    /// source known to be this device's, a source whose mapping is still pending is refused as a
    /// mapped one ([`crate::kernels::map_pending`]). What it made for the cache to keep comes back
    /// with it ([`Kept`]), kept once the append is recorded.
    pub(crate) fn prepare_source(
        &mut self,
        layer: usize,
        slot: usize,
        slab: &GpuSlab<'_>,
        job: &SourceJob,
        map: Option<&wgpu::Buffer>,
    ) -> Result<(Option<wgpu::BindGroup>, Option<Kept>)> {
        let prepared = self.bind_source(layer, slot, slab, job, map)?;
        if !matches!(job, SourceJob::Nothing)
            && crate::kernels::map_pending(&self.device, slab.buffer)
        {
            return Err(Error::SourceLayout {
                layer,
                slot,
                problem: crate::error::SourceProblem::Mapped,
            });
        }
        Ok(prepared)
    }

    /// [`KvCache::prepare_source`] but for the pending mapping.
    fn bind_source(
        &mut self,
        layer: usize,
        slot: usize,
        slab: &GpuSlab<'_>,
        job: &SourceJob,
        map: Option<&wgpu::Buffer>,
    ) -> Result<(Option<wgpu::BindGroup>, Option<Kept>)> {
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
            SourceJob::Nothing => Ok((None, None)),
            SourceJob::Copy { .. } => {
                if self.copy_sources.get(slab.buffer).is_some() {
                    return Ok((None, None));
                }
                let (device, probe) = (&self.device, &self.probe);
                let (_, error) = scoped(device, || {
                    let mut encoder =
                        device.create_command_encoder(&wgpu::CommandEncoderDescriptor {
                            label: Some("kvgpu source probe"),
                        });
                    encoder.copy_buffer_to_buffer(slab.buffer, 0, probe, 0, 4);
                    encoder.finish()
                });
                match error {
                    Some(e) => Err(foreign(e)),
                    None => Ok((None, Some(Kept::Copy(slab.buffer.clone())))),
                }
            }
            SourceJob::Kernel {
                bind_offset,
                bind_size,
                ..
            } => {
                let map = map.unwrap_or(self.kernels.no_pages()).clone();
                let key = (
                    slab.buffer.clone(),
                    bind_offset,
                    bind_size,
                    layer,
                    slot,
                    map.clone(),
                );
                if let Some(group) = self.source_groups.get(&key) {
                    return Ok((Some(group), None));
                }
                let dst = &self.slots[layer][slot].buffer;
                let (group, error) = scoped(&self.device, || {
                    self.device.create_bind_group(&wgpu::BindGroupDescriptor {
                        label: Some("kvgpu slab_write"),
                        layout: self.kernels.write_layout(),
                        entries: &[
                            wgpu::BindGroupEntry {
                                binding: 0,
                                resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                                    buffer: slab.buffer,
                                    offset: bind_offset,
                                    size: wgpu::BufferSize::new(bind_size),
                                }),
                            },
                            wgpu::BindGroupEntry {
                                binding: 1,
                                resource: dst.as_entire_binding(),
                            },
                            wgpu::BindGroupEntry {
                                binding: 2,
                                resource: map.as_entire_binding(),
                            },
                        ],
                    })
                });
                match error {
                    Some(e) => Err(foreign(e)),
                    None => {
                        let kept = Kept::Group(key, [slab.buffer.clone(), map], group.clone());
                        Ok((Some(group), Some(kept)))
                    }
                }
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn record_source(
        &mut self,
        encoder: &mut wgpu::CommandEncoder,
        layer: usize,
        slot: usize,
        run: &Run,
        slab: &GpuSlab<'_>,
        job: SourceJob,
        group: Option<wgpu::BindGroup>,
    ) {
        let sb = &self.slots[layer][slot];
        let storage = sb.dtype;
        let (dst_offset, size) = sb.placement.bytes(run);
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
                let outputs = write_outputs(&params, storage, vec4);
                let (groups, stride) = grid(outputs, self.max_workgroups);
                params.thread_stride = stride;
                params.dst_word_offset = (dst_offset / 4) as u32;
                let pipeline = self.kernels.write(slab.dtype, storage, vec4, false);
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
