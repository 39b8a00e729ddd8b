//! Attention over the visible rows of one cache layer: GQA / MHA over K and V slots, and DeepSeek's
//! absorbed MLA over `compressed_kv` and `k_pe`. Flash-decoding: chunks of the sequence go to separate
//! workgroups (`shaders/attention_partial.wgsl`), then a reduce pass merges them
//! (`shaders/attention_reduce.wgsl`); both are recorded into the caller's encoder.
//!
//! Work is proportional to the visible rows (or the window), never to the capacity. Pipelines are
//! compiled once per [`Attention`] (make one per device and keep it); bind groups are cached by the buffers they bind; per-call parameters go
//! through a uniform ring, so many attention calls can share one encoder.
//!
//! ```
//! use kvgpu::{Attention, AttentionOptions, CacheSpec, DType, Gpu, HostSlab, KvCache, Queries};
//! use wgpu::util::DeviceExt;
//!
//! # #[cfg(not(target_arch = "wasm32"))] // blocking helpers are native only; see tests/web.rs
//! # fn main() -> kvgpu::Result<()> {
//! let gpu = Gpu::from_env_blocking()?;
//! let spec = CacheSpec::qwen3_0_6b(DType::F16, 1024)?; // K/V of 8 KV heads x 128
//! let mut cache = KvCache::new(&gpu.device, &gpu.queue, spec)?;
//! let mut attention = Attention::for_cache(&cache);
//! // This step's token of layer 0 (the other layers append theirs before `advance`).
//! let kv = vec![0.5f32; 8 * 128];
//! cache.append(0, &[HostSlab::f32(&kv, &[1, 8, 128]), HostSlab::f32(&kv, &[1, 8, 128])])?;
//! // 16 query heads of 128, and room for the output.
//! let q = gpu.device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
//!     label: None,
//!     contents: bytemuck::cast_slice(&[0.1f32; 16 * 128]),
//!     usage: wgpu::BufferUsages::STORAGE,
//! });
//! let out = gpu.device.create_buffer(&wgpu::BufferDescriptor {
//!     label: None,
//!     size: 16 * 128 * 4,
//!     usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
//!     mapped_at_creation: false,
//! });
//! let mut encoder = gpu.device.create_command_encoder(&Default::default());
//! let q = Queries::new(&q, 1, 16, 128);
//! attention.record_gqa(&mut encoder, &cache, 0, q, &out, &AttentionOptions::default())?;
//! gpu.queue.submit([encoder.finish()]);
//! # Ok(())
//! # }
//! # #[cfg(target_arch = "wasm32")]
//! # fn main() {}
//! ```
//!
//! Devices and buffers are told apart the way wgpu compares them, by id within one `wgpu::Instance`:
//! a cache or buffer of another device of the same instance is refused with a typed error; objects
//! of a different instance cannot be recognised and must not be mixed.

mod plan;

use std::sync::Arc;

use crate::cache::{AttentionKind, KvCache};
use crate::error::{Error, Result};
use crate::kernels::{GroupCache, Kernels, ParamRing, scoped};
use plan::{CallShape, DeviceFacts, Dispatch};

/// Options of one attention call; the default is plain causal attention with the default scale.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct AttentionOptions {
    /// Multiplies `q·k`. `None`: `1/sqrt(d_k)` for GQA; `1/sqrt(r + p)` for MLA, where models usually
    /// pass their own (DeepSeek-V2 uses `1/sqrt(qk_nope_head_dim + qk_rope_head_dim)`).
    pub scale: Option<f32>,
    /// Sliding window: each query sees its own row and at most `w - 1` rows before it.
    pub window: Option<usize>,
    /// Logit soft-cap: scaled scores become `cap · tanh(score / cap)`.
    pub soft_cap: Option<f32>,
}

/// Queries in a GPU buffer: f32, row-major `[n_q, n_heads, dim]`, starting at byte 0. The buffer
/// needs `STORAGE` usage.
#[derive(Clone, Copy, Debug)]
pub struct Queries<'a> {
    pub buffer: &'a wgpu::Buffer,
    pub shape: [usize; 3],
}

/// The absorbed queries of MLA: `latent [n_q, n_heads, r]` and `rope [n_q, n_heads, p]`.
#[derive(Clone, Copy, Debug)]
pub struct MlaQueries<'a> {
    pub latent: Queries<'a>,
    pub rope: Queries<'a>,
}

impl<'a> Queries<'a> {
    pub fn new(buffer: &'a wgpu::Buffer, n_q: usize, n_heads: usize, dim: usize) -> Self {
        Self {
            buffer,
            shape: [n_q, n_heads, dim],
        }
    }

    /// Bytes the shape covers (f32), saturating; checked against the buffer before use.
    fn bytes(&self) -> u64 {
        self.shape
            .iter()
            .fold(4u64, |acc, &d| acc.saturating_mul(d as u64))
    }
}

/// Partial results of pass 1, grown (never shrunk) when a call first needs more.
struct Scratch {
    stats: wgpu::Buffer,
    part: wgpu::Buffer,
}

/// What one attention call reads, after the kind-specific checks.
struct Job<'a> {
    layer: usize,
    kind: AttentionKind,
    q_a: Queries<'a>,
    q_b: Option<Queries<'a>>,
    n_kv: usize,
    d_v: usize,
    default_scale: f32,
}

/// Query and scratch bindings of pass 1: q_a (+ bound size), q_b (+ size).
type IoKey = (wgpu::Buffer, u64, wgpu::Buffer, u64);
/// Output binding of the reduce pass (+ bound size).
type OutKey = (wgpu::Buffer, u64);

/// Cached bind groups of queries and outputs: at most this many, keeping at most `PIN_BYTES` of the
/// app's buffers alive (the slots' bind groups belong to their cache, so a dropped cache is released).
const GROUPS: usize = 256;
const PIN_BYTES: u64 = 32 << 20;

/// GQA / MHA and MLA attention over a [`KvCache`], for one device. Owns the pass-1 scratch buffers and
/// bind-group caches for queries and outputs; any number of calls may be recorded into one encoder,
/// where they run in order and share the scratch safely.
pub struct Attention {
    device: wgpu::Device,
    queue: wgpu::Queue,
    kernels: Arc<Kernels>,
    ring: ParamRing,
    scratch: Option<Scratch>,
    io_groups: GroupCache<IoKey>,
    out_groups: GroupCache<OutKey>,
    facts: DeviceFacts,
}

impl std::fmt::Debug for Attention {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Attention")
            .field("kernels", &self.kernels)
            .field(
                "scratch_bytes",
                &self
                    .scratch
                    .as_ref()
                    .map(|s| s.stats.size() + s.part.size()),
            )
            .finish_non_exhaustive()
    }
}

impl Attention {
    /// Attention on `device`, whose commands go through `queue` (the pair `request_device` returned),
    /// with a kernel registry of its own. Prefer [`Attention::for_cache`], which shares the cache's.
    pub fn new(device: &wgpu::Device, queue: &wgpu::Queue) -> Self {
        Self::with_kernels(Kernels::new(device, queue))
    }

    /// Attention on the cache's own device, sharing its kernel registry.
    pub fn for_cache(cache: &KvCache) -> Self {
        Self::with_kernels(cache.kernels().clone())
    }

    /// Attention with the kernel registry of its device (pipelines are compiled once per registry).
    pub fn with_kernels(kernels: Arc<Kernels>) -> Self {
        let device = kernels.device().clone();
        let limits = device.limits();
        Self {
            queue: kernels.queue().clone(),
            ring: ParamRing::new(&kernels),
            scratch: None,
            io_groups: GroupCache::new(GROUPS, PIN_BYTES),
            out_groups: GroupCache::new(GROUPS, PIN_BYTES),
            facts: DeviceFacts {
                max_workgroups: limits.max_compute_workgroups_per_dimension as usize,
                max_binding: limits.max_storage_buffer_binding_size.min(u32::MAX as u64),
                cpu: kernels.is_cpu(),
            },
            device,
            kernels,
        }
    }

    /// Records GQA / MHA attention of `layer` (slots K `[n_kv_heads, d_k]` and V `[n_kv_heads, d_v]`)
    /// into `encoder`: `q [n_q, n_heads, d_k]` are the queries of the layer's last `n_q` visible rows,
    /// `out [n_q, n_heads, d_v]` (f32) receives the result. Query `i` sees rows
    /// `[0, visible - n_q + i]`, limited by the window.
    pub fn record_gqa(
        &mut self,
        encoder: &mut wgpu::CommandEncoder,
        cache: &KvCache,
        layer: usize,
        q: Queries<'_>,
        out: &wgpu::Buffer,
        options: &AttentionOptions,
    ) -> Result<()> {
        let slots = &cache
            .spec()
            .layers()
            .get(layer)
            .ok_or(Error::LayerOutOfRange {
                layer,
                n_layers: cache.spec().n_layers(),
            })?
            .slots;
        let shapes: Vec<&[usize]> = slots.iter().map(|s| s.trailing.as_slice()).collect();
        let (n_kv, d_k, d_v) = match shapes.as_slice() {
            [[hk, dk], [hv, dv]] if hk == hv => (*hk, *dk, *dv),
            _ => {
                return Err(Error::NotAttentionLayer {
                    layer,
                    kind: "GQA",
                    reason: format!(
                        "its slots have trailing shapes {shapes:?}; GQA needs K [n_kv_heads, d_k] and \
                         V [n_kv_heads, d_v]"
                    ),
                });
            }
        };
        let [n_q, n_heads, dim] = q.shape;
        if dim != d_k {
            return Err(Error::QueryShape {
                layer,
                which: "q",
                expected: vec![n_q, n_heads, d_k],
                got: q.shape.to_vec(),
            });
        }
        if n_heads == 0 || !n_heads.is_multiple_of(n_kv) {
            return Err(Error::HeadGroups {
                layer,
                n_heads,
                n_kv_heads: n_kv,
            });
        }
        let job = Job {
            layer,
            kind: AttentionKind::Gqa,
            q_a: q,
            q_b: None,
            n_kv,
            d_v,
            default_scale: 1.0 / (d_k as f32).sqrt(),
        };
        self.record(encoder, cache, job, out, options)
    }

    /// Records MLA absorbed attention of `layer` (slots `compressed_kv [r]` and `k_pe [p]`) into
    /// `encoder`: `out [n_q, n_heads, r] = softmax(scale · (q_latent·c_kv + q_rope·k_pe)) · c_kv` with
    /// `q_latent [n_q, n_heads, r]` and `q_rope [n_q, n_heads, p]`, causal as in [`Attention::record_gqa`].
    /// Up to 16 heads share each read of a latent row.
    pub fn record_mla(
        &mut self,
        encoder: &mut wgpu::CommandEncoder,
        cache: &KvCache,
        layer: usize,
        q: MlaQueries<'_>,
        out: &wgpu::Buffer,
        options: &AttentionOptions,
    ) -> Result<()> {
        let MlaQueries {
            latent: q_latent,
            rope: q_rope,
        } = q;
        let slots = &cache
            .spec()
            .layers()
            .get(layer)
            .ok_or(Error::LayerOutOfRange {
                layer,
                n_layers: cache.spec().n_layers(),
            })?
            .slots;
        let shapes: Vec<&[usize]> = slots.iter().map(|s| s.trailing.as_slice()).collect();
        let (r, p) = match shapes.as_slice() {
            [[r], [p]] => (*r, *p),
            _ => {
                return Err(Error::NotAttentionLayer {
                    layer,
                    kind: "MLA",
                    reason: format!(
                        "its slots have trailing shapes {shapes:?}; MLA needs compressed_kv [r] and k_pe [p]"
                    ),
                });
            }
        };
        let [n_q, n_heads, dim] = q_latent.shape;
        if dim != r {
            return Err(Error::QueryShape {
                layer,
                which: "q_latent",
                expected: vec![n_q, n_heads, r],
                got: q_latent.shape.to_vec(),
            });
        }
        if q_rope.shape != [n_q, n_heads, p] {
            return Err(Error::QueryShape {
                layer,
                which: "q_rope",
                expected: vec![n_q, n_heads, p],
                got: q_rope.shape.to_vec(),
            });
        }
        if n_heads == 0 {
            return Err(Error::HeadGroups {
                layer,
                n_heads,
                n_kv_heads: 1,
            });
        }
        let job = Job {
            layer,
            kind: AttentionKind::Mla,
            q_a: q_latent,
            q_b: Some(q_rope),
            n_kv: 1,
            d_v: r,
            default_scale: 1.0 / ((r + p) as f32).sqrt(),
        };
        self.record(encoder, cache, job, out, options)
    }

    /// [`Attention::record_gqa`] in its own submission.
    pub fn gqa(
        &mut self,
        cache: &KvCache,
        layer: usize,
        q: Queries<'_>,
        out: &wgpu::Buffer,
        options: &AttentionOptions,
    ) -> Result<()> {
        let mut encoder = self.encoder();
        self.record_gqa(&mut encoder, cache, layer, q, out, options)?;
        self.queue.submit([encoder.finish()]);
        Ok(())
    }

    /// [`Attention::record_mla`] in its own submission.
    pub fn mla(
        &mut self,
        cache: &KvCache,
        layer: usize,
        q: MlaQueries<'_>,
        out: &wgpu::Buffer,
        options: &AttentionOptions,
    ) -> Result<()> {
        let mut encoder = self.encoder();
        self.record_mla(&mut encoder, cache, layer, q, out, options)?;
        self.queue.submit([encoder.finish()]);
        Ok(())
    }

    fn encoder(&self) -> wgpu::CommandEncoder {
        self.device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                label: Some("kvgpu attention"),
            })
    }

    fn record(
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
            self.kernels
                .attention_partial(cache.spec().dtype(), dispatch.batch, dispatch.rpl);
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
        let request = |reason: String| Err(Error::AttentionRequest { layer, reason });
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
            return request(format!("scale {scale} is not finite"));
        }
        let soft_cap = match options.soft_cap {
            None => 0.0,
            Some(c) if c.is_finite() && c > 0.0 => c,
            Some(c) => return request(format!("soft-cap {c} must be finite and positive")),
        };
        let window = match options.window {
            None => 0,
            Some(0) => return request("a sliding window of 0 rows sees nothing".into()),
            Some(w) => w.min(visible),
        };
        let (a, b, v) = match job.kind {
            AttentionKind::Gqa => (0, 0, 1),
            AttentionKind::Mla => (0, 1, 0),
        };
        let view = |slot: usize| cache.full_view(layer, slot);
        let (slot_a, slot_b, slot_v) = (view(a)?, view(b)?, view(v)?);
        let check = |which: &'static str, buffer: &wgpu::Buffer, shape: [usize; 3]| {
            let needed = shape
                .iter()
                .try_fold(4u64, |acc, &d| acc.checked_mul(d as u64))
                .unwrap_or(u64::MAX);
            let usage = buffer.usage();
            if !usage.contains(wgpu::BufferUsages::STORAGE) {
                return Err(Error::AttentionBuffer {
                    layer,
                    which,
                    reason: format!("its usage {usage:?} lacks STORAGE"),
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
                    reason: format!(
                        "shape {shape:?} takes {needed} bytes, more than one storage binding of this \
                         device holds ({}); split the queries",
                        self.facts.max_binding
                    ),
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
        if [slot_a.buffer, slot_b.buffer, slot_v.buffer].contains(&out) {
            return Err(Error::AttentionBuffer {
                layer,
                which: "output",
                reason: "it is one of the layer's own slot buffers".into(),
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
        };
        let dispatch = plan::plan(&shape, &self.facts)
            .map_err(|reason| Error::AttentionRequest { layer, reason })?;
        Ok((dispatch, job.q_b))
    }

    /// Grows the scratch buffers when this call needs more than they hold (bind groups that named the
    /// old ones are dropped).
    fn ensure_scratch(&mut self, stats_bytes: u64, part_bytes: u64) {
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
