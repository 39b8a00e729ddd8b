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

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll, Waker};

use crate::cache::KvCache;
use crate::error::{Error, Result};
use crate::kernels::{ParamRing, WriteParams, module, params_entry, storage_entry, wgsl};
use crate::spec::DType;

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
}

/// Parameters of both attention passes; must match `AttnParams` in `shaders/attention_partial.wgsl`
/// and `shaders/attention_reduce.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub(crate) struct AttnParams {
    pub n_q: u32,
    pub n_heads: u32,
    pub group: u32,
    pub n_batches: u32,
    pub d_a: u32,
    pub d_b: u32,
    pub d_v: u32,
    pub visible: u32,
    pub row_words_a: u32,
    pub row_words_b: u32,
    pub row_words_v: u32,
    pub window: u32,
    pub lo: u32,
    pub chunk_len: u32,
    pub n_chunks: u32,
    pub n_kv: u32,
    pub scale: f32,
    pub soft_cap: f32,
    pub _pad0: u32,
    pub _pad1: u32,
}

// The parameter ring's entries are sized for the largest kernel parameters.
const _: () = assert!(size_of::<AttnParams>() <= size_of::<WriteParams>());

/// Rows per tile and invocations per workgroup of both passes (`TILE` in the shaders).
const TILE: usize = 64;
/// Query heads one workgroup may serve (`HB` in the shader, a pipeline constant): the largest of these
/// that divides the group, so a GQA group or the MLA heads of up to 16 read each KV row once.
const HEAD_BATCHES: [usize; 5] = [16, 8, 4, 2, 1];
/// Rows each pass-1 invocation may score per tile (`RPL` in the shader, index into this list): every
/// query element it loads then serves that many rows.
const ROWS_PER_INVOCATION: [usize; 4] = [1, 2, 4, 8];

/// The most rows per invocation with `hb` heads per workgroup (within the shader's 32 accumulators).
fn max_rows_per_invocation(hb: usize) -> usize {
    (32 / hb).clamp(1, 8)
}

/// Pass 1 aims for at least this many workgroups, so that a single decode query fills a large GPU.
const TARGET_WORKGROUPS: usize = 1024;
/// On CPU adapters (llvmpipe, lavapipe, WARP) each workgroup has a fixed cost that outweighs the
/// parallelism of more chunks; a few per core suffice there.
const TARGET_WORKGROUPS_CPU: usize = 16;
/// Cached bind-group pairs per `Attention`; the cache is cleared when it would grow past this.
const BIND_GROUPS: usize = 256;

/// The attention pipelines of one device.
struct AttentionKernels {
    device: wgpu::Device,
    partial_layout: wgpu::BindGroupLayout,
    partial_pipeline_layout: wgpu::PipelineLayout,
    partial_module: wgpu::ShaderModule,
    /// Pass-1 pipelines by storage type (`DType::code`) and heads per workgroup (`HEAD_BATCHES`
    /// index), compiled on first use.
    partial:
        [[[OnceLock<wgpu::ComputePipeline>; ROWS_PER_INVOCATION.len()]; HEAD_BATCHES.len()]; 3],
    reduce_layout: wgpu::BindGroupLayout,
    reduce: wgpu::ComputePipeline,
}

impl AttentionKernels {
    fn new(device: &wgpu::Device) -> Self {
        let partial_layout = device.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
            label: Some("kvgpu attention_partial"),
            entries: &[
                storage_entry(0, true),
                storage_entry(1, true),
                storage_entry(2, true),
                storage_entry(3, true),
                storage_entry(4, true),
                storage_entry(5, false),
                storage_entry(6, false),
                params_entry(7, size_of::<AttnParams>()),
            ],
        });
        let partial_pipeline_layout =
            device.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
                label: Some("kvgpu attention_partial"),
                bind_group_layouts: &[Some(&partial_layout)],
                immediate_size: 0,
            });
        let partial_module = module(device, "kvgpu attention_partial", wgsl::ATTENTION_PARTIAL);
        let reduce_layout = device.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
            label: Some("kvgpu attention_reduce"),
            entries: &[
                storage_entry(0, true),
                storage_entry(1, true),
                storage_entry(2, false),
                params_entry(3, size_of::<AttnParams>()),
            ],
        });
        let reduce_module = module(device, "kvgpu attention_reduce", wgsl::ATTENTION_REDUCE);
        let reduce = device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some("kvgpu attention_reduce"),
            layout: Some(
                &device.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
                    label: Some("kvgpu attention_reduce"),
                    bind_group_layouts: &[Some(&reduce_layout)],
                    immediate_size: 0,
                }),
            ),
            module: &reduce_module,
            entry_point: Some("main"),
            compilation_options: Default::default(),
            cache: None,
        });
        Self {
            device: device.clone(),
            partial_layout,
            partial_pipeline_layout,
            partial_module,
            partial: Default::default(),
            reduce_layout,
            reduce,
        }
    }

    /// The pass-1 pipeline reading `dtype` storage with `HEAD_BATCHES[batch]` heads per workgroup.
    fn partial(&self, dtype: DType, batch: usize, rpl: usize) -> &wgpu::ComputePipeline {
        self.partial[dtype.code() as usize][batch][rpl].get_or_init(|| {
            let constants = [
                ("DTYPE", dtype.code() as f64),
                ("HB", HEAD_BATCHES[batch] as f64),
                ("RPL", ROWS_PER_INVOCATION[rpl] as f64),
            ];
            self.device
                .create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                    label: Some("kvgpu attention_partial"),
                    layout: Some(&self.partial_pipeline_layout),
                    module: &self.partial_module,
                    entry_point: Some("main"),
                    compilation_options: wgpu::PipelineCompilationOptions {
                        constants: &constants,
                        ..Default::default()
                    },
                    cache: None,
                })
        })
    }
}

/// Partial results of pass 1, grown (never shrunk) when a call first needs more.
struct Scratch {
    stats: wgpu::Buffer,
    part: wgpu::Buffer,
}

/// Slot a, slot b, slot v, q_a (+ bound size), q_b (+ size), out (+ size).
type GroupKey = (
    wgpu::Buffer,
    wgpu::Buffer,
    wgpu::Buffer,
    wgpu::Buffer,
    u64,
    wgpu::Buffer,
    u64,
    wgpu::Buffer,
    u64,
);

#[derive(Clone)]
struct Groups {
    partial: wgpu::BindGroup,
    reduce: wgpu::BindGroup,
}

/// What one attention call reads, after the kind-specific checks.
struct Job<'a> {
    layer: usize,
    /// Slot indices: scores `q_a·a (+ q_b·b)`, values from `v`.
    a: usize,
    b: Option<usize>,
    v: usize,
    q_a: Queries<'a>,
    q_b: Option<Queries<'a>>,
    n_kv: usize,
    d_v: usize,
    default_scale: f32,
}

/// A checked attention call, ready to record.
struct Plan<'a> {
    params: AttnParams,
    dtype: DType,
    /// Index into `HEAD_BATCHES`.
    batch: usize,
    /// Index into `ROWS_PER_INVOCATION`.
    rpl: usize,
    slot_a: &'a wgpu::Buffer,
    slot_b: &'a wgpu::Buffer,
    slot_v: &'a wgpu::Buffer,
    q_a: (&'a wgpu::Buffer, u64),
    q_b: (&'a wgpu::Buffer, u64),
    out: (&'a wgpu::Buffer, u64),
    stats_bytes: u64,
    part_bytes: u64,
    pass1: (u32, u32, u32),
    pass2: (u32, u32),
}

/// GQA / MHA and MLA attention over a [`KvCache`], for one device. Owns the pass-1 scratch buffers, a
/// bind-group cache and a parameter ring: record at most [`crate::PARAM_RING_ENTRIES`] calls between
/// submissions. Calls recorded into one encoder run in order and share the scratch safely.
pub struct Attention {
    device: wgpu::Device,
    queue: wgpu::Queue,
    kernels: Arc<AttentionKernels>,
    ring: ParamRing,
    scratch: Option<Scratch>,
    groups: HashMap<GroupKey, Groups>,
    max_workgroups: usize,
    max_binding: u64,
    target_workgroups: usize,
}

impl Attention {
    /// Attention on `device`. Its pipelines are compiled for this object (each on first use) and reused by
    /// every call: make one per device and keep it.
    pub fn new(device: &wgpu::Device, queue: &wgpu::Queue) -> Self {
        let limits = device.limits();
        Self {
            device: device.clone(),
            queue: queue.clone(),
            kernels: Arc::new(AttentionKernels::new(device)),
            ring: ParamRing::new(device),
            scratch: None,
            groups: HashMap::new(),
            max_workgroups: limits.max_compute_workgroups_per_dimension as usize,
            max_binding: limits.max_storage_buffer_binding_size.min(u32::MAX as u64),
            target_workgroups: match device.adapter_info().device_type {
                wgpu::DeviceType::Cpu => TARGET_WORKGROUPS_CPU,
                _ => TARGET_WORKGROUPS,
            },
        }
    }

    /// Attention on the cache's own device.
    pub fn for_cache(cache: &KvCache) -> Self {
        Self::new(cache.device(), cache.queue())
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
            a: 0,
            b: None,
            v: 1,
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
            a: 0,
            b: Some(1),
            v: 0,
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
        let plan = self.plan(cache, &job, out, options)?;
        self.ensure_scratch(plan.stats_bytes, plan.part_bytes);
        let key: GroupKey = (
            plan.slot_a.clone(),
            plan.slot_b.clone(),
            plan.slot_v.clone(),
            plan.q_a.0.clone(),
            plan.q_a.1,
            plan.q_b.0.clone(),
            plan.q_b.1,
            plan.out.0.clone(),
            plan.out.1,
        );
        let groups = match self.groups.get(&key) {
            Some(groups) => groups.clone(),
            None => {
                let groups = self.create_groups(&plan).map_err(|e| Error::AttentionBuffer {
                    layer: job.layer,
                    which: "query or output",
                    reason: format!(
                        "wgpu refused to bind it ({e}); is it from another device than the cache?"
                    ),
                })?;
                if self.groups.len() >= BIND_GROUPS {
                    self.groups.clear();
                }
                self.groups.insert(key, groups.clone());
                groups
            }
        };
        let offset = self.ring.push(&self.queue, &plan.params);
        let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
            label: Some("kvgpu attention"),
            timestamp_writes: None,
        });
        pass.set_pipeline(self.kernels.partial(plan.dtype, plan.batch, plan.rpl));
        pass.set_bind_group(0, &groups.partial, &[offset]);
        pass.dispatch_workgroups(plan.pass1.0, plan.pass1.1, plan.pass1.2);
        pass.set_pipeline(&self.kernels.reduce);
        pass.set_bind_group(0, &groups.reduce, &[offset]);
        pass.dispatch_workgroups(plan.pass2.0, plan.pass2.1, 1);
        Ok(())
    }

    /// Checks everything about one call and works out its dispatch; records nothing.
    fn plan<'a>(
        &self,
        cache: &'a KvCache,
        job: &Job<'a>,
        out: &'a wgpu::Buffer,
        options: &AttentionOptions,
    ) -> Result<Plan<'a>> {
        let layer = job.layer;
        let request = |reason: String| Err(Error::AttentionRequest { layer, reason });
        if cache.device() != &self.device {
            return Err(Error::AttentionBuffer {
                layer,
                which: "cache",
                reason: "the cache lives on another device than this Attention".into(),
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
        let view = |slot: usize| cache.full_view(layer, slot);
        let (slot_a, slot_v) = (view(job.a)?, view(job.v)?);
        let slot_b = match job.b {
            Some(b) => view(b)?,
            None => slot_a,
        };
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
            if needed > self.max_binding {
                return Err(Error::AttentionBuffer {
                    layer,
                    which,
                    reason: format!(
                        "shape {shape:?} takes {needed} bytes, more than one storage binding of this \
                         device holds ({}); split the queries",
                        self.max_binding
                    ),
                });
            }
            Ok(needed)
        };
        let q_a_bytes = check(
            if job.q_b.is_some() { "q_latent" } else { "q" },
            job.q_a.buffer,
            job.q_a.shape,
        )?;
        let q_b = match job.q_b {
            Some(q) => (q.buffer, check("q_rope", q.buffer, q.shape)?),
            None => (job.q_a.buffer, q_a_bytes),
        };
        let out_bytes = check("output", out, [n_q, n_heads, job.d_v])?;
        if [slot_a.buffer, slot_b.buffer, slot_v.buffer].contains(&out) {
            return Err(Error::AttentionBuffer {
                layer,
                which: "output",
                reason: "it is one of the layer's own slot buffers".into(),
            });
        }
        let group = n_heads / job.n_kv;
        let batch = HEAD_BATCHES
            .iter()
            .position(|&b| group.is_multiple_of(b))
            .unwrap_or(HEAD_BATCHES.len() - 1);
        let n_batches = group / HEAD_BATCHES[batch];
        let per_chunk = job.n_kv * n_batches * n_q;
        for (what, n) in [
            ("queries", n_q),
            ("query heads", n_heads),
            ("KV heads x head batches", job.n_kv * n_batches),
        ] {
            if n > self.max_workgroups {
                return request(format!(
                    "{n} {what} exceed the device's {} workgroups per dispatch dimension",
                    self.max_workgroups
                ));
            }
        }
        // The rows any query can see, cut into chunks of whole tiles.
        let lo = match window {
            0 => 0,
            w => (visible - n_q + 1).saturating_sub(w),
        };
        // Rows per invocation: as many as the heads allow, unless a chunk of 64-row tiles would be
        // shorter than one tile of them (short contexts keep their parallelism).
        let rows = visible - lo;
        let chunks_64 = self
            .target_workgroups
            .div_ceil(per_chunk)
            .min(rows.div_ceil(TILE))
            .max(1);
        let rows_per_chunk = rows.div_ceil(chunks_64);
        let rpl = ROWS_PER_INVOCATION
            .iter()
            .rposition(|&r| {
                r == 1
                    || (r <= max_rows_per_invocation(HEAD_BATCHES[batch])
                        && TILE * r <= rows_per_chunk)
            })
            .unwrap_or(0);
        let tile = TILE * ROWS_PER_INVOCATION[rpl];
        let tiles = rows.div_ceil(tile);
        let chunk_bytes = out_bytes.max(n_q as u64 * n_heads as u64 * 8);
        let by_binding = usize::try_from(self.max_binding / chunk_bytes).unwrap_or(usize::MAX);
        let want = self
            .target_workgroups
            .div_ceil(per_chunk)
            .min(tiles)
            .min(by_binding)
            .min(self.max_workgroups)
            .max(1);
        let tiles_per_chunk = tiles.div_ceil(want);
        let n_chunks = tiles.div_ceil(tiles_per_chunk);
        let stats_bytes = (n_chunks * n_q * n_heads * 2 * 4) as u64;
        let part_bytes = n_chunks as u64 * out_bytes;
        let params = AttnParams {
            n_q: n_q as u32,
            n_heads: n_heads as u32,
            group: group as u32,
            n_batches: n_batches as u32,
            d_a: d_a as u32,
            d_b: d_b as u32,
            d_v: job.d_v as u32,
            visible: visible as u32,
            row_words_a: (slot_a.row_bytes / 4) as u32,
            row_words_b: (slot_b.row_bytes / 4) as u32,
            row_words_v: (slot_v.row_bytes / 4) as u32,
            window: window as u32,
            lo: lo as u32,
            chunk_len: (tiles_per_chunk * tile) as u32,
            n_chunks: n_chunks as u32,
            n_kv: job.n_kv as u32,
            scale,
            soft_cap,
            _pad0: 0,
            _pad1: 0,
        };
        Ok(Plan {
            params,
            dtype: cache.spec().dtype(),
            batch,
            rpl,
            slot_a: slot_a.buffer,
            slot_b: slot_b.buffer,
            slot_v: slot_v.buffer,
            q_a: (job.q_a.buffer, q_a_bytes),
            q_b,
            out: (out, out_bytes),
            stats_bytes,
            part_bytes,
            pass1: (n_chunks as u32, (job.n_kv * n_batches) as u32, n_q as u32),
            pass2: (n_heads as u32, n_q as u32),
        })
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
        let grow = |old: u64, needed: u64| {
            needed
                .max(old)
                .next_power_of_two()
                .min(self.max_binding.max(needed))
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
        self.groups.clear();
    }

    /// Creates the bind groups of one call inside an error scope, so that a buffer wgpu refuses (one
    /// from another device) is reported as an error instead of reaching the uncaptured-error handler.
    /// In the browser the scope resolves later; a refused buffer then surfaces as a wgpu error.
    fn create_groups(&self, plan: &Plan<'_>) -> std::result::Result<Groups, String> {
        let Some(scratch) = &self.scratch else {
            return Err("no scratch buffers".into());
        };
        let scope = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let partial = self.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some("kvgpu attention_partial"),
            layout: &self.kernels.partial_layout,
            entries: &[
                entry(0, range(plan.q_a.0, plan.q_a.1)),
                entry(1, range(plan.q_b.0, plan.q_b.1)),
                entry(2, plan.slot_a.as_entire_binding()),
                entry(3, plan.slot_b.as_entire_binding()),
                entry(4, plan.slot_v.as_entire_binding()),
                entry(5, scratch.stats.as_entire_binding()),
                entry(6, scratch.part.as_entire_binding()),
                entry(7, self.ring.binding::<AttnParams>()),
            ],
        });
        let reduce = self.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some("kvgpu attention_reduce"),
            layout: &self.kernels.reduce_layout,
            entries: &[
                entry(0, scratch.stats.as_entire_binding()),
                entry(1, scratch.part.as_entire_binding()),
                entry(2, range(plan.out.0, plan.out.1)),
                entry(3, self.ring.binding::<AttnParams>()),
            ],
        });
        match poll_now(scope.pop()) {
            Some(Some(e)) => Err(e.to_string()),
            _ => Ok(Groups { partial, reduce }),
        }
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

/// Polls a future once: native wgpu resolves error scopes immediately.
fn poll_now<F: Future>(future: F) -> Option<F::Output> {
    let mut future = std::pin::pin!(future);
    match future
        .as_mut()
        .poll(&mut Context::from_waker(Waker::noop()))
    {
        Poll::Ready(v) => Some(v),
        Poll::Pending => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::wgsl::WGSL_LAYOUTS;

    #[test]
    fn host_params_match_both_wgsl_structs() {
        let p = AttnParams::default();
        let base = &p as *const _ as usize;
        let at = |a: *const u32| (a as usize - base) as u32;
        let host = vec![
            ("n_q", at(&p.n_q)),
            ("n_heads", at(&p.n_heads)),
            ("group", at(&p.group)),
            ("n_batches", at(&p.n_batches)),
            ("d_a", at(&p.d_a)),
            ("d_b", at(&p.d_b)),
            ("d_v", at(&p.d_v)),
            ("visible", at(&p.visible)),
            ("row_words_a", at(&p.row_words_a)),
            ("row_words_b", at(&p.row_words_b)),
            ("row_words_v", at(&p.row_words_v)),
            ("window", at(&p.window)),
            ("lo", at(&p.lo)),
            ("chunk_len", at(&p.chunk_len)),
            ("n_chunks", at(&p.n_chunks)),
            ("n_kv", at(&p.n_kv)),
            ("scale", at(&p.scale as *const f32 as *const u32)),
            ("soft_cap", at(&p.soft_cap as *const f32 as *const u32)),
            ("_pad0", at(&p._pad0)),
            ("_pad1", at(&p._pad1)),
        ];
        let rows: Vec<_> = WGSL_LAYOUTS
            .iter()
            .filter(|r| r.0 == "AttnParams")
            .collect();
        // One copy of the struct in each of the two shaders.
        assert_eq!(rows.len(), 2 * host.len());
        for copy in rows.chunks(host.len()) {
            assert!(copy.iter().all(|r| r.3 as usize == size_of::<AttnParams>()));
            assert_eq!(copy.iter().map(|r| (r.1, r.2)).collect::<Vec<_>>(), host);
        }
    }
}
