//! The kernel registry of one device: every compute pipeline of kvgpu (zeroing, slab writes, both
//! attention passes), their bind-group layouts, and the queue they submit parameters through. Caches
//! and attention share one registry per device; pipeline variants are compiled on first use.

mod groups;
mod params;
mod upload;

use std::collections::HashMap;
use std::fmt;
use std::hash::Hash;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use crate::attention::{RowMode, StreamKey};
use crate::codec::DType;
use crate::error::{Error, Result};

pub(crate) use groups::GroupCache;
pub(crate) use params::{
    AttnParams, MAX_SOURCE_RANK, PARAMS_BINDING, ParamRing, RING_ENTRIES, WriteParams, ZeroParams,
};
pub(crate) use upload::{Upload, UploadMark, UploadRing, check_staging};

pub(crate) mod wgsl {
    include!(concat!(env!("OUT_DIR"), "/shaders.rs"));
}

/// Bytes of one 16-byte vector (`vec4<u32>`): slot buffers and attention scratch are whole ones,
/// as the zeroing and streaming kernels load and store them.
pub(crate) const VECTOR_BYTES: u64 = 16;

/// The largest size of whole vectors within `limit`. Vulkan and DX12 report a binding limit of
/// 2<sup>31</sup> - 1 bytes, which no buffer of whole vectors may fill.
pub(crate) const fn whole_vectors_within(limit: u64) -> u64 {
    limit - limit % VECTOR_BYTES
}

/// The storage binding limit kvgpu plans with on a device ([`DeviceLimits::binding_bytes`]).
///
/// [`DeviceLimits::binding_bytes`]: crate::DeviceLimits::binding_bytes
pub(crate) fn binding_limit(limits: &wgpu::Limits) -> u64 {
    crate::DeviceLimits::from_wgpu(limits).binding_bytes()
}

/// Invocations per workgroup of the zeroing and slab-write kernels (`@workgroup_size(256)`).
pub(crate) const WORKGROUP_SIZE: u32 = 256;

/// Query heads one attention workgroup may serve (`HB` in `attention_partial.wgsl`): the largest that
/// divides the group is used, so a GQA group or the MLA heads of up to 16 read each KV row once.
pub(crate) const HEAD_BATCHES: [usize; 5] = [16, 8, 4, 2, 1];
/// Rows each attention invocation may score per tile (`RPL` in the shader).
pub(crate) const ROWS_PER_INVOCATION: [usize; 4] = [1, 2, 4, 8];

/// Workgroups for `threads` invocations, capped at the device's per-dimension limit, and the loop stride
/// (total invocations) the kernel must use to cover the rest.
///
/// The slab writes take the device's limit, at least 65,535 on every WebGPU and OpenGL device, so
/// an invocation of theirs strides at most 65 times over a binding of 2<sup>30</sup> words, and
/// runs at most about 3,000 loop iterations (four steps of a quantizing write, each two blocks of 32
/// elements loaded through a source of rank 8): within Mesa's limit of 65,535. Zeroing takes fewer
/// workgroups on CPU adapters and counts its own ([`crate::cache`]'s `zero_dispatches`).
pub(crate) fn grid(threads: u64, max_workgroups: u32) -> (u32, u32) {
    let groups = threads
        .div_ceil(WORKGROUP_SIZE as u64)
        .clamp(1, max_workgroups.max(1) as u64) as u32;
    (groups, groups * WORKGROUP_SIZE)
}

/// Invocations a slab-write dispatch of `params` needs: one per destination word (or 16-byte vector),
/// or, quantizing, one per pair of blocks (fp8: per word) of each row.
pub(crate) fn write_outputs(params: &WriteParams, dst: DType, vec4: bool) -> u64 {
    let rows = params.n_rows as u64;
    let words = rows * params.row_words as u64;
    if let Some(block) = dst.block() {
        rows * (params.row_elems as u64 / block as u64).div_ceil(2)
    } else if vec4 {
        words / 4
    } else {
        words
    }
}

/// A compute-visible storage binding of any size.
fn storage_entry(binding: u32, read_only: bool) -> wgpu::BindGroupLayoutEntry {
    wgpu::BindGroupLayoutEntry {
        binding,
        visibility: wgpu::ShaderStages::COMPUTE,
        ty: wgpu::BindingType::Buffer {
            ty: wgpu::BufferBindingType::Storage { read_only },
            has_dynamic_offset: false,
            min_binding_size: None,
        },
        count: None,
    }
}

/// A bind-group layout of storage bindings `0..`, read-only where `read_only[i]`.
fn storage_layout(device: &wgpu::Device, label: &str, read_only: &[bool]) -> wgpu::BindGroupLayout {
    let entries: Vec<_> = read_only
        .iter()
        .enumerate()
        .map(|(i, &ro)| storage_entry(i as u32, ro))
        .collect();
    device.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
        label: Some(label),
        entries: &entries,
    })
}

/// Invocations of a reduce workgroup (`attention_reduce.wgsl`): 64, and 8 (one SIMD vector) on CPU
/// adapters where an invocation's loops stay within the loop budget, each walking every chunk
/// (`main`); [`REDUCE_SPLIT_LANES`] on GPUs, splitting the chunks between them (`split`).
pub(crate) const REDUCE_LANES: [u32; 3] = [64, 8, REDUCE_SPLIT_LANES];

/// Invocations of the reduce that splits a head's chunks between them (`SPLIT` of
/// `attention_reduce.wgsl`'s `split`), the output elements one of its workgroups merges (4
/// `SPLIT_COLUMNS`), and the bytes of its workgroup memory: a (max, sum) pair and a vector of 4 f32
/// per invocation.
pub(crate) const REDUCE_SPLIT_LANES: u32 = 256;
pub(crate) const REDUCE_SPLIT_ELEMENTS: usize = 32;
pub(crate) const REDUCE_SPLIT_BYTES: u64 = REDUCE_SPLIT_LANES as u64 * (8 + 16);

/// One kernel: its shader module and pipeline layout; pipelines are made from them per variant.
#[derive(Debug)]
struct Kernel {
    label: &'static str,
    module: wgpu::ShaderModule,
    layout: wgpu::PipelineLayout,
}

impl Kernel {
    fn new(
        device: &wgpu::Device,
        label: &'static str,
        source: &str,
        groups: &[&wgpu::BindGroupLayout],
    ) -> Self {
        let module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
            label: Some(label),
            source: wgpu::ShaderSource::Wgsl(source.into()),
        });
        let groups: Vec<Option<&wgpu::BindGroupLayout>> = groups.iter().map(|g| Some(*g)).collect();
        let layout = device.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
            label: Some(label),
            bind_group_layouts: &groups,
            immediate_size: 0,
        });
        Self {
            label,
            module,
            layout,
        }
    }

    /// The pipeline of `entry` with these override constants.
    fn pipeline(
        &self,
        device: &wgpu::Device,
        entry: &str,
        constants: &[(&str, f64)],
    ) -> wgpu::ComputePipeline {
        device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some(self.label),
            layout: Some(&self.layout),
            module: &self.module,
            entry_point: Some(entry),
            compilation_options: wgpu::PipelineCompilationOptions {
                constants,
                // Every kernel writes its workgroup memory before reading it. The zeroing WebGPU
                // would add costs about 20 s per attention variant on OpenGL (Mesa compiles it into a
                // 2,048-element initialiser), and nothing here needs it; browsers always zero.
                zero_initialize_workgroup_memory: false,
            },
            cache: None,
        })
    }
}

/// A pipeline the registry handed out, and whether this call made it (not an earlier call, on this
/// thread or another).
#[derive(Debug)]
pub(crate) struct Fetched {
    pub(crate) pipeline: wgpu::ComputePipeline,
    pub(crate) made: bool,
}

/// Values made on first use, one per key: pipelines, or for generated kernels a pipeline or why the
/// device refused it (a refusal is kept too: the same source is refused again; one for want of
/// memory is forgotten, [`Pipelines::forget`]). The map's lock is
/// held only to find or add the key's cell, and the value is made outside it. GPU drivers compile
/// inside `create_compute_pipeline`, so threads that need different pipelines make them at the same
/// time, and threads that need the same one wait for the first to make it.
#[derive(Debug)]
struct Pipelines<K, V>(Mutex<HashMap<K, Arc<OnceLock<V>>>>);

impl<K: Eq + Hash, V: Clone> Pipelines<K, V> {
    fn new() -> Self {
        Self(Mutex::new(HashMap::new()))
    }

    /// The value of `key`, made by `make` when no call has made it before, and whether this call
    /// made it.
    fn get(&self, key: K, make: impl FnOnce() -> V) -> (V, bool) {
        let cell = Arc::clone(
            self.0
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .entry(key)
                .or_default(),
        );
        let mut made = false;
        let value = cell.get_or_init(|| {
            made = true;
            make()
        });
        (value.clone(), made)
    }

    /// Drops the value of `key`, so that the next call makes it again (callers waiting for it
    /// meanwhile get the value it had).
    fn forget(&self, key: &K) {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(key);
    }

    /// How many values have been made, for `held` ones.
    fn count(&self, held: impl Fn(&V) -> bool) -> usize {
        let map = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        map.values()
            .filter(|cell| cell.get().is_some_and(&held))
            .count()
    }
}

/// A tiled pass-1 pipeline: storage types of slots a, b and v, whether scores read slot b,
/// `HEAD_BATCHES` index, `ROWS_PER_INVOCATION` index, how rows are found.
type PartialKey = ([DType; 3], bool, usize, usize, RowMode);

/// The attention kernels, built when a device first runs attention.
#[derive(Debug)]
struct AttentionKernels {
    partial: Kernel,
    /// Tiled pass-1 pipelines.
    partial_pipelines: Pipelines<PartialKey, wgpu::ComputePipeline>,
    reduce: Kernel,
    /// The reduce pipeline of each workgroup size of [`REDUCE_LANES`], made on first use.
    reduce_pipelines: [OnceLock<wgpu::ComputePipeline>; 3],
    /// Generated streaming pass-1 pipelines by shape.
    stream_pipelines: Pipelines<StreamKey, std::result::Result<wgpu::ComputePipeline, String>>,
}

/// Bytes of the workgroup variables of `shaders/attention_partial.wgsl` (checked against the shader
/// by a unit test): the attention planner refuses the tiled kernel on a device with less
/// (`plan::DeviceFacts::workgroup_bytes`); the streaming kernels' are checked as each is made.
pub(crate) const TILED_WORKGROUP_BYTES: u64 = 10_440;

/// The device limits the cache's kernels need, and the least value of each: two bind groups (the
/// buffers, the parameters) of up to four bindings, four storage buffers in one stage (the
/// registry's attention layouts: slots a, b and v and a page table; a slab write binds three), a
/// dynamic uniform buffer for the parameters, workgroups of 256 x 1 x 1 invocations (zeroing and
/// slab writes), at least one workgroup per dispatch dimension, and a buffer of 256 KiB (the
/// parameter ring's 1,024 entries 256 bytes apart; a device whose uniform offsets align coarser
/// gets fewer per buffer). Slot and scratch sizes are checked per cache and per call, and what
/// attention needs more (eight storage buffers, three bind groups) per call. Devices made with
/// WebGPU's default limits, or wgpu's downlevel ones, have all of them; WebGL2's have no storage
/// buffers.
pub(crate) const NEEDED_LIMITS: [NeededLimit; 12] = [
    ("max_bind_groups", |l| l.max_bind_groups.into(), 2),
    (
        "max_bindings_per_bind_group",
        |l| l.max_bindings_per_bind_group.into(),
        4,
    ),
    (
        "max_storage_buffers_per_shader_stage",
        |l| l.max_storage_buffers_per_shader_stage.into(),
        4,
    ),
    (
        "max_uniform_buffers_per_shader_stage",
        |l| l.max_uniform_buffers_per_shader_stage.into(),
        1,
    ),
    (
        "max_dynamic_uniform_buffers_per_pipeline_layout",
        |l| l.max_dynamic_uniform_buffers_per_pipeline_layout.into(),
        1,
    ),
    (
        "max_uniform_buffer_binding_size",
        |l| l.max_uniform_buffer_binding_size,
        PARAMS_BINDING,
    ),
    (
        "max_compute_invocations_per_workgroup",
        |l| l.max_compute_invocations_per_workgroup.into(),
        WORKGROUP_SIZE as u64,
    ),
    (
        "max_compute_workgroup_size_x",
        |l| l.max_compute_workgroup_size_x.into(),
        WORKGROUP_SIZE as u64,
    ),
    (
        "max_compute_workgroup_size_y",
        |l| l.max_compute_workgroup_size_y.into(),
        1,
    ),
    (
        "max_compute_workgroup_size_z",
        |l| l.max_compute_workgroup_size_z.into(),
        1,
    ),
    (
        "max_compute_workgroups_per_dimension",
        |l| l.max_compute_workgroups_per_dimension.into(),
        1,
    ),
    (
        "max_buffer_size",
        |l| l.max_buffer_size,
        PARAMS_BINDING.next_multiple_of(256) * RING_ENTRIES,
    ),
];

/// One of [`NEEDED_LIMITS`]: its field of `wgpu::Limits`, how to read it, and the least needed.
pub(crate) type NeededLimit = (&'static str, fn(&wgpu::Limits) -> u64, u64);

/// Refuses limits below [`NEEDED_LIMITS`], naming the first one, and a largest buffer that holds
/// no parameter ring entry at the device's uniform offset alignment.
fn check_limits(limits: &wgpu::Limits) -> Result<()> {
    if let Some(&(name, got, least)) = NEEDED_LIMITS
        .iter()
        .find(|&&(_, got, least)| got(limits) < least)
    {
        return Err(Error::DeviceLimit {
            limit: name.to_string(),
            needed: least,
            got: got(limits),
        });
    }
    let entry = PARAMS_BINDING.next_multiple_of(limits.min_uniform_buffer_offset_alignment.into());
    if limits.max_buffer_size < entry {
        return Err(Error::DeviceLimit {
            limit: "max_buffer_size".into(),
            needed: entry,
            got: limits.max_buffer_size,
        });
    }
    Ok(())
}

/// The pipelines and layouts of one device, with the queue they go with. Make one with
/// [`Kernels::new`] and share it: [`crate::KvCache::with_kernels`], [`crate::Attention::for_cache`].
///
/// There is no process-wide registry keyed by device: wgpu compares devices by an id that is unique
/// only within one `wgpu::Instance`, so such a registry could hand one instance's pipelines to another.
pub struct Kernels {
    device: wgpu::Device,
    queue: wgpu::Queue,
    cpu: bool,
    params_layout: wgpu::BindGroupLayout,
    zero_layout: wgpu::BindGroupLayout,
    zero: wgpu::ComputePipeline,
    /// `shaders/zero_int64.wgsl`, on CPU adapters with 64-bit integers.
    zero_int64: Option<wgpu::ComputePipeline>,
    write_layout: wgpu::BindGroupLayout,
    write: Kernel,
    /// Slab-write pipelines by (source type, storage type, 16-byte entry point, scatter), built on
    /// first use.
    write_pipelines: Pipelines<(DType, DType, bool, bool), wgpu::ComputePipeline>,
    /// Attention group 0: the slots a, b and v of one layer, and a page table.
    attn_slots_layout: wgpu::BindGroupLayout,
    /// The page table a cache that is not paged binds (never read).
    no_pages: wgpu::Buffer,
    /// Attention group 1: q_a, q_b and the scratch (stats, partials).
    attn_io_layout: wgpu::BindGroupLayout,
    /// Reduce group 0: stats, partials, output.
    reduce_layout: wgpu::BindGroupLayout,
    attention: OnceLock<AttentionKernels>,
}

impl fmt::Debug for Kernels {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Kernels")
            .field("adapter", &self.device.adapter_info().name)
            .field("cpu_adapter", &self.cpu)
            .finish_non_exhaustive()
    }
}

impl Kernels {
    /// The registry of `device`, whose commands go through `queue` (its own queue: the pair that
    /// `request_device` returned; a queue of another device is refused with [`Error::QueueMismatch`]).
    /// Compiles the zeroing kernel now (and, on CPU adapters with `SHADER_INT64`, its 64-bit twin),
    /// every other pipeline on first use.
    /// A device whose limits are below what the kernels need is refused with
    /// [`Error::DeviceLimit`].
    pub fn new(device: &wgpu::Device, queue: &wgpu::Queue) -> Result<Arc<Kernels>> {
        check_limits(&device.limits())?;
        if !queue_belongs_to(device, queue) {
            return Err(Error::QueueMismatch);
        }
        let params_layout = device.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
            label: Some("kvgpu params"),
            entries: &[wgpu::BindGroupLayoutEntry {
                binding: 0,
                visibility: wgpu::ShaderStages::COMPUTE,
                ty: wgpu::BindingType::Buffer {
                    ty: wgpu::BufferBindingType::Uniform,
                    has_dynamic_offset: true,
                    min_binding_size: wgpu::BufferSize::new(PARAMS_BINDING),
                },
                count: None,
            }],
        });
        let zero_layout = storage_layout(device, "kvgpu zero", &[false]);
        let zero = Kernel::new(
            device,
            "kvgpu zero",
            wgsl::ZERO,
            &[&zero_layout, &params_layout],
        )
        .pipeline(device, "main", &[]);
        // A GPU stores 16 bytes in one instruction; a software adapter stores component by
        // component, lane by lane, and takes 32 bytes in 8-byte components faster.
        let cpu = device.adapter_info().device_type == wgpu::DeviceType::Cpu;
        let zero_int64 =
            (cpu && device.features().contains(wgpu::Features::SHADER_INT64)).then(|| {
                Kernel::new(
                    device,
                    "kvgpu zero int64",
                    wgsl::ZERO_INT64,
                    &[&zero_layout, &params_layout],
                )
                .pipeline(device, "main", &[])
            });
        let no_pages = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("kvgpu no page table"),
            size: 16,
            usage: wgpu::BufferUsages::STORAGE,
            mapped_at_creation: false,
        });
        made_alive(&no_pages, "the registry's empty page table")?;
        let write_layout = storage_layout(device, "kvgpu slab_write", &[true, false, true]);
        let write = Kernel::new(
            device,
            "kvgpu slab_write",
            wgsl::SLAB_WRITE,
            &[&write_layout, &params_layout],
        );
        Ok(Arc::new(Self {
            device: device.clone(),
            queue: queue.clone(),
            cpu,
            attn_slots_layout: storage_layout(device, "kvgpu attention slots", &[true; 4]),
            no_pages,
            attn_io_layout: storage_layout(
                device,
                "kvgpu attention io",
                &[true, true, false, false],
            ),
            reduce_layout: storage_layout(device, "kvgpu attention_reduce", &[true, true, false]),
            params_layout,
            zero_layout,
            zero,
            zero_int64,
            write_layout,
            write,
            write_pipelines: Pipelines::new(),
            attention: OnceLock::new(),
        }))
    }

    /// The device these pipelines belong to.
    pub fn device(&self) -> &wgpu::Device {
        &self.device
    }

    /// The queue that goes with the device.
    pub fn queue(&self) -> &wgpu::Queue {
        &self.queue
    }

    /// How many attention pipelines (pass 1 and reduce) this registry holds so far. Once
    /// [`crate::Attention::prepare`] has run for a model, its calls add none, so an app can check
    /// that the first token compiles nothing; but for calls with a logit soft-cap, which on CPU
    /// adapters with subgroups take a kernel of their own, and calls over a pool's page tables,
    /// which [`crate::Attention::prepare_paged`] builds.
    pub fn attention_pipelines(&self) -> usize {
        self.attention.get().map_or(0, |a| {
            a.partial_pipelines.count(|_| true)
                + a.stream_pipelines.count(Result::is_ok)
                + a.reduce_pipelines
                    .iter()
                    .filter(|p| p.get().is_some())
                    .count()
        })
    }

    /// Whether the adapter is a CPU (llvmpipe, lavapipe, WARP): few fat workgroups suit it best.
    pub(crate) fn is_cpu(&self) -> bool {
        self.cpu
    }

    pub(crate) fn params_layout(&self) -> &wgpu::BindGroupLayout {
        &self.params_layout
    }

    /// The zeroing kernel of 16-byte vectors, or with `int64` the one of 32-byte vectors where
    /// the device has it ([`Kernels::has_zero_int64`]).
    pub(crate) fn zero(&self, int64: bool) -> &wgpu::ComputePipeline {
        match (&self.zero_int64, int64) {
            (Some(wide), true) => wide,
            _ => &self.zero,
        }
    }

    /// Whether the device has the zeroing kernel of 32-byte vectors of 64-bit words, its fastest
    /// (CPU adapters with 64-bit integers).
    pub(crate) fn has_zero_int64(&self) -> bool {
        self.zero_int64.is_some()
    }

    pub(crate) fn zero_layout(&self) -> &wgpu::BindGroupLayout {
        &self.zero_layout
    }

    pub(crate) fn write_layout(&self) -> &wgpu::BindGroupLayout {
        &self.write_layout
    }

    /// The slab-write pipeline converting `src` elements to `dst` storage; `vec4` picks the entry point
    /// that moves whole 16-byte vectors, `scatter` the variant that finds destination rows in a map.
    pub(crate) fn write(
        &self,
        src: DType,
        dst: DType,
        vec4: bool,
        scatter: bool,
    ) -> wgpu::ComputePipeline {
        self.write_pipelines
            .get((src, dst, vec4, scatter), || {
                let constants = [
                    ("SRC_DTYPE", src.code() as f64),
                    ("DST_DTYPE", dst.code() as f64),
                    ("SCATTER", f64::from(u8::from(scatter))),
                ];
                // GPU sources are never quantized (host scatters move stored words as f32).
                let entry = if dst.is_quantized() {
                    "main_quant"
                } else if vec4 {
                    "main_vec4"
                } else {
                    "main"
                };
                self.write.pipeline(&self.device, entry, &constants)
            })
            .0
    }

    pub(crate) fn attn_slots_layout(&self) -> &wgpu::BindGroupLayout {
        &self.attn_slots_layout
    }

    /// The page table bound by caches that are not paged.
    pub(crate) fn no_pages(&self) -> &wgpu::Buffer {
        &self.no_pages
    }

    pub(crate) fn attn_io_layout(&self) -> &wgpu::BindGroupLayout {
        &self.attn_io_layout
    }

    pub(crate) fn reduce_layout(&self) -> &wgpu::BindGroupLayout {
        &self.reduce_layout
    }

    fn attention(&self) -> &AttentionKernels {
        self.attention.get_or_init(|| {
            let device = &self.device;
            let partial = Kernel::new(
                device,
                "kvgpu attention_partial",
                wgsl::ATTENTION_PARTIAL,
                &[
                    &self.attn_slots_layout,
                    &self.attn_io_layout,
                    &self.params_layout,
                ],
            );
            let reduce = Kernel::new(
                device,
                "kvgpu attention_reduce",
                wgsl::ATTENTION_REDUCE,
                &[&self.reduce_layout, &self.params_layout],
            );
            AttentionKernels {
                partial,
                partial_pipelines: Pipelines::new(),
                reduce,
                reduce_pipelines: Default::default(),
                stream_pipelines: Pipelines::new(),
            }
        })
    }

    /// The attention pass-1 pipeline reading slots a, b (where `slot_b`) and v stored as `dtypes`
    /// with `HEAD_BATCHES[batch]` heads per workgroup and `ROWS_PER_INVOCATION[rpl]` rows per
    /// invocation, finding rows as `rows` says, and whether this call made it.
    pub(crate) fn attention_partial(
        &self,
        dtypes: [DType; 3],
        slot_b: bool,
        batch: usize,
        rpl: usize,
        rows: RowMode,
    ) -> Fetched {
        let kernels = self.attention();
        let (pipeline, made) =
            kernels
                .partial_pipelines
                .get((dtypes, slot_b, batch, rpl, rows), || {
                    let constants = [
                        ("DTYPE_A", dtypes[0].code() as f64),
                        ("DTYPE_B", dtypes[1].code() as f64),
                        ("DTYPE_V", dtypes[2].code() as f64),
                        ("SLOT_B", f64::from(u8::from(slot_b))),
                        ("HB", HEAD_BATCHES[batch] as f64),
                        ("RPL", ROWS_PER_INVOCATION[rpl] as f64),
                        ("ROWS", f64::from(rows.code())),
                    ];
                    kernels.partial.pipeline(&self.device, "main", &constants)
                });
        Fetched { pipeline, made }
    }

    /// The generated streaming pass-1 pipeline of `key` (`src/attention/stream.rs`). Its source is
    /// made and compiled inside error scopes of every kind (a shader the backend or its driver fails
    /// to compile is an internal error, not a validation one), so natively a kernel the device
    /// refuses is reported here rather than as a wgpu error later (in the browser no scope is pushed,
    /// and the refusal is the device's uncaptured error: see [`scoped`]); or the pipeline, and whether
    /// this call made it.
    pub(crate) fn attention_stream(&self, key: &StreamKey) -> std::result::Result<Fetched, String> {
        let kernels = self.attention();
        let mut passing = false;
        let (result, made) = kernels.stream_pipelines.get(*key, || {
            let device = &self.device;
            let source = crate::attention::stream_source(key, wgsl::PRELUDE, wgsl::ROWS);
            let (pipeline, error) = scoped_all(device, || {
                Kernel::new(
                    device,
                    "kvgpu attention_stream",
                    &source,
                    &[
                        &self.attn_slots_layout,
                        &self.attn_io_layout,
                        &self.params_layout,
                    ],
                )
                .pipeline(device, "main", &[])
            });
            match error {
                Some((e, out_of_memory)) => {
                    passing = out_of_memory;
                    Err(format!(
                        "the streaming attention kernel for {key:?} was refused: {e}"
                    ))
                }
                None => Ok(pipeline),
            }
        });
        // A refusal for want of memory is not kept: the next call that needs the kernel tries again.
        if passing {
            kernels.stream_pipelines.forget(key);
        }
        result.map(|pipeline| Fetched { pipeline, made })
    }

    /// Whether the device has 64-bit integers in shaders (`wgpu::Features::SHADER_INT64`).
    pub(crate) fn has_int64(&self) -> bool {
        self.device
            .features()
            .contains(wgpu::Features::SHADER_INT64)
    }

    /// The size of every subgroup, when the device has subgroups (`wgpu::Features::SUBGROUP`) of one
    /// size between 4 and 64.
    pub(crate) fn subgroup_size(&self) -> Option<u32> {
        let info = self.device.adapter_info();
        let n = info.subgroup_min_size;
        (self.device.features().contains(wgpu::Features::SUBGROUP)
            && n == info.subgroup_max_size
            && n.is_power_of_two()
            && (4..=64).contains(&n))
        .then_some(n)
    }

    /// The version of Mesa whose driver the adapter is (llvmpipe's OpenGL, lavapipe), as its
    /// driver information names it; `None` for other drivers and where the platform does not say
    /// (a browser's WebGPU).
    pub(crate) fn mesa_version(&self) -> Option<(u32, u32)> {
        mesa_version_in(&self.device.adapter_info().driver_info)
    }

    /// The reduce pipeline with workgroups of `lanes` invocations (one of [`REDUCE_LANES`]).
    pub(crate) fn attention_reduce(&self, lanes: u32) -> &wgpu::ComputePipeline {
        let kernels = self.attention();
        let i = REDUCE_LANES.iter().position(|&l| l == lanes).unwrap_or(0);
        kernels.reduce_pipelines[i].get_or_init(|| match REDUCE_LANES[i] {
            REDUCE_SPLIT_LANES => kernels.reduce.pipeline(&self.device, "split", &[]),
            lanes => kernels
                .reduce
                .pipeline(&self.device, "main", &[("LANES", f64::from(lanes))]),
        })
    }
}

/// Whether `queue` is `device`'s own queue. wgpu offers no way to ask, and a command of one device on the
/// queue of another is a validation error of the queue's device, which no error scope of `device` can
/// catch. So: a work-done callback registered on the queue runs when its own device is polled, and
/// polling `device` until idle runs it only if the queue is `device`'s.
#[cfg(not(target_arch = "wasm32"))]
pub(crate) fn queue_belongs_to(device: &wgpu::Device, queue: &wgpu::Queue) -> bool {
    use std::sync::atomic::{AtomicBool, Ordering};
    let done = Arc::new(AtomicBool::new(false));
    let flag = done.clone();
    queue.on_submitted_work_done(move || flag.store(true, Ordering::Release));
    // Another thread polling the same device may have taken the callback and not yet run it when our
    // poll returns: look again, at least 50 times and for a second after the first poll returned,
    // before refusing (only a mismatched pair waits it out; a loaded machine can keep that thread
    // off a core for longer than the 0.2 s of 50 looks). A poll that fails (a lost device) leaves
    // the flag unset: the pair is refused.
    let mut since = None;
    for attempt in 0u64.. {
        let _ = device.poll(wgpu::PollType::wait_indefinitely());
        if done.load(Ordering::Acquire) {
            return true;
        }
        let first = *since.get_or_insert_with(std::time::Instant::now);
        if attempt >= 50 && first.elapsed() > std::time::Duration::from_secs(1) {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(attempt.min(4)));
    }
    false
}

/// In the browser WebGPU answers directly: `GPUDevice.queue` is the device's one queue, the same
/// object on every read, so the pair belongs together when it is that object. A device without a
/// WebGPU handle (wgpu's WebGL backend) is taken as given.
#[cfg(target_arch = "wasm32")]
pub(crate) fn queue_belongs_to(device: &wgpu::Device, queue: &wgpu::Queue) -> bool {
    match (device.as_webgpu(), queue.as_webgpu()) {
        (Some(device), Some(queue)) => device.queue() == *queue,
        _ => true,
    }
}

/// What keeps an app's buffer from the device, as far as wgpu tells ([`held`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Held {
    /// Nothing seen: the device may use it.
    No,
    /// Mapped for the host, whole or in part (in the browser also while a mapping is pending).
    Mapped,
    /// Destroyed by the app.
    Destroyed,
    /// Invalid: its creation failed (a validation error of `create_buffer`). Natively only; the
    /// browser reports one at submit.
    Invalid,
}

/// Whether `buffer` is mapped for the host (whole or in part), destroyed or invalid.
///
/// In the browser WebGPU tells: a buffer whose `mapState` is not `"unmapped"` is mapped or being
/// mapped. It has no word for a destroyed buffer, which WebGPU then reports at submit.
///
/// Natively wgpu 30 has no `map_state`: a read view of the whole buffer is asked for. wgpu grants it
/// while the whole is mapped, and refuses it as "not mapped" for a buffer that is not (or whose
/// mapping is still pending, which is not seen), as destroyed for a destroyed buffer, as invalid for
/// a buffer whose creation failed, and otherwise for a mapping: out of bounds while only a part is
/// mapped, or for Rust's aliasing rules while a mutable view is open. Any refusal but the first
/// three counts as mapped. The hostile tests pin the wording on both native backends.
pub(crate) fn held(buffer: &wgpu::Buffer) -> Held {
    #[cfg(target_arch = "wasm32")]
    if let Some(web) = buffer.as_webgpu() {
        // Read as a property, not through a view: a view of the whole of a buffer mapped in part
        // throws inside wgpu's WebGPU backend.
        let state = js_sys::Reflect::get(web, &wasm_bindgen::JsValue::from_str("mapState"))
            .ok()
            .and_then(|s| s.as_string());
        return match state.as_deref() {
            Some("pending" | "mapped") => Held::Mapped,
            _ => Held::No,
        };
    }
    let whole = buffer.size() & !3;
    if whole == 0 {
        return Held::No;
    }
    match buffer.get_mapped_range(..whole) {
        Ok(_) => Held::Mapped,
        Err(e) => {
            // Judged by how the message ends: wgpu quotes the buffer's label inside it.
            let e = e.to_string();
            let e = e.trim_end();
            if e.ends_with(" is invalid") {
                Held::Invalid
            } else if e.ends_with(" has been destroyed") {
                Held::Destroyed
            } else if e.ends_with("Buffer is not mapped") {
                Held::No
            } else {
                Held::Mapped
            }
        }
    }
}

/// Whether a mapping of `buffer`, a buffer of `device` that is valid, not destroyed and not mapped
/// as far as [`held`] tells, is pending, natively: a submission of such a buffer is a validation
/// error, which without an app's handler panics inside wgpu, and wgpu 30 has no `map_state` to ask.
/// It tells through `map_async`, which refuses a buffer with a mapping mapped or pending at once,
/// before wgpu-core sees the request. Otherwise wgpu-core refuses the request asked here, of one
/// byte, for its size, before it looks at the buffer's state: nothing is mapped, nothing is queued,
/// and the unmap that clears wgpu's record of the request is refused too, both inside a
/// validation scope of `device` (hence a buffer of `device` only: another device's errors go to
/// that device). Only buffers the host may map are asked, in a mode their usage allows: no other
/// can have a mapping. In the browser WebGPU's `mapState` has told [`held`] already. wgpu keeps its
/// record of an app's `map_async` that wgpu-core refused until the app unmaps, so such a buffer
/// counts as mapped too; and an app asking for a mapping of the buffer on another thread at the
/// moment kvgpu asks may be refused.
pub(crate) fn map_pending(device: &wgpu::Device, buffer: &wgpu::Buffer) -> bool {
    if cfg!(target_arch = "wasm32") || buffer.size() == 0 {
        return false;
    }
    let usage = buffer.usage();
    let mode = if usage.contains(wgpu::BufferUsages::MAP_READ) {
        wgpu::MapMode::Read
    } else if usage.contains(wgpu::BufferUsages::MAP_WRITE) {
        wgpu::MapMode::Write
    } else {
        return false;
    };
    let (_, reached) = scoped(device, || buffer.slice(0..1).map_async(mode, |_| {}));
    if reached.is_none() {
        return true;
    }
    let _ = scoped(device, || buffer.unmap());
    false
}

/// Runs `f` inside a validation error scope of `device` and returns what it made, with the error wgpu
/// reported during it, if any. Native wgpu resolves the scope at once. In the browser a scope resolves
/// only in a later task, and a scope dropped unanswered would swallow the error: there no scope is
/// pushed, nothing is reported here, and a refused object surfaces as the device's uncaptured error.
pub(crate) fn scoped<T>(device: &wgpu::Device, f: impl FnOnce() -> T) -> (T, Option<String>) {
    scoped_to(device, wgpu::ErrorFilter::Validation, f)
}

/// [`scoped`] for errors of every kind (validation, internal, out of memory), in nested scopes: the
/// first one reported, if any, and whether it was the device running out of memory (which may pass).
fn scoped_all<T>(device: &wgpu::Device, f: impl FnOnce() -> T) -> (T, Option<(String, bool)>) {
    let (((made, memory), internal), validation) =
        scoped_to(device, wgpu::ErrorFilter::Validation, || {
            scoped_to(device, wgpu::ErrorFilter::Internal, || {
                scoped_to(device, wgpu::ErrorFilter::OutOfMemory, f)
            })
        });
    let error = validation
        .or(internal)
        .map(|e| (e, false))
        .or(memory.map(|e| (e, true)));
    (made, error)
}

/// [`scoped`] for the errors `filter` selects.
fn scoped_to<T>(
    device: &wgpu::Device,
    filter: wgpu::ErrorFilter,
    f: impl FnOnce() -> T,
) -> (T, Option<String>) {
    if cfg!(target_arch = "wasm32") {
        return (f(), None);
    }
    let scope = device.push_error_scope(filter);
    let made = f();
    let error = poll_now(scope.pop()).flatten().map(|e| e.to_string());
    (made, error)
}

/// Runs `f`, which creates `bytes` bytes of buffers for `what`, inside an out-of-memory error scope:
/// [`Error::OutOfMemory`] where the device could not allocate them (the buffers `f` made are then
/// dropped, before anything uses them). In the browser no scope is pushed ([`scoped`]), so WebGPU
/// reports a refused allocation itself (the device's uncaptured error).
///
/// Natively the buffers made are also checked for a lost device ([`made_alive`]):
/// [`Error::DeviceLost`].
pub(crate) fn allocated<T: Made>(
    device: &wgpu::Device,
    what: &str,
    bytes: u64,
    f: impl FnOnce() -> T,
) -> crate::Result<T> {
    match scoped_to(device, wgpu::ErrorFilter::OutOfMemory, f) {
        (made, None) => {
            made_alive(&made, what)?;
            Ok(made)
        }
        (_, Some(reason)) => Err(Error::OutOfMemory {
            what: what.to_string(),
            bytes,
            reason,
        }),
    }
}

/// What kvgpu makes under [`allocated`]: the buffers in it.
pub(crate) trait Made {
    /// Calls `f` with each buffer.
    fn each(&self, f: &mut dyn FnMut(&wgpu::Buffer));
}

impl Made for wgpu::Buffer {
    fn each(&self, f: &mut dyn FnMut(&wgpu::Buffer)) {
        f(self)
    }
}

impl Made for () {
    fn each(&self, _: &mut dyn FnMut(&wgpu::Buffer)) {}
}

impl<T: Made> Made for Option<T> {
    fn each(&self, f: &mut dyn FnMut(&wgpu::Buffer)) {
        if let Some(made) = self {
            made.each(f)
        }
    }
}

impl<T: Made> Made for Vec<T> {
    fn each(&self, f: &mut dyn FnMut(&wgpu::Buffer)) {
        for made in self {
            made.each(f)
        }
    }
}

/// A buffer with two numbers about it (a snapshot's staging: row bytes, used bytes).
impl<T: Made> Made for (T, usize, usize) {
    fn each(&self, f: &mut dyn FnMut(&wgpu::Buffer)) {
        self.0.each(f)
    }
}

/// Natively, [`Error::DeviceLost`] where a buffer kvgpu just made for `what` is invalid though no
/// error scope saw its creation fail: the device is lost. wgpu 30 reports no error for what a lost device
/// fails to make, and hands out an invalid buffer whose first use (a write, a mapping, a binding) is
/// a validation error, which without an app's handler panics. A buffer made before the loss is
/// valid; the writes into it and its mappings fail quietly, and a readback through it is refused. In
/// the browser a lost device fails everything quietly, so nothing is checked.
pub(crate) fn made_alive(made: &impl Made, what: &str) -> crate::Result<()> {
    if cfg!(target_arch = "wasm32") {
        return Ok(());
    }
    let mut invalid = false;
    made.each(&mut |b| invalid |= held(b) == Held::Invalid);
    match invalid {
        true => Err(Error::DeviceLost {
            what: what.to_string(),
        }),
        false => Ok(()),
    }
}

/// Polls a future once.
fn poll_now<F: std::future::Future>(future: F) -> Option<F::Output> {
    let mut future = std::pin::pin!(future);
    match future
        .as_mut()
        .poll(&mut std::task::Context::from_waker(std::task::Waker::noop()))
    {
        std::task::Poll::Ready(v) => Some(v),
        std::task::Poll::Pending => None,
    }
}

/// Mesa's major and minor version in an adapter's driver information: `Mesa 25.0.7-2~bpo12+1
/// (LLVM 15.0.6)` from lavapipe, `4.5 (Core Profile) Mesa 22.3.6` from llvmpipe's OpenGL.
fn mesa_version_in(info: &str) -> Option<(u32, u32)> {
    let (_, rest) = info.split_once("Mesa ")?;
    let mut parts = rest.split(|c: char| !c.is_ascii_digit());
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next()?.parse().ok()?;
    Some((major, minor))
}

#[cfg(test)]
mod tests {
    use super::wgsl::WGSL_LAYOUTS;
    use super::*;

    /// Mesa's version as lavapipe and llvmpipe's OpenGL write it, and nothing from other drivers.
    #[test]
    fn mesa_versions_are_read_from_the_driver_information() {
        for (info, want) in [
            ("Mesa 25.0.7-2~bpo12+1 (LLVM 15.0.6)", Some((25, 0))),
            ("Mesa 22.3.6 (LLVM 15.0.6)", Some((22, 3))),
            ("4.5 (Core Profile) Mesa 22.3.6", Some((22, 3))),
            ("Mesa 24.10", Some((24, 10))),
            ("Mesa 25", None),
            ("Mesa DRI Intel(R) Graphics", None),
            ("570.86.16", None),
            ("", None),
        ] {
            assert_eq!(mesa_version_in(info), want, "{info:?}");
        }
    }

    /// A value is made once per key and shared; a forgotten one (a refusal for want of memory) is
    /// made again by the next call; `count` counts the values made that pass its test.
    #[test]
    fn pipelines_are_made_once_until_forgotten() {
        let p: Pipelines<u32, std::result::Result<u32, String>> = Pipelines::new();
        let mut makes = 0;
        let mut make = |v: std::result::Result<u32, String>| {
            makes += 1;
            v
        };
        assert_eq!(p.get(1, || make(Ok(10))), (Ok(10), true));
        assert_eq!(p.get(1, || make(Ok(11))), (Ok(10), false));
        assert!(p.get(2, || make(Err("refused".into()))).1);
        assert_eq!(p.count(|v| v.is_ok()), 1);
        assert_eq!(p.get(2, || make(Ok(20))), (Err("refused".into()), false));
        p.forget(&2);
        assert_eq!(p.get(2, || make(Ok(20))), (Ok(20), true));
        assert_eq!((p.count(|v| v.is_ok()), makes), (2, 3));
    }

    /// The registry's maps make values outside their lock: two threads making values of different
    /// keys are inside `make` at the same time (each waits there for the other, which a map holding
    /// its lock while making would never let happen), and threads wanting one key get the one value
    /// made once, by one of them.
    #[cfg(not(target_arch = "wasm32"))]
    #[test]
    fn pipelines_of_different_keys_are_made_at_once_and_each_once() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        use std::sync::mpsc;
        use std::time::Duration;
        let map: Pipelines<u32, u32> = Pipelines::new();
        let made = AtomicUsize::new(0);
        let (to_b, from_a) = mpsc::channel();
        let (to_a, from_b) = mpsc::channel();
        let meet = |tell: mpsc::Sender<()>, hear: mpsc::Receiver<()>| {
            move || {
                tell.send(()).unwrap();
                hear.recv_timeout(Duration::from_secs(20))
                    .expect("the other key's value was not being made at the same time");
            }
        };
        let (a, b) = (meet(to_b, from_b), meet(to_a, from_a));
        let map = &map;
        std::thread::scope(|s| {
            let one = s.spawn(move || {
                map.get(1, || {
                    a();
                    10
                })
            });
            let two = s.spawn(move || {
                map.get(2, || {
                    b();
                    20
                })
            });
            assert_eq!(one.join().unwrap(), (10, true));
            assert_eq!(two.join().unwrap(), (20, true));
        });
        let start = std::sync::Barrier::new(8);
        let got: Vec<(u32, bool)> = std::thread::scope(|s| {
            let threads: Vec<_> = (0..8)
                .map(|_| {
                    s.spawn(|| {
                        start.wait();
                        map.get(3, || {
                            made.fetch_add(1, Ordering::Relaxed);
                            std::thread::sleep(Duration::from_millis(50));
                            30
                        })
                    })
                })
                .collect();
            threads.into_iter().map(|t| t.join().unwrap()).collect()
        });
        assert_eq!(made.load(Ordering::Relaxed), 1);
        assert!(got.iter().all(|&(v, _)| v == 30), "{got:?}");
        assert_eq!(got.iter().filter(|&&(_, m)| m).count(), 1, "{got:?}");
        assert_eq!(map.get(1, || 0), (10, false));
    }

    /// The tiled kernel's and the split reduce's workgroup variables take the bytes the planner
    /// asks a device for (naga is a native dev-dependency; the reduce's `main` has none).
    #[cfg(not(target_arch = "wasm32"))]
    #[test]
    fn kernels_use_the_workgroup_memory_a_device_is_asked_for() {
        let bytes = |source: &str| {
            let module = naga::front::wgsl::parse_str(source).unwrap();
            let mut layouter = naga::proc::Layouter::default();
            layouter.update(module.to_ctx()).unwrap();
            let bytes: u32 = module
                .global_variables
                .iter()
                .filter(|(_, v)| v.space == naga::AddressSpace::WorkGroup)
                .map(|(_, v)| layouter[v.ty].size)
                .sum();
            u64::from(bytes)
        };
        assert_eq!(bytes(wgsl::ATTENTION_PARTIAL), TILED_WORKGROUP_BYTES);
        assert_eq!(bytes(wgsl::ATTENTION_REDUCE), REDUCE_SPLIT_BYTES);
    }

    /// A device below any of the cache's needed limits is refused, naming that limit; WebGPU's
    /// defaults and wgpu's downlevel ones pass.
    #[test]
    fn devices_below_the_needed_limits_are_refused() {
        check_limits(&wgpu::Limits::default()).unwrap();
        check_limits(&wgpu::Limits::downlevel_defaults()).unwrap();
        assert_eq!(
            check_limits(&wgpu::Limits::downlevel_webgl2_defaults()),
            Err(Error::DeviceLimit {
                limit: "max_storage_buffers_per_shader_stage".into(),
                needed: 4,
                got: 0,
            })
        );
        for (name, _, least) in NEEDED_LIMITS {
            let mut limits = wgpu::Limits::default();
            let low = least - 1;
            match name {
                "max_bind_groups" => limits.max_bind_groups = low as u32,
                "max_bindings_per_bind_group" => limits.max_bindings_per_bind_group = low as u32,
                "max_storage_buffers_per_shader_stage" => {
                    limits.max_storage_buffers_per_shader_stage = low as u32
                }
                "max_uniform_buffers_per_shader_stage" => {
                    limits.max_uniform_buffers_per_shader_stage = low as u32
                }
                "max_dynamic_uniform_buffers_per_pipeline_layout" => {
                    limits.max_dynamic_uniform_buffers_per_pipeline_layout = low as u32
                }
                "max_uniform_buffer_binding_size" => limits.max_uniform_buffer_binding_size = low,
                "max_compute_invocations_per_workgroup" => {
                    limits.max_compute_invocations_per_workgroup = low as u32
                }
                "max_compute_workgroup_size_x" => limits.max_compute_workgroup_size_x = low as u32,
                "max_compute_workgroup_size_y" => limits.max_compute_workgroup_size_y = low as u32,
                "max_compute_workgroup_size_z" => limits.max_compute_workgroup_size_z = low as u32,
                "max_compute_workgroups_per_dimension" => {
                    limits.max_compute_workgroups_per_dimension = low as u32
                }
                "max_buffer_size" => limits.max_buffer_size = low,
                other => panic!("no such limit: {other}"),
            }
            assert_eq!(
                check_limits(&limits),
                Err(Error::DeviceLimit {
                    limit: name.into(),
                    needed: least,
                    got: low,
                }),
                "{name}"
            );
        }
        // Uniform offsets aligned coarser than 256 bytes: the parameter ring takes fewer entries
        // per buffer, down to one, and a largest buffer smaller than one entry is refused.
        let aligned = |align: u32| wgpu::Limits {
            min_uniform_buffer_offset_alignment: align,
            max_buffer_size: 256 << 10,
            ..wgpu::Limits::default()
        };
        check_limits(&aligned(512)).unwrap();
        check_limits(&aligned(256 << 10)).unwrap();
        assert_eq!(
            check_limits(&aligned(512 << 10)),
            Err(Error::DeviceLimit {
                limit: "max_buffer_size".into(),
                needed: 512 << 10,
                got: 256 << 10,
            })
        );
    }

    /// kvgpu's binding limit is the device's, within its largest buffer and 32-bit addressing.
    #[test]
    fn the_binding_limit_is_within_the_largest_buffer() {
        let limits = |binding: u64, buffer: u64| wgpu::Limits {
            max_storage_buffer_binding_size: binding,
            max_buffer_size: buffer,
            ..wgpu::Limits::default()
        };
        assert_eq!(binding_limit(&limits(128 << 20, 256 << 20)), 128 << 20);
        assert_eq!(binding_limit(&limits(1 << 30, 256 << 20)), 256 << 20);
        assert_eq!(binding_limit(&limits(1 << 40, 1 << 40)), u32::MAX as u64);
    }

    /// `(member, offset)` of every copy of WGSL struct `name`, after checking each copy's size.
    fn layout_of(name: &str, size: usize) -> Vec<(&'static str, u32)> {
        let rows: Vec<_> = WGSL_LAYOUTS.iter().filter(|r| r.0 == name).collect();
        assert!(!rows.is_empty(), "no WGSL struct {name}");
        assert!(rows.iter().all(|r| r.3 as usize == size), "{name} size");
        rows.iter().map(|r| (r.1, r.2)).collect()
    }

    #[test]
    fn host_params_match_the_wgsl_structs() {
        let zero = ZeroParams::default();
        let base = &zero as *const _ as usize;
        let at = |a: *const u32| (a as usize - base) as u32;
        assert_eq!(
            layout_of("ZeroParams", size_of::<ZeroParams>()),
            vec![
                ("start_word", at(&zero.start_word)),
                ("n_words", at(&zero.n_words)),
                ("thread_stride", at(&zero.thread_stride)),
                ("_pad", at(&zero._pad)),
            ]
        );
        let p = WriteParams::default();
        let base = &p as *const _ as usize;
        let at = |a: *const u32| (a as usize - base) as u32;
        assert_eq!(
            layout_of("WriteParams", size_of::<WriteParams>()),
            vec![
                ("src_offset", at(&p.src_offset)),
                ("seq_stride", at(&p.seq_stride)),
                ("n_rows", at(&p.n_rows)),
                ("row_elems", at(&p.row_elems)),
                ("row_words", at(&p.row_words)),
                ("dst_word_offset", at(&p.dst_word_offset)),
                ("rank", at(&p.rank)),
                ("thread_stride", at(&p.thread_stride)),
                ("map_word", at(&p.map_word)),
                ("inv_scale", at(&p.inv_scale)),
                ("_pad1", at(&p._pad[0])),
                ("_pad2", at(&p._pad[1])),
                ("shape", at(p.shape.as_ptr())),
                ("stride", at(p.stride.as_ptr())),
            ]
        );
        let a = AttnParams::default();
        let base = &a as *const _ as usize;
        let at = |x: *const u32| (x as usize - base) as u32;
        let host = vec![
            ("n_q", at(&a.n_q)),
            ("n_heads", at(&a.n_heads)),
            ("group", at(&a.group)),
            ("n_batches", at(&a.n_batches)),
            ("d_a", at(&a.d_a)),
            ("d_b", at(&a.d_b)),
            ("d_v", at(&a.d_v)),
            ("visible", at(&a.visible)),
            ("row_words_a", at(&a.row_words_a)),
            ("row_words_b", at(&a.row_words_b)),
            ("row_words_v", at(&a.row_words_v)),
            ("window", at(&a.window)),
            ("lo", at(&a.lo)),
            ("chunk_len", at(&a.chunk_len)),
            ("n_chunks", at(&a.n_chunks)),
            ("n_kv", at(&a.n_kv)),
            ("scale", at(&a.scale as *const f32 as *const u32)),
            ("soft_cap", at(&a.soft_cap as *const f32 as *const u32)),
            ("q_first", at(&a.q_first)),
            ("q_count", at(&a.q_count)),
            ("page_size", at(&a.page_size)),
            ("table_base", at(&a.table_base)),
            ("n_pages", at(&a.n_pages)),
            ("team_width", at(&a.team_width)),
            ("view_a", at(a.view_a.as_ptr())),
            ("view_b", at(a.view_b.as_ptr())),
            ("view_out", at(a.view_out.as_ptr())),
            ("slot_scales", at(a.slot_scales.as_ptr() as *const u32)),
            ("direct", at(&a.direct)),
        ];
        assert_eq!(layout_of("AttnParams", size_of::<AttnParams>()), host);
    }

    #[test]
    fn grid_caps_workgroups_and_strides_over_the_rest() {
        assert_eq!(grid(1, 65535), (1, 256));
        assert_eq!(grid(257, 65535), (2, 512));
        assert_eq!(grid(0, 65535), (1, 256));
        assert_eq!(grid(1 << 30, 65535), (65535, 65535 * 256));
    }
}
