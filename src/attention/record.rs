//! Turning one checked attention call into commands: the call's checks and plan, its bind groups
//! (the slots' from the cache, queries and output from bounded caches) and both passes.

use super::plan::{self, CallShape, Dispatch, Pass1};
use super::{Attention, AttentionOptions, Job, Queries, Scratch};
use crate::cache::KvCache;
use crate::error::{AttentionProblem, BufferProblem, Error, Result};
use crate::kernels::scoped;

impl Attention {
    pub(super) fn record(
        &mut self,
        encoder: &mut wgpu::CommandEncoder,
        cache: &KvCache,
        job: Job<'_>,
        out: &wgpu::Buffer,
        options: &AttentionOptions,
    ) -> Result<()> {
        let layer = job.layer;
        let (dispatch, q_b) = self.plan(cache, &job, out, options)?;
        let q_a = job.q_a.buffer;
        let q_a_bytes = job.q_a.bytes();
        let q_b_buffer = q_b.map_or(q_a, |q| q.buffer);
        let q_b_bytes = q_b.map_or(q_a_bytes, |q| q.bytes());
        self.ensure_scratch(dispatch.stats_bytes, dispatch.part_bytes);
        let Some(scratch) = &self.scratch else {
            return Err(Error::Device {
                reason: "attention scratch buffers are missing".into(),
            });
        };
        let (device, kernels) = (&self.device, &self.kernels);
        let refused = |which: &'static str| {
            move |e: String| Error::ForeignDevice {
                layer,
                what: format!("{which} buffer (wgpu refused to bind it: {e})"),
            }
        };
        let io = self.io_groups.get_or_try_insert(
            (q_a.clone(), q_a_bytes, q_b_buffer.clone(), q_b_bytes),
            &[q_a, q_b_buffer],
            || {
                let (group, error) = scoped(device, || {
                    device.create_bind_group(&wgpu::BindGroupDescriptor {
                        label: Some("kvgpu attention io"),
                        layout: kernels.attn_io_layout(),
                        entries: &[
                            entry(0, range(q_a, q_a_bytes)),
                            entry(1, range(q_b_buffer, q_b_bytes)),
                            entry(2, scratch.stats.as_entire_binding()),
                            entry(3, scratch.part.as_entire_binding()),
                        ],
                    })
                });
                error.map_or(Ok(group), |e| Err(refused("query")(e)))
            },
        )?;
        let reduce =
            self.out_groups
                .get_or_try_insert((out.clone(), dispatch.out_bytes), &[out], || {
                    let (group, error) = scoped(device, || {
                        device.create_bind_group(&wgpu::BindGroupDescriptor {
                            label: Some("kvgpu attention_reduce"),
                            layout: kernels.reduce_layout(),
                            entries: &[
                                entry(0, scratch.stats.as_entire_binding()),
                                entry(1, scratch.part.as_entire_binding()),
                                entry(2, range(out, dispatch.out_bytes)),
                            ],
                        })
                    });
                    error.map_or(Ok(group), |e| Err(refused("output")(e)))
                })?;
        let partial =
            match dispatch.kernel {
                Pass1::Tiled { batch, rpl } => {
                    self.kernels
                        .attention_partial(cache.spec().dtype(), batch, rpl)
                }
                Pass1::Stream(key) => self.kernels.attention_stream(&key).map_err(|detail| {
                    Error::AttentionRequest {
                        layer,
                        problem: AttentionProblem::DeviceLimit { detail },
                    }
                })?,
            };
        let pairs: Vec<_> = dispatch.pairs().collect();
        let params = self.ring.push_all(&self.queue, &pairs);
        let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
            label: Some("kvgpu attention"),
            timestamp_writes: None,
        });
        for (pair, params) in pairs.iter().zip(params) {
            pass.set_pipeline(&partial);
            pass.set_bind_group(0, cache.attention_group(layer, job.kind), &[]);
            pass.set_bind_group(1, &io, &[]);
            pass.set_bind_group(2, &params.group, &[params.offset]);
            let (chunks, heads) = dispatch.pass1;
            pass.dispatch_workgroups(chunks, heads, pair.q_count);
            pass.set_pipeline(self.kernels.attention_reduce());
            pass.set_bind_group(0, &reduce, &[]);
            pass.set_bind_group(1, &params.group, &[params.offset]);
            pass.dispatch_workgroups(dispatch.pass2, pair.q_count, 1);
        }
        Ok(())
    }

    /// Checks everything about one call and works out its dispatch; records nothing.
    fn plan<'a>(
        &self,
        cache: &KvCache,
        job: &Job<'a>,
        out: &wgpu::Buffer,
        options: &AttentionOptions,
    ) -> Result<(Dispatch, Option<Queries<'a>>)> {
        let layer = job.layer;
        let request = |problem: AttentionProblem| Err(Error::AttentionRequest { layer, problem });
        if cache.device() != &self.device {
            return Err(Error::ForeignDevice {
                layer,
                what: "cache (this Attention serves another device)".into(),
            });
        }
        let [n_q, n_heads, d_a] = job.q_a.shape;
        let d_b = job.q_b.map_or(0, |q| q.shape[2]);
        let visible = cache.visible(layer)?;
        if n_q == 0 || n_q > visible {
            return Err(Error::QueryRows {
                layer,
                n_q,
                visible,
            });
        }
        let scale = options.scale.unwrap_or(job.default_scale);
        if !scale.is_finite() {
            return request(AttentionProblem::Scale { scale });
        }
        let soft_cap = match options.soft_cap {
            None => 0.0,
            Some(c) if c.is_finite() && c > 0.0 => c,
            Some(cap) => return request(AttentionProblem::SoftCap { cap }),
        };
        let window = match options.window {
            None => 0,
            Some(0) => return request(AttentionProblem::EmptyWindow),
            Some(w) => w.min(visible),
        };
        let (a, b, v) = job.kind.slots();
        let view = |slot: usize| cache.full_view(layer, slot);
        let (slot_a, slot_b, slot_v) = (view(a)?, view(b)?, view(v)?);
        let check = |which: &'static str, buffer: &wgpu::Buffer, shape: [usize; 3]| {
            let needed = shape
                .iter()
                .try_fold(4u64, |acc, &d| acc.checked_mul(d as u64))
                .unwrap_or(u64::MAX);
            let usage = buffer.usage();
            if crate::kernels::is_mapped(buffer) {
                return Err(Error::AttentionBuffer {
                    layer,
                    which,
                    problem: BufferProblem::Mapped,
                });
            }
            if !usage.contains(wgpu::BufferUsages::STORAGE) {
                return Err(Error::AttentionBuffer {
                    layer,
                    which,
                    problem: BufferProblem::NoStorage { usage },
                });
            }
            if needed > buffer.size() {
                return Err(Error::BufferTooSmall {
                    layer,
                    which,
                    shape: shape.to_vec(),
                    needed,
                    size: buffer.size(),
                });
            }
            if needed > self.facts.max_binding {
                return Err(Error::AttentionBuffer {
                    layer,
                    which,
                    problem: BufferProblem::BindingTooLarge {
                        shape: shape.to_vec(),
                        bytes: needed,
                        limit: self.facts.max_binding,
                    },
                });
            }
            Ok(needed)
        };
        check(
            if job.q_b.is_some() { "q_latent" } else { "q" },
            job.q_a.buffer,
            job.q_a.shape,
        )?;
        if let Some(q) = job.q_b {
            check("q_rope", q.buffer, q.shape)?;
        }
        check("output", out, [n_q, n_heads, job.d_v])?;
        if cache.owns_buffer(out) {
            return Err(Error::AttentionBuffer {
                layer,
                which: "output",
                problem: BufferProblem::IsSlot,
            });
        }
        let shape = CallShape {
            dtype: cache.spec().dtype(),
            n_q,
            n_heads,
            n_kv: job.n_kv,
            d_a,
            d_b,
            d_v: job.d_v,
            visible,
            row_words: [
                (slot_a.row_bytes / 4) as usize,
                (slot_b.row_bytes / 4) as usize,
                (slot_v.row_bytes / 4) as usize,
            ],
            window,
            scale,
            soft_cap,
            v_from_a: a == v && d_a == job.d_v,
        };
        let dispatch =
            plan::plan(&shape, &self.facts).map_err(|detail| Error::AttentionRequest {
                layer,
                problem: AttentionProblem::DeviceLimit { detail },
            })?;
        Ok((dispatch, job.q_b))
    }

    /// Grows the scratch buffers when this call needs more than they hold (bind groups that named the
    /// old ones are dropped).
    pub(super) fn ensure_scratch(&mut self, stats_bytes: u64, part_bytes: u64) {
        if let Some(s) = &self.scratch
            && s.stats.size() >= stats_bytes
            && s.part.size() >= part_bytes
        {
            return;
        }
        let old = self
            .scratch
            .as_ref()
            .map_or((0, 0), |s| (s.stats.size(), s.part.size()));
        let max_binding = self.facts.max_binding;
        let grow = |old: u64, needed: u64| {
            needed
                .max(old)
                .next_power_of_two()
                .min(max_binding.max(needed))
                .max(16)
        };
        let buffer = |label: &str, size: u64| {
            self.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some(label),
                size,
                usage: wgpu::BufferUsages::STORAGE,
                mapped_at_creation: false,
            })
        };
        self.scratch = Some(Scratch {
            stats: buffer("kvgpu attention stats", grow(old.0, stats_bytes)),
            part: buffer("kvgpu attention partials", grow(old.1, part_bytes)),
        });
        self.io_groups.clear();
        self.out_groups.clear();
    }
}

/// The first `size` bytes of `buffer`.
fn range(buffer: &wgpu::Buffer, size: u64) -> wgpu::BindingResource<'_> {
    wgpu::BindingResource::Buffer(wgpu::BufferBinding {
        buffer,
        offset: 0,
        size: wgpu::BufferSize::new(size),
    })
}

fn entry(binding: u32, resource: wgpu::BindingResource<'_>) -> wgpu::BindGroupEntry<'_> {
    wgpu::BindGroupEntry { binding, resource }
}
