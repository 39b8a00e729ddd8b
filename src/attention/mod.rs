//! Attention over the visible rows of one cache layer: GQA / MHA over K and V slots, and DeepSeek's
//! absorbed MLA over `compressed_kv` and `k_pe`. Flash-decoding: chunks of the sequence go to separate
//! workgroups, then a reduce pass merges them (`shaders/attention_reduce.wgsl`); both are recorded
//! into the caller's encoder. A streaming call of one chunk whose output is laid out as its partial
//! results writes the output in pass 1 and records no reduce (`record::writes_directly`).
//!
//! Pass 1 has two kernels ([`KernelChoice`]). The *streaming* kernel (`stream.rs`, WGSL generated
//! and compiled once per shape) gives each KV head and chunk a team of lanes that split every row
//! in vector loads and keep their share of the queries and outputs in registers; it sums a row's
//! dot products with `subgroupAdd` where the device has subgroups of one size (on CPU adapters in
//! steps of `subgroupShuffleXor`; request `wgpu::Features::SUBGROUP` when the adapter offers it:
//! [`crate::Gpu`] does), else through workgroup memory. On CPU adapters with subgroups a team takes
//! several KV heads whole, so that its lanes read a run of each row (one where no slot is f32 on
//! lavapipe from Mesa 25.0 on, whose loads cost less); on CPU adapters without them a
//! team is one invocation reading whole rows (`KernelChoice::StreamAlone`). It takes the shapes
//! whose every head dimension is a whole number of its slot's vectors (4 f32, 8 f16 or bf16, 16
//! q8_0, q4_0 or fp8 elements), whose rows are whole 16-byte vectors (q8_0 and q4_0 rows may end
//! inside one, after their scales), and whose lanes need few enough floats. The *tiled* kernel
//! (`shaders/attention_partial.wgsl`) takes every other shape.
//!
//! Work is proportional to the visible rows (or the window), never to the capacity. Pipelines are
//! compiled once per kernel registry ([`crate::Kernels`], shared by the caches and `Attention`s made
//! with it); bind groups are cached by the buffers they bind; per-call parameters go
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
//! Queries and the output are f32 views of the app's buffers: [`Queries::new`] and a plain
//! `&wgpu::Buffer` are row-major from element 0, and [`Queries::at`] / [`Queries::with_strides`]
//! (likewise [`Output`]) take any element offset and `[query, head, element]` strides, such as the
//! query part of fused `[q | k | v]` rows. Before anything is recorded every element of every view
//! must lie inside its buffer (checked arithmetic: a view that overflows is refused), the bytes a view
//! spans must fit one storage binding, and the output's axes must nest so that no two of its elements
//! share an address; it may share a buffer with its queries, but not the bytes their view spans
//! (from its first element to its last: an output interleaved with the queries' rows is refused), and
//! it may not be a slot of the cache. Any f32 element may start a view: the binding starts at the device's offset
//! alignment below it and the kernels take the rest of the offset as a parameter.
//!
//! Devices and buffers are told apart the way wgpu compares them, by id within one `wgpu::Instance`:
//! a cache or buffer of another device of the same instance is refused with a typed error; objects
//! of a different instance cannot be recognised and must not be mixed ([`crate::Gpu::open`] opens
//! every device of the same backends on one instance).

mod plan;
mod record;
mod request;
mod stream;
mod view;

pub(crate) use plan::LOOP_BUDGET;

use std::num::NonZeroUsize;
use std::sync::Arc;

use crate::cache::{AttentionKind, KvCache};
use crate::error::{Error, Result};
use crate::kernels::{GroupCache, Kernels, ParamRing, UploadRing, allocated};
use crate::paged::PagedCache;
use plan::DeviceFacts;
pub use plan::KernelChoice;
pub(crate) use plan::RowMode;
use record::Rows;
pub use request::{AttentionOptions, Kv, MAX_SOFT_CAP, MlaQueries, Output, Queries};
pub(crate) use stream::{StreamKey, source as stream_source};

/// Partial results of pass 1, grown (never shrunk) when a call first needs more.
#[derive(Clone)]
struct Scratch {
    stats: wgpu::Buffer,
    part: wgpu::Buffer,
}

impl crate::kernels::Made for Scratch {
    fn each(&self, f: &mut dyn FnMut(&wgpu::Buffer)) {
        f(&self.stats);
        f(&self.part);
    }
}

/// The attention a layer's slots allow: GQA / MHA over K `[n_kv, d_k]` and V `[n_kv, d_v]` (`d_a =
/// d_k`, no `d_b`), or MLA over `compressed_kv [r]` and `k_pe [p]` (`d_a = d_v = r`, `d_b = p`, one
/// KV "head").
#[derive(Clone, Copy)]
struct LayerShape {
    kind: AttentionKind,
    n_kv: usize,
    d_a: usize,
    d_b: usize,
    d_v: usize,
}

impl LayerShape {
    /// The shape of a layer with these slot shapes, if it has attention.
    fn of(shapes: &[Vec<usize>]) -> Option<Self> {
        match shapes {
            [k, v] if k.len() == 2 && v.len() == 2 && k[0] == v[0] => Some(Self {
                kind: AttentionKind::Gqa,
                n_kv: k[0],
                d_a: k[1],
                d_b: 0,
                d_v: v[1],
            }),
            [a, b] if a.len() == 1 && b.len() == 1 => Some(Self {
                kind: AttentionKind::Mla,
                n_kv: 1,
                d_a: a[0],
                d_b: b[0],
                d_v: a[0],
            }),
            _ => None,
        }
    }
}

/// What one attention call reads, after the kind-specific checks.
struct Job<'a> {
    layer: usize,
    kind: AttentionKind,
    q_a: Queries<'a>,
    q_b: Option<Queries<'a>>,
    out: Output<'a>,
    n_kv: usize,
    d_v: usize,
    default_scale: f32,
}

/// One pipeline to run once in [`Attention::prepare`]: a layer, its kind, a decode call's parameters,
/// and the reduce workgroup size that call takes.
type WarmUp = (
    usize,
    AttentionKind,
    crate::kernels::AttnParams,
    wgpu::ComputePipeline,
    u32,
);

/// Query bindings of pass 1: q_a and q_b, each with its bound (offset, size), and the output where it
/// is bound in place of the partial results (`AttnParams::direct`).
type IoKey = (
    wgpu::Buffer,
    (u64, u64),
    wgpu::Buffer,
    (u64, u64),
    Option<OutKey>,
);
/// Output binding of the reduce pass, with its bound (offset, size).
type OutKey = (wgpu::Buffer, (u64, u64));
/// The bind-group caches of an [`Attention`] whose scratch grew: they name the old scratch.
type RetiredGroups = (GroupCache<IoKey>, GroupCache<OutKey>);

/// Cached bind groups of queries and of outputs: at most this many of each, each keeping at most
/// `PIN_BYTES` of the app's buffers alive (the slots' bind groups belong to their cache, so a
/// dropped cache is released).
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
    /// The query tables of ragged batches.
    uploads: UploadRing,
    scratch: Option<Scratch>,
    io_groups: GroupCache<IoKey>,
    out_groups: GroupCache<OutKey>,
    facts: DeviceFacts,
    /// Every streaming kernel asked for counts as refused ([`Attention::refuse_streaming_kernels`]).
    refuse_streams: bool,
}

impl std::fmt::Debug for Attention {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Attention")
            .field("kernels", &self.kernels)
            .field("scratch_bytes", &self.scratch_bytes())
            .finish_non_exhaustive()
    }
}

impl Attention {
    /// Attention on `device`, whose commands go through `queue` (the pair `request_device` returned;
    /// a queue of another device is refused with [`Error::QueueMismatch`]), with a kernel registry of
    /// its own. Prefer [`Attention::for_cache`], which shares the cache's.
    pub fn new(device: &wgpu::Device, queue: &wgpu::Queue) -> Result<Self> {
        Ok(Self::with_kernels(Kernels::new(device, queue)?))
    }

    /// Attention on the cache's own device, sharing its kernel registry.
    pub fn for_cache(cache: &KvCache) -> Self {
        Self::with_kernels(cache.kernels().clone())
    }

    /// Attention on the pool's own device, sharing its kernel registry.
    pub fn for_pool(pool: &PagedCache) -> Self {
        Self::with_kernels(pool.kernels().clone())
    }

    /// Attention with the kernel registry of its device (pipelines are compiled once per registry).
    pub fn with_kernels(kernels: Arc<Kernels>) -> Self {
        let device = kernels.device().clone();
        let limits = device.limits();
        Self {
            queue: kernels.queue().clone(),
            ring: ParamRing::new(&kernels),
            uploads: UploadRing::new(kernels.device()),
            scratch: None,
            io_groups: GroupCache::new(GROUPS, PIN_BYTES),
            out_groups: GroupCache::new(GROUPS, PIN_BYTES),
            facts: DeviceFacts {
                max_workgroups: limits.max_compute_workgroups_per_dimension as usize,
                max_binding: crate::kernels::binding_limit(&limits),
                offset_alignment: limits.min_storage_buffer_offset_alignment.into(),
                cpu: kernels.is_cpu(),
                cores: host_threads(),
                subgroup: kernels.subgroup_size(),
                int64: kernels.has_int64(),
                mesa: kernels.mesa_version(),
                storage_buffers: limits.max_storage_buffers_per_shader_stage,
                bind_groups: limits.max_bind_groups,
                workgroup_bytes: limits.max_compute_workgroup_storage_size.into(),
                choice: KernelChoice::Auto,
                target: None,
            },
            refuse_streams: false,
            device,
            kernels,
        }
    }

    /// The kernel registry this attention builds its pipelines in.
    pub fn kernels(&self) -> &Arc<Kernels> {
        &self.kernels
    }

    /// Compiles, ahead of the first call, the pipelines attention needs for every attention layer
    /// of `cache` (GQA / MHA layers with slots K `[n_kv, d_k]` and V `[n_kv, d_v]`, MLA layers with
    /// `compressed_kv [r]` and `k_pe [p]`) with `n_heads` query heads, under the kernel choice in
    /// force. A software adapter compiles shaders for up to seconds each (more on OpenGL with a
    /// cold shader cache), and some drivers only when a pipeline first runs: `prepare` builds each
    /// pipeline and submits one dispatch of it that returns at once, touching no memory, then waits
    /// for the device (natively; in the browser the submission runs on its own). Call it while
    /// loading a model so the first token does not wait. Returns how many pass-1 pipelines it built
    /// itself (0 when every one was built before). Attentions of one registry may prepare on
    /// several threads at once: each pipeline is built once, by the first call that needs it, while
    /// the others build theirs. It builds the kernels of decode and of calls of several queries
    /// (chunked prefill, verification: on CPU adapters with subgroups teams of 4 and 8 queries take
    /// their own kernels, so lavapipe compiles Llama-3-8B's for 4.1-4.5 s with an empty shader
    /// cache instead of 2.0-2.3), and of calls without a logit soft-cap: on CPU adapters with
    /// subgroups (lavapipe) a call with one takes its own kernel, compiled when first used. Other
    /// layers are skipped; a head count that does not divide into a GQA layer's KV heads is refused
    /// with [`Error::HeadGroups`], a shape the forced kernel cannot take with
    /// [`Error::AttentionRequest`], both before anything is built. A generated kernel the device
    /// refuses is [`Error::AttentionRequest`] too under a forced kernel ([`KernelChoice::Auto`]
    /// builds the tiled kernel instead), found as it is built, and the pipelines built before it
    /// stay built (natively: in the browser the refusal is the device's uncaptured error, and the
    /// refused pipeline is kept as built). A cache of another device is refused with
    /// [`Error::ForeignDevice`] naming layer 0, since the refusal is of the whole cache.
    pub fn prepare(&mut self, cache: &KvCache, n_heads: usize) -> Result<usize> {
        self.prepare_rows(cache, None, n_heads)
    }

    /// [`Attention::prepare`] for the paged kernels of a pool's sequences, one at a time and in
    /// batches.
    pub fn prepare_paged(&mut self, pool: &PagedCache, n_heads: usize) -> Result<usize> {
        let paging = plan::Paging {
            page_size: pool.page_size(),
            table_base: 0,
            n_pages: pool.n_pages(),
        };
        self.prepare_rows(pool.store(), Some(paging), n_heads)
    }

    fn prepare_rows(
        &mut self,
        cache: &KvCache,
        paging: Option<plan::Paging>,
        n_heads: usize,
    ) -> Result<usize> {
        if cache.device() != &self.device {
            return Err(Error::ForeignDevice {
                layer: 0,
                what: "cache (this Attention serves another device)".into(),
            });
        }
        // Every layer's plan first, so a refused head count or shape builds nothing. (A generated
        // kernel the device itself refuses is found as it is built: the pipelines of the layers
        // before it stay built, for later calls.)
        let mut planned = Vec::new();
        for layer in 0..cache.spec().layers().len() {
            let Some(l) = LayerShape::of(cache.ledger().slot_shapes(layer)?) else {
                continue;
            };
            if n_heads == 0 || !n_heads.is_multiple_of(l.n_kv) {
                return Err(Error::HeadGroups {
                    layer,
                    n_heads,
                    n_kv_heads: l.n_kv,
                });
            }
            let slots = record::slot_rows(cache, layer, l.kind, l.d_a, l.d_v)?;
            // A pool's sequences are read one at a time or as a ragged batch: both kernels.
            let batch = plan::Ragged { lo: 0, seen: 1 };
            let modes: &[Option<plan::Ragged>] = if paging.is_some() {
                &[None, Some(batch)]
            } else {
                &[None]
            };
            // Decode, and the calls of several queries (chunked prefill, verification) of one cache
            // or sequence, where the planner takes teams of several queries for them: each kernel
            // once.
            let counts = |ragged: Option<plan::Ragged>| {
                let teams = match ragged {
                    None => &plan::QUERIES_PER_TEAM[..],
                    Some(_) => &[],
                };
                std::iter::once(1).chain(teams.iter().copied())
            };
            let mut kernels = Vec::new();
            for (ragged, n_q) in modes.iter().flat_map(|&r| counts(r).map(move |n| (r, n))) {
                let shape = plan::CallShape {
                    dtypes: slots.dtypes,
                    scales: slots.scales,
                    n_q,
                    n_heads,
                    n_kv: l.n_kv,
                    d_a: l.d_a,
                    d_b: l.d_b,
                    d_v: l.d_v,
                    visible: n_q,
                    row_words: slots.row_words,
                    window: 0,
                    scale: 1.0,
                    soft_cap: 0.0,
                    v_from_a: slots.v_from_a,
                    paging,
                    ragged,
                };
                let dispatch = plan::plan(&shape, &self.facts).map_err(plan::refused_at(layer))?;
                if !kernels.contains(&dispatch.kernel) {
                    kernels.push(dispatch.kernel);
                    planned.push((layer, l.kind, shape, dispatch));
                }
            }
        }
        let mut built = 0;
        let mut runs = Vec::new();
        for &(layer, kind, shape, mut dispatch) in &planned {
            if let plan::Pass1::Stream(key) = dispatch.kernel {
                match self.stream_pipeline(&key) {
                    Ok(fetched) => {
                        built += usize::from(fetched.made);
                        let (params, lanes) = (dispatch.params, dispatch.reduce_lanes);
                        runs.push((layer, kind, params, fetched.pipeline, lanes));
                        continue;
                    }
                    // Auto's calls take the tiled kernel where the device refused the streaming
                    // one: its pipelines, as for a forced tiled kernel.
                    Err(_) if self.facts.choice == KernelChoice::Auto => {
                        let facts = DeviceFacts {
                            choice: KernelChoice::Tiled,
                            ..self.facts
                        };
                        dispatch = plan::plan(&shape, &facts).map_err(plan::refused_at(layer))?;
                    }
                    Err(detail) => {
                        let kernel = crate::error::AttentionLimit::Kernel;
                        return Err(plan::refused_at(layer)((kernel, detail)));
                    }
                }
            }
            // Shorter contexts may take fewer rows per invocation: every variant the plan may
            // choose for the batch.
            if let plan::Pass1::Tiled {
                dtypes,
                slot_b,
                batch,
                rows,
                ..
            } = dispatch.kernel
            {
                for rpl in plan::tiled_rows(&shape, batch) {
                    let fetched = self
                        .kernels
                        .attention_partial(dtypes, slot_b, batch, rpl, rows);
                    built += usize::from(fetched.made);
                    runs.push((
                        layer,
                        kind,
                        dispatch.params,
                        fetched.pipeline,
                        dispatch.reduce_lanes,
                    ));
                }
            }
        }
        self.warm_up(cache, &runs);
        Ok(built)
    }

    /// Submits one dispatch of each pass-1 pipeline and of the reduce pass, so that drivers that
    /// compile a pipeline when it first runs do it now. Each gets the parameters of the call it was
    /// planned for (a decode call, or one of 4 or 8 queries over as many rows; lavapipe compiles a
    /// variant per value of some parameters), but with its query and output
    /// views starting past any binding (`u32::MAX`): every kernel's bounds check fails, and it returns
    /// before touching memory. (Zero strides alone would not do: every element of such a view is
    /// element 0, which fits the 16-byte bindings, and a kernel would run its whole pass.)
    fn warm_up(&mut self, cache: &KvCache, runs: &[WarmUp]) {
        // Best effort: a device that cannot make the scratch, the parameter entries or the dummy
        // binding here (each made under the out-of-memory check) refuses the first call instead.
        if self.ensure_scratch(16, 16).is_err() || self.ring.reserve(runs.len() as u64).is_err() {
            return;
        }
        let Some(scratch) = &self.scratch else {
            return;
        };
        let dummy = allocated(&self.device, "attention's warm-up binding", 16, || {
            self.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("kvgpu attention warm-up"),
                size: 16,
                usage: wgpu::BufferUsages::STORAGE,
                mapped_at_creation: false,
            })
        });
        let Ok(dummy) = dummy else {
            return;
        };
        let group = |layout: &wgpu::BindGroupLayout, buffers: [&wgpu::Buffer; 4], n: usize| {
            let entries: Vec<_> = buffers[..n]
                .iter()
                .enumerate()
                .map(|(i, b)| wgpu::BindGroupEntry {
                    binding: i as u32,
                    resource: b.as_entire_binding(),
                })
                .collect();
            self.device.create_bind_group(&wgpu::BindGroupDescriptor {
                label: Some("kvgpu attention warm-up"),
                layout,
                entries: &entries,
            })
        };
        let io = group(
            self.kernels.attn_io_layout(),
            [&dummy, &dummy, &scratch.stats, &scratch.part],
            4,
        );
        let reduce = group(
            self.kernels.reduce_layout(),
            [&scratch.stats, &scratch.part, &dummy, &dummy],
            3,
        );
        let all: Vec<_> = runs
            .iter()
            .map(|r| crate::kernels::AttnParams {
                view_a: [u32::MAX, 0, 0, 0],
                view_out: [u32::MAX, 0, 0, 0],
                ..r.2
            })
            .collect();
        let params = self.ring.push_all(&self.queue, &all);
        let mut encoder = self.encoder();
        {
            let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some("kvgpu attention warm-up"),
                timestamp_writes: None,
            });
            for ((layer, kind, _, pipeline, lanes), params) in runs.iter().zip(&params) {
                pass.set_pipeline(pipeline);
                pass.set_bind_group(0, cache.attention_group(*layer, *kind), &[]);
                pass.set_bind_group(1, &io, &[]);
                pass.set_bind_group(2, &params.group, &[params.offset]);
                pass.dispatch_workgroups(1, 1, 1);
                pass.set_pipeline(self.kernels.attention_reduce(*lanes));
                pass.set_bind_group(0, &reduce, &[]);
                pass.set_bind_group(1, &params.group, &[params.offset]);
                pass.dispatch_workgroups(1, 1, 1);
            }
            // On a CPU adapter a call whose chunks would take the 8-lane reduce past the loop
            // budget takes the 64-lane one: built too, so that a long call compiles nothing.
            if let (true, Some(params)) = (self.facts.cpu, params.first()) {
                pass.set_pipeline(
                    self.kernels
                        .attention_reduce(crate::kernels::REDUCE_LANES[0]),
                );
                pass.set_bind_group(0, &reduce, &[]);
                pass.set_bind_group(1, &params.group, &[params.offset]);
                pass.dispatch_workgroups(1, 1, 1);
            }
        }
        self.queue.submit([encoder.finish()]);
        #[cfg(not(target_arch = "wasm32"))]
        let _ = self.device.poll(wgpu::PollType::wait_indefinitely());
    }

    /// Bytes of the pass-1 scratch buffers this `Attention` holds: sized by the largest call so far
    /// (partial results and statistics of every query, head and chunk of one dispatch pair, each
    /// buffer the next power of two, at most one storage binding) and kept for the calls that
    /// follow. 0 before the first call or [`Attention::prepare`] (whose warm-up dispatches take a
    /// few bytes), and after [`Attention::release_memory`].
    pub fn scratch_bytes(&self) -> u64 {
        self.scratch
            .as_ref()
            .map_or(0, |s| s.stats.size() + s.part.size())
    }

    /// Lets go of the memory this `Attention` keeps between calls to save time: the scratch buffers
    /// ([`Attention::scratch_bytes`]: after one long prefill, up to a storage binding each); the
    /// cached bind groups of queries and outputs, which keep the app's buffers alive (up to 32 MiB
    /// of each, however long ago they were used); and its rings of parameter and query-table
    /// uploads. The pipelines stay (they belong to the kernel registry). Calls recorded earlier
    /// still run: wgpu keeps what they use until they have. The next call allocates what it needs
    /// again, so call this after a call much larger than those to come, or before a long idle spell.
    /// In the browser a buffer's memory goes when its `GPUBuffer` object is garbage-collected
    /// (wgpu 30 does not destroy a dropped one, and kvgpu may not: a recorded call may still use
    /// it), so there the release makes the memory collectable rather than freeing it at once.
    pub fn release_memory(&mut self) {
        self.scratch = None;
        self.io_groups = GroupCache::new(GROUPS, PIN_BYTES);
        self.out_groups = GroupCache::new(GROUPS, PIN_BYTES);
        self.ring = ParamRing::new(&self.kernels);
        self.uploads = UploadRing::new(&self.device);
    }

    /// Picks the pass-1 kernel of later calls (see [`KernelChoice`]; the default is
    /// [`KernelChoice::Auto`]).
    pub fn set_kernel(&mut self, choice: KernelChoice) {
        self.facts.choice = choice;
    }

    /// The pass-1 kernel choice in force.
    pub fn kernel(&self) -> KernelChoice {
        self.facts.choice
    }

    /// How many workgroups pass 1 of later calls aims for, splitting the visible rows into chunks
    /// (each KV head, or team of KV heads, times each chunk is a workgroup), or `None` for the
    /// adapter's default: on GPUs 4,096 for values of up to 128 elements, proportionally fewer for
    /// longer values down to 1,024 (1,024 for the tiled kernel); on CPU adapters a few per host
    /// thread for teams of several KV heads or of several rows per iteration, else a fixed 32 for the
    /// streaming kernels and 16 for the tiled kernel. More chunks give a long context more
    /// parallelism and the reduce pass more partial results to merge. The rows are split into no
    /// more chunks than they make pieces of 16 rows (64 for a team of one invocation), the last
    /// piece counted even if shorter: 17 rows make two chunks of 9. No chunk gets more rows than
    /// the loop budget allows, and the chunks stay within the device's workgroup and binding limits,
    /// so any target plans a valid call (a target above 2^24 counts as 2^24).
    pub fn set_target_workgroups(&mut self, target: Option<NonZeroUsize>) {
        self.facts.target = target.map(NonZeroUsize::get);
    }

    /// The workgroup target in force ([`Attention::set_target_workgroups`]).
    pub fn target_workgroups(&self) -> Option<NonZeroUsize> {
        self.facts.target.and_then(NonZeroUsize::new)
    }

    /// Plans later calls as for a GPU even on a CPU adapter (`true`), or as the adapter says
    /// (`false`): the grid sizes, team widths and reduce workgroups a GPU gets, so that the tests can
    /// check those kernels against the CPU twins on the software adapters. Not for apps: a CPU
    /// adapter runs such plans slower.
    #[doc(hidden)]
    pub fn plan_as_for_a_gpu(&mut self, yes: bool) {
        self.facts.cpu = !yes && self.kernels.is_cpu();
    }

    /// Makes every streaming kernel that later calls and `prepare` ask for count as refused by the
    /// device (`true`), as a device refuses a generated kernel it cannot compile, so that the tests
    /// can check on software adapters (which compile every kernel) that [`KernelChoice::Auto`]
    /// falls back to the tiled kernel. Not for apps.
    #[doc(hidden)]
    pub fn refuse_streaming_kernels(&mut self, yes: bool) {
        self.refuse_streams = yes;
    }

    /// The pipeline of the streaming kernel `key`, or why the device refused it.
    fn stream_pipeline(
        &self,
        key: &StreamKey,
    ) -> std::result::Result<crate::kernels::Fetched, String> {
        if self.refuse_streams {
            return Err(format!(
                "the streaming attention kernel for {key:?} was refused (for a test)"
            ));
        }
        self.kernels.attention_stream(key)
    }

    /// Plans later calls as for a device without `wgpu::Features::SHADER_INT64` (`true`), or as the
    /// device says (`false`): a CPU adapter's kernels then load 32-bit words instead of 64-bit ones,
    /// so that the tests can check those kernels against the CPU twins on lavapipe too. Not for apps.
    #[doc(hidden)]
    pub fn plan_without_int64(&mut self, yes: bool) {
        self.facts.int64 = !yes && self.kernels.has_int64();
    }

    /// Plans later calls as for the Mesa `version` (`Some`), or as the adapter's driver information
    /// says (`None`), and returns the version planned for until then: lavapipe's GQA teams take
    /// one KV head each from Mesa 25.0 on where no slot is f32, and several before, so that the
    /// tests can check both kinds of kernel against the CPU twins on the one lavapipe a machine
    /// has. Not for apps.
    #[doc(hidden)]
    pub fn plan_as_for_mesa(&mut self, version: Option<(u32, u32)>) -> Option<(u32, u32)> {
        let was = self.facts.mesa;
        self.facts.mesa = version.or_else(|| self.kernels.mesa_version());
        was
    }

    /// Records GQA / MHA attention of `layer` (slots K `[n_kv_heads, d_k]` and V `[n_kv_heads, d_v]`)
    /// into `encoder` over the rows `kv` names: a cache's (`&cache`), a sequence of a paged pool
    /// ([`Kv::Sequence`]) or a ragged batch of a pool's sequences ([`Kv::Batch`], one dispatch pair).
    /// `q [n_q, n_heads, d_k]` are the queries of the layer's last `n_q` visible rows (in a batch, each
    /// sequence's in turn), `out [n_q, n_heads, d_v]` (f32; an [`Output`] view, or a buffer written
    /// row-major from byte 0) receives the result. Query `i` of `n_q` sees rows
    /// `[0, visible - n_q + i]` of its own sequence, limited by the window. Query head `h` reads KV
    /// head `h / (n_heads / n_kv_heads)`: the query heads of one KV head are consecutive.
    pub fn record_gqa<'a, 'k>(
        &mut self,
        encoder: &mut wgpu::CommandEncoder,
        kv: impl Into<Kv<'k>>,
        layer: usize,
        q: Queries<'a>,
        out: impl Into<Output<'a>>,
        options: &AttentionOptions,
    ) -> Result<()> {
        let (kv, mut table) = (kv.into(), Vec::new());
        let rows = Rows::of(kv, layer, q.shape[0], &self.facts, &mut table)?;
        self.record_gqa_rows(encoder, rows, layer, q, out, options)?;
        kv.hold_until_done(encoder);
        Ok(())
    }

    fn record_gqa_rows<'a>(
        &mut self,
        encoder: &mut wgpu::CommandEncoder,
        rows: Rows<'_>,
        layer: usize,
        q: Queries<'a>,
        out: impl Into<Output<'a>>,
        options: &AttentionOptions,
    ) -> Result<()> {
        let shapes = rows.store.ledger().slot_shapes(layer)?;
        let (n_kv, d_k, d_v) = match LayerShape::of(shapes) {
            Some(LayerShape {
                kind: AttentionKind::Gqa,
                n_kv,
                d_a,
                d_v,
                ..
            }) => (n_kv, d_a, d_v),
            _ => {
                return Err(Error::NotAttentionLayer {
                    layer,
                    kind: "GQA",
                    shapes: shapes.to_vec(),
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
            out: out.into(),
            n_kv,
            d_v,
            default_scale: 1.0 / (d_k as f32).sqrt(),
        };
        self.record(encoder, rows, job, options)
    }

    /// Records MLA absorbed attention of `layer` (slots `compressed_kv [r]` and `k_pe [p]`) into
    /// `encoder` over the rows `kv` names (as [`Attention::record_gqa`]):
    /// `out [n_q, n_heads, r] = softmax(scale · (q_latent·c_kv + q_rope·k_pe)) · c_kv` with
    /// `q_latent [n_q, n_heads, r]` and `q_rope [n_q, n_heads, p]`, causal as in
    /// [`Attention::record_gqa`]. Up to 16 heads share each read of a latent row.
    pub fn record_mla<'a, 'k>(
        &mut self,
        encoder: &mut wgpu::CommandEncoder,
        kv: impl Into<Kv<'k>>,
        layer: usize,
        q: MlaQueries<'a>,
        out: impl Into<Output<'a>>,
        options: &AttentionOptions,
    ) -> Result<()> {
        let (kv, mut table) = (kv.into(), Vec::new());
        let rows = Rows::of(kv, layer, q.latent.shape[0], &self.facts, &mut table)?;
        self.record_mla_rows(encoder, rows, layer, q, out, options)?;
        kv.hold_until_done(encoder);
        Ok(())
    }

    fn record_mla_rows<'a>(
        &mut self,
        encoder: &mut wgpu::CommandEncoder,
        rows: Rows<'_>,
        layer: usize,
        q: MlaQueries<'a>,
        out: impl Into<Output<'a>>,
        options: &AttentionOptions,
    ) -> Result<()> {
        let MlaQueries {
            latent: q_latent,
            rope: q_rope,
        } = q;
        let shapes = rows.store.ledger().slot_shapes(layer)?;
        let (r, p) = match LayerShape::of(shapes) {
            Some(LayerShape {
                kind: AttentionKind::Mla,
                d_a,
                d_b,
                ..
            }) => (d_a, d_b),
            _ => {
                return Err(Error::NotAttentionLayer {
                    layer,
                    kind: "MLA",
                    shapes: shapes.to_vec(),
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
            out: out.into(),
            n_kv: 1,
            d_v: r,
            // Summed as floats: r + p may pass usize on wasm32.
            default_scale: 1.0 / (r as f32 + p as f32).sqrt(),
        };
        self.record(encoder, rows, job, options)
    }

    /// [`Attention::record_gqa`] in its own submission.
    pub fn gqa<'a, 'k>(
        &mut self,
        kv: impl Into<Kv<'k>>,
        layer: usize,
        q: Queries<'a>,
        out: impl Into<Output<'a>>,
        options: &AttentionOptions,
    ) -> Result<()> {
        let kv = kv.into();
        self.submit(|a, e| a.record_gqa(e, kv, layer, q, out, options))
    }

    /// [`Attention::record_mla`] in its own submission.
    pub fn mla<'a, 'k>(
        &mut self,
        kv: impl Into<Kv<'k>>,
        layer: usize,
        q: MlaQueries<'a>,
        out: impl Into<Output<'a>>,
        options: &AttentionOptions,
    ) -> Result<()> {
        let kv = kv.into();
        self.submit(|a, e| a.record_mla(e, kv, layer, q, out, options))
    }

    /// Records a call into an encoder of its own and submits it.
    fn submit(
        &mut self,
        record: impl FnOnce(&mut Self, &mut wgpu::CommandEncoder) -> Result<()>,
    ) -> Result<()> {
        let mut encoder = self.encoder();
        record(self, &mut encoder)?;
        self.queue.submit([encoder.finish()]);
        Ok(())
    }

    fn encoder(&self) -> wgpu::CommandEncoder {
        self.device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                label: Some("kvgpu attention"),
            })
    }
}

/// The host's threads (a CPU adapter's parallelism): 4 where the platform does not say.
fn host_threads() -> usize {
    #[cfg(not(target_arch = "wasm32"))]
    if let Ok(n) = std::thread::available_parallelism() {
        return n.get();
    }
    4
}
