//! Reference kernels of the bench: the streaming-read roofline, the best plain copy kernel for the
//! fused-QKV conversion, and a device-to-device copy kernel. They set the bar kvgpu's kernels are
//! measured against on the same adapter.

use anyhow::Result;

use crate::timing::{Timer, interleaved, interleaved_all};

fn pipeline(device: &wgpu::Device, label: &str, source: &str) -> wgpu::ComputePipeline {
    let module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
        label: Some(label),
        source: wgpu::ShaderSource::Wgsl(source.into()),
    });
    device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
        label: Some(label),
        layout: None,
        module: &module,
        entry_point: Some("main"),
        compilation_options: Default::default(),
        cache: None,
    })
}

fn uniform(device: &wgpu::Device, bytes: &[u8]) -> wgpu::Buffer {
    let buf = device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("bench params"),
        size: bytes.len() as u64,
        usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: true,
    });
    buf.slice(..)
        .get_mapped_range_mut()
        .expect("a buffer mapped at creation")
        .copy_from_slice(bytes);
    buf.unmap();
    buf
}

pub fn storage(device: &wgpu::Device, size: u64, label: &str) -> wgpu::Buffer {
    device.create_buffer(&wgpu::BufferDescriptor {
        label: Some(label),
        size,
        usage: wgpu::BufferUsages::STORAGE
            | wgpu::BufferUsages::COPY_SRC
            | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    })
}

fn dispatch(
    enc: &mut wgpu::CommandEncoder,
    pipe: &wgpu::ComputePipeline,
    group: &wgpu::BindGroup,
    n: u32,
) {
    let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
        label: Some("bench reference"),
        timestamp_writes: None,
    });
    pass.set_pipeline(pipe);
    pass.set_bind_group(0, group, &[]);
    pass.dispatch_workgroups(n, 1, 1);
}

fn group(
    device: &wgpu::Device,
    pipe: &wgpu::ComputePipeline,
    buffers: [wgpu::BindingResource<'_>; 3],
) -> wgpu::BindGroup {
    let entries: Vec<wgpu::BindGroupEntry<'_>> = buffers
        .into_iter()
        .enumerate()
        .map(|(i, resource)| wgpu::BindGroupEntry {
            binding: i as u32,
            resource,
        })
        .collect();
    device.create_bind_group(&wgpu::BindGroupDescriptor {
        label: Some("bench reference"),
        layout: &pipe.get_bind_group_layout(0),
        entries: &entries,
    })
}

/// The streaming-read roofline over the first `bytes` of a buffer.
pub struct StreamRead {
    device: wgpu::Device,
    pipe: wgpu::ComputePipeline,
    /// Workgroups of [`ROW_LANES`] invocations, each streaming its own run of the buffer: in 32-bit
    /// words, and in 64-bit words where the device has 64-bit integers (as kvgpu's attention reads
    /// rows on a CPU adapter then), 16 and 32 bytes per load. With each, its 16-byte words per load.
    rows: Vec<(wgpu::ComputePipeline, u32)>,
    src: wgpu::Buffer,
    sink: wgpu::Buffer,
}

impl StreamRead {
    pub fn new(device: &wgpu::Device, queue: &wgpu::Queue, max_bytes: u64) -> Self {
        let src = storage(device, max_bytes.next_multiple_of(16), "bench stream src");
        // Non-zero contents, so the XOR is data dependent.
        let pattern: Vec<u32> = (0..(1u32 << 20))
            .map(|i| i.wrapping_mul(0x9e37_79b1))
            .collect();
        let chunk: &[u8] = bytemuck::cast_slice(&pattern);
        let mut off = 0;
        while off < src.size() {
            let n = (src.size() - off).min(chunk.len() as u64);
            queue.write_buffer(&src, off, &chunk[..n as usize]);
            off += n;
        }
        Self {
            device: device.clone(),
            pipe: pipeline(
                device,
                "bench stream_read",
                include_str!("../shaders/stream_read.wgsl"),
            ),
            rows: [RowLoad::U32x4, RowLoad::U64x2, RowLoad::U64x4]
                .into_iter()
                .filter(|&load| {
                    load == RowLoad::U32x4
                        || device.features().contains(wgpu::Features::SHADER_INT64)
                })
                .map(|load| {
                    let pipe = pipeline(device, "bench stream_read rows", &rows_source(load));
                    (pipe, load.per_load())
                })
                .collect(),
            src,
            sink: storage(device, 4 << 20, "bench sink"),
        }
    }

    /// The grid shapes that read `bytes` fastest (each timed alone after one warm-up, the median of
    /// three), to be timed again interleaved with the kernel they are the roofline of
    /// ([`Roof::interleaved_with`]).
    pub fn best(&self, timer: &Timer, bytes: u64) -> Result<Roof<'_>> {
        let (warm, reps) = (1, 3);
        let n_vec4 = (bytes / 16).max(1) as u32;
        let mut timed: Vec<(RoofRun<'_>, f64)> = Vec::new();
        // One 16-byte word per invocation, then 4, 16 and 64 per invocation (grid stride), and a few
        // fat workgroups that each stream whole rows (one or a few per core: what a CPU adapter
        // reads fastest), as long as an invocation stays within the software adapters' loop limit.
        let per_grids = [1u32, 4, 16, 64].map(|per| n_vec4.div_ceil(256 * per));
        let few = [2u32, 4, 8]
            .into_iter()
            .filter(|&g| n_vec4.div_ceil(g * 256) < 60_000);
        // (kernel, workgroups, its second parameter: the grid stride, or the words per workgroup)
        let mut runs: Vec<(&wgpu::ComputePipeline, u32, u32)> = per_grids
            .into_iter()
            .chain(few)
            .map(|groups| {
                let groups = groups.clamp(1, 65535);
                (&self.pipe, groups, groups * 256)
            })
            .collect();
        // A few workgroups of one SIMD vector each, every one on its own run of the buffer in
        // unrolled steps of 4 KiB, the lanes side by side: how the attention kernels read a row on
        // CPU adapters. On lavapipe this read about 1.6 times faster than every grid above, so without
        // it a kernel could report more than the roofline.
        let step = ROW_LANES * ROW_LOADS;
        for (rows, per_load) in &self.rows {
            // In the kernel's loads (whole ones: a 32-byte read of an odd count would read more).
            if !n_vec4.is_multiple_of(*per_load) {
                continue;
            }
            let n = n_vec4 / per_load;
            runs.extend([2u32, 4, 8, 16].into_iter().filter_map(|groups| {
                let per_group = n.div_ceil(groups).next_multiple_of(step);
                (per_group / step < 60_000).then_some((rows, groups, per_group))
            }));
        }
        for (pipe, groups, param) in runs {
            let params = uniform(&self.device, bytemuck::cast_slice(&[n_vec4, param, 0, 0]));
            let bind = group(
                &self.device,
                pipe,
                [
                    self.src.as_entire_binding(),
                    self.sink.as_entire_binding(),
                    params.as_entire_binding(),
                ],
            );
            let run = RoofRun { pipe, bind, groups };
            let [t] = interleaved(warm, reps, [&mut || run.time(timer)])?;
            timed.push((run, t));
        }
        timed.sort_by(|a, b| a.1.total_cmp(&b.1));
        let runs: Vec<RoofRun<'_>> = timed
            .into_iter()
            .take(ROOF_FINALISTS)
            .map(|(run, _)| run)
            .collect();
        anyhow::ensure!(!runs.is_empty(), "the roofline has no grid shape");
        Ok(Roof { runs })
    }
}

/// Grid shapes of the roofline timed beside the kernel: the calibration's fastest few, so that one
/// noisy calibration cannot set the roofline with a slow shape (on lavapipe a single pick once read
/// 4.5 GB/s where the same bytes read 8.3 in the run before, and a kernel came out at 1.03 of it).
const ROOF_FINALISTS: usize = 3;

/// The streaming-read roofline for one byte count: its fastest grid shapes, bound.
pub struct Roof<'a> {
    runs: Vec<RoofRun<'a>>,
}

impl Roof<'_> {
    /// Times `others` and each of the roofline's shapes interleaved, as
    /// [`interleaved`](crate::timing::interleaved) does; returns their medians and the roofline's:
    /// the fastest shape's median.
    pub fn interleaved_with<const N: usize>(
        &self,
        timer: &Timer,
        warm: usize,
        reps: usize,
        others: [&mut dyn FnMut() -> Result<f64>; N],
    ) -> Result<([f64; N], f64)> {
        let mut shapes: Vec<_> = self
            .runs
            .iter()
            .map(|run| move || run.time(timer))
            .collect();
        let mut runs: Vec<&mut dyn FnMut() -> Result<f64>> = others
            .into_iter()
            .map(|f| f as &mut dyn FnMut() -> Result<f64>)
            .collect();
        runs.extend(
            shapes
                .iter_mut()
                .map(|f| f as &mut dyn FnMut() -> Result<f64>),
        );
        let medians = interleaved_all(warm, reps, &mut runs)?;
        let roof = medians[N..].iter().copied().fold(f64::INFINITY, f64::min);
        Ok((std::array::from_fn(|i| medians[i]), roof))
    }
}

/// One grid shape of the streaming-read roofline, bound to its bytes.
pub struct RoofRun<'a> {
    pipe: &'a wgpu::ComputePipeline,
    bind: wgpu::BindGroup,
    groups: u32,
}

impl RoofRun<'_> {
    /// Seconds of one read.
    pub fn time(&self, timer: &Timer) -> Result<f64> {
        timer.gpu(|enc| dispatch(enc, self.pipe, &self.bind, self.groups))
    }
}

/// Invocations per workgroup of the whole-row read (one SIMD vector of llvmpipe and lavapipe).
const ROW_LANES: u32 = 8;
/// 16-byte loads per invocation in one step of the whole-row read.
const ROW_LOADS: u32 = 32;

/// How the whole-row read loads its words.
#[derive(Clone, Copy, PartialEq, Eq)]
enum RowLoad {
    /// 16 bytes as `vec4<u32>`.
    U32x4,
    /// 16 bytes as two 64-bit words, which a CPU adapter loads in half the steps.
    U64x2,
    /// 32 bytes as four 64-bit words (kvgpu's attention on a CPU adapter loads f32 and 16-bit rows
    /// so).
    U64x4,
}

impl RowLoad {
    /// 16-byte words per load.
    fn per_load(self) -> u32 {
        if self == RowLoad::U64x4 { 2 } else { 1 }
    }
}

/// The whole-row read: workgroup `g` XORs loads `g * per_group ..` (`load`'s words, `n_vec4 /
/// per_load` of them) in steps of `ROW_LANES * ROW_LOADS` loads (lane `l` takes loads `l, l +
/// ROW_LANES, ...` of a step), unrolled, then the loads past the last whole step one per lane. As
/// `shaders/stream_read.wgsl`, the result is stored only when it equals a value the data never
/// produces.
fn rows_source(load: RowLoad) -> String {
    let (ty, zero, fold) = match load {
        RowLoad::U32x4 => (
            "vec4<u32>",
            "vec4<u32>(0u)",
            "acc.x ^ acc.y ^ acc.z ^ acc.w",
        ),
        RowLoad::U64x2 => (
            "vec2<u64>",
            "vec2<u64>(0lu)",
            "u32(acc.x ^ acc.y) ^ u32((acc.x ^ acc.y) >> 32u)",
        ),
        RowLoad::U64x4 => (
            "vec4<u64>",
            "vec4<u64>(0lu)",
            "u32(acc.x ^ acc.y ^ acc.z ^ acc.w) ^ u32((acc.x ^ acc.y ^ acc.z ^ acc.w) >> 32u)",
        ),
    };
    let loads: Vec<String> = (0..ROW_LOADS)
        .map(|j| format!("src[b + {}u]", j * ROW_LANES))
        .collect();
    format!(
        "struct Params {{ n_vec4: u32, per_group: u32, _pad0: u32, _pad1: u32 }}
@group(0) @binding(0) var<storage, read> src: array<{ty}>;
@group(0) @binding(1) var<storage, read_write> sink: array<u32>;
@group(0) @binding(2) var<uniform> p: Params;

@compute @workgroup_size({ROW_LANES})
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lane: u32) {{
    let start = wg.x * p.per_group;
    let end = min(p.n_vec4 / {per_load}u, start + p.per_group);
    var acc = {zero};
    var i = start;
    for (; i + {step}u <= end; i += {step}u) {{
        let b = i + lane;
        acc ^= {};
    }}
    for (var j = i + lane; j < end; j += {ROW_LANES}u) {{
        acc ^= src[j];
    }}
    let x = {fold};
    if x == 0x9e3779b9u {{
        sink[(wg.x * {ROW_LANES}u + lane) % arrayLength(&sink)] = x;
    }}
}}
",
        loads.join(" ^ "),
        step = ROW_LANES * ROW_LOADS,
        per_load = load.per_load(),
    )
}

/// A reference kernel with its bindings: the fused-QKV conversions and the copy kernel.
pub struct BoundKernel {
    pipe: wgpu::ComputePipeline,
    bind: wgpu::BindGroup,
    groups: u32,
}

impl BoundKernel {
    /// The best plain kernel for K out of fused QKV f32 rows into packed f16 rows.
    /// `src` holds `n_rows` rows of `row_elems` f32; K is `kv_elems` floats at `offset` of each row.
    pub fn qkv_to_f16(
        device: &wgpu::Device,
        src: &wgpu::Buffer,
        dst: &wgpu::Buffer,
        n_rows: u32,
        row_elems: u32,
        offset: u32,
        kv_elems: u32,
    ) -> Self {
        // Sizes in 16-byte words; one invocation per 8 converted floats.
        Self::build(
            device,
            "bench qkv_to_f16",
            include_str!("../shaders/qkv_to_f16.wgsl"),
            [src, dst],
            n_rows,
            n_rows * kv_elems / 8,
            [kv_elems / 4, row_elems / 4, offset / 4],
        )
    }

    /// The same conversion with 4-byte loads and stores, one output word per invocation: the access
    /// pattern of kvgpu's slab-write kernel, for the profile.
    pub fn qkv_to_f16_scalar(
        device: &wgpu::Device,
        src: &wgpu::Buffer,
        dst: &wgpu::Buffer,
        n_rows: u32,
        row_elems: u32,
        offset: u32,
        kv_elems: u32,
    ) -> Self {
        Self::build(
            device,
            "bench qkv_to_f16_scalar",
            include_str!("../shaders/qkv_to_f16_scalar.wgsl"),
            [src, dst],
            n_rows,
            n_rows * kv_elems / 2,
            [kv_elems, row_elems, offset],
        )
    }

    /// One of the two kernels: `outputs` invocations' worth of work, `sizes` = (K width, row width,
    /// K offset) in the kernel's own units, as its `Params` struct takes them.
    fn build(
        device: &wgpu::Device,
        label: &str,
        source: &str,
        [src, dst]: [&wgpu::Buffer; 2],
        n_rows: u32,
        outputs: u32,
        [kv, row, offset]: [u32; 3],
    ) -> Self {
        let groups = outputs.div_ceil(256).clamp(1, 65535);
        let params = [n_rows, kv, row, offset, groups * 256, 0, 0, 0];
        let buffers = [src.as_entire_binding(), dst.as_entire_binding()];
        Self::bound(device, label, source, buffers, &params, groups)
    }

    /// A device-to-device copy of the first `bytes` (a multiple of 16) of `src` into `dst` by compute
    /// invocations (`copy_vec4.wgsl`), or `None` where the device cannot bind that many bytes.
    pub fn copy(
        device: &wgpu::Device,
        src: &wgpu::Buffer,
        dst: &wgpu::Buffer,
        bytes: u64,
    ) -> Option<Self> {
        let n_vec4 = u32::try_from(bytes / 16).ok()?;
        if bytes > device.limits().max_storage_buffer_binding_size
            || !bytes.is_multiple_of(16)
            || n_vec4 == 0
        {
            return None;
        }
        let groups = n_vec4.div_ceil(256).min(65535);
        let range = |buffer| {
            wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                buffer,
                offset: 0,
                size: std::num::NonZeroU64::new(bytes),
            })
        };
        let source = include_str!("../shaders/copy_vec4.wgsl");
        let params = [n_vec4, groups * 256, 0, 0];
        let buffers = [range(src), range(dst)];
        Some(Self::bound(
            device,
            "bench copy_vec4",
            source,
            buffers,
            &params,
            groups,
        ))
    }

    /// The kernel of `source` over `buffers` (bindings 0 and 1) and a uniform of `params` (binding
    /// 2), dispatched as `groups` workgroups.
    fn bound(
        device: &wgpu::Device,
        label: &str,
        source: &str,
        [src, dst]: [wgpu::BindingResource<'_>; 2],
        params: &[u32],
        groups: u32,
    ) -> Self {
        let pipe = pipeline(device, label, source);
        let params = uniform(device, bytemuck::cast_slice(params));
        let bind = group(device, &pipe, [src, dst, params.as_entire_binding()]);
        Self { pipe, bind, groups }
    }

    pub fn record(&self, enc: &mut wgpu::CommandEncoder) {
        dispatch(enc, &self.pipe, &self.bind, self.groups);
    }
}
