//! Compute pipelines of kvgpu, compiled once per device and shared by every cache on it, plus the
//! ring of kernel parameters that lets many dispatches be recorded into one encoder.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use crate::spec::DType;

pub(crate) mod wgsl {
    include!(concat!(env!("OUT_DIR"), "/shaders.rs"));
}

#[cfg(test)]
use wgsl::WGSL_LAYOUTS;

/// Invocations per workgroup of every kernel (`@workgroup_size(256)` in the shaders).
pub(crate) const WORKGROUP_SIZE: u32 = 256;

/// Parameters of `shaders/zero.wgsl`; must match its `ZeroParams`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub(crate) struct ZeroParams {
    pub start_word: u32,
    pub n_words: u32,
    pub thread_stride: u32,
    pub _pad: u32,
}

/// Parameters of `shaders/slab_write.wgsl`; must match its `WriteParams`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub(crate) struct WriteParams {
    pub src_offset: u32,
    pub seq_stride: u32,
    pub n_rows: u32,
    pub row_elems: u32,
    pub row_words: u32,
    pub dst_word_offset: u32,
    pub rank: u32,
    pub thread_stride: u32,
    pub shape: [u32; 8],
    pub stride: [u32; 8],
}

/// Most trailing dimensions a strided GPU source may have after merging contiguous ones.
pub(crate) const MAX_SOURCE_RANK: usize = 8;

/// Workgroups for `threads` invocations, capped at the device's per-dimension limit, and the loop stride
/// (total invocations) the kernel must use to cover the rest.
pub(crate) fn grid(threads: u64, max_workgroups: u32) -> (u32, u32) {
    let groups = threads
        .div_ceil(WORKGROUP_SIZE as u64)
        .clamp(1, max_workgroups.max(1) as u64) as u32;
    (groups, groups * WORKGROUP_SIZE)
}

/// The pipelines of one device.
pub struct Kernels {
    device: wgpu::Device,
    zero: wgpu::ComputePipeline,
    zero_layout: wgpu::BindGroupLayout,
    write_module: wgpu::ShaderModule,
    write_layout: wgpu::BindGroupLayout,
    write_pipeline_layout: wgpu::PipelineLayout,
    /// Slab-write pipelines by (source type, storage type, 16-byte entry point), built on first use.
    write: Mutex<HashMap<(DType, DType, bool), wgpu::ComputePipeline>>,
}

/// A compute-visible storage binding of any size.
pub(crate) fn storage_entry(binding: u32, read_only: bool) -> wgpu::BindGroupLayoutEntry {
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

/// A uniform binding read at a dynamic offset of the parameter ring.
pub(crate) fn params_entry(binding: u32, size: usize) -> wgpu::BindGroupLayoutEntry {
    wgpu::BindGroupLayoutEntry {
        binding,
        visibility: wgpu::ShaderStages::COMPUTE,
        ty: wgpu::BindingType::Buffer {
            ty: wgpu::BufferBindingType::Uniform,
            has_dynamic_offset: true,
            min_binding_size: wgpu::BufferSize::new(size as u64),
        },
        count: None,
    }
}

/// A WGSL shader module from a source of the generated table.
pub(crate) fn module(device: &wgpu::Device, label: &str, source: &str) -> wgpu::ShaderModule {
    device.create_shader_module(wgpu::ShaderModuleDescriptor {
        label: Some(label),
        source: wgpu::ShaderSource::Wgsl(source.into()),
    })
}

impl Kernels {
    fn build(device: &wgpu::Device) -> Self {
        let zero_layout = device.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
            label: Some("kvgpu zero"),
            entries: &[
                storage_entry(0, false),
                params_entry(1, size_of::<ZeroParams>()),
            ],
        });
        let zero_module = module(device, "kvgpu zero", wgsl::ZERO);
        let zero = device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some("kvgpu zero"),
            layout: Some(
                &device.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
                    label: Some("kvgpu zero"),
                    bind_group_layouts: &[Some(&zero_layout)],
                    immediate_size: 0,
                }),
            ),
            module: &zero_module,
            entry_point: Some("main"),
            compilation_options: Default::default(),
            cache: None,
        });
        let write_layout = device.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
            label: Some("kvgpu slab_write"),
            entries: &[
                storage_entry(0, true),
                storage_entry(1, false),
                params_entry(2, size_of::<WriteParams>()),
            ],
        });
        let write_pipeline_layout =
            device.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
                label: Some("kvgpu slab_write"),
                bind_group_layouts: &[Some(&write_layout)],
                immediate_size: 0,
            });
        Self {
            device: device.clone(),
            zero,
            zero_layout,
            write_module: module(device, "kvgpu slab_write", wgsl::SLAB_WRITE),
            write_layout,
            write_pipeline_layout,
            write: Mutex::new(HashMap::new()),
        }
    }

    /// The pipelines of `device` (the zeroing one now, each slab-write variant on first use). Share one
    /// among the caches of a device with [`crate::KvCache::with_kernels`].
    ///
    /// There is no process-wide registry keyed by device: wgpu compares devices by an id that is unique
    /// only within one `wgpu::Instance`, so such a registry could hand one instance's pipelines to another.
    pub fn new(device: &wgpu::Device) -> Arc<Kernels> {
        Arc::new(Self::build(device))
    }

    /// The device these pipelines belong to.
    pub fn device(&self) -> &wgpu::Device {
        &self.device
    }

    pub(crate) fn zero(&self) -> &wgpu::ComputePipeline {
        &self.zero
    }

    pub(crate) fn zero_layout(&self) -> &wgpu::BindGroupLayout {
        &self.zero_layout
    }

    pub(crate) fn write_layout(&self) -> &wgpu::BindGroupLayout {
        &self.write_layout
    }

    /// The slab-write pipeline converting `src` elements to `dst` storage; `vec4` picks the entry point
    /// that moves whole 16-byte vectors.
    pub(crate) fn write(&self, src: DType, dst: DType, vec4: bool) -> wgpu::ComputePipeline {
        let mut map = self.write.lock().unwrap_or_else(PoisonError::into_inner);
        map.entry((src, dst, vec4))
            .or_insert_with(|| {
                let constants = [
                    ("SRC_DTYPE", src.code() as f64),
                    ("DST_DTYPE", dst.code() as f64),
                ];
                self.device
                    .create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                        label: Some("kvgpu slab_write"),
                        layout: Some(&self.write_pipeline_layout),
                        module: &self.write_module,
                        entry_point: Some(if vec4 { "main_vec4" } else { "main" }),
                        compilation_options: wgpu::PipelineCompilationOptions {
                            constants: &constants,
                            ..Default::default()
                        },
                        cache: None,
                    })
            })
            .clone()
    }
}

/// Entries in a cache's parameter ring: how many parameterised dispatches (slab writes from GPU
/// sources, scrubs, resets) may be recorded before the encoders holding them are submitted.
pub const PARAM_RING_ENTRIES: u64 = 4096;

/// Uniform parameters of recorded dispatches. Each dispatch takes its own entry, written with
/// `Queue::write_buffer` (which lands at the next submit, before the recorded commands run), so many
/// dispatches with different parameters can share one encoder.
pub(crate) struct ParamRing {
    buffer: wgpu::Buffer,
    stride: u64,
    next: u64,
}

impl ParamRing {
    pub(crate) fn new(device: &wgpu::Device) -> Self {
        let align = device.limits().min_uniform_buffer_offset_alignment as u64;
        let stride = (size_of::<WriteParams>() as u64)
            .max(size_of::<ZeroParams>() as u64)
            .next_multiple_of(align);
        let buffer = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("kvgpu params"),
            size: stride * PARAM_RING_ENTRIES,
            usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        Self {
            buffer,
            stride,
            next: 0,
        }
    }

    /// Binding of one entry holding a `T`, for bind groups used with dynamic offsets.
    pub(crate) fn binding<T>(&self) -> wgpu::BindingResource<'_> {
        wgpu::BindingResource::Buffer(wgpu::BufferBinding {
            buffer: &self.buffer,
            offset: 0,
            size: wgpu::BufferSize::new(size_of::<T>() as u64),
        })
    }

    /// Stages `value` in the next entry and returns its dynamic offset.
    pub(crate) fn push<T: bytemuck::Pod>(&mut self, queue: &wgpu::Queue, value: &T) -> u32 {
        let offset = self.next * self.stride;
        self.next = (self.next + 1) % PARAM_RING_ENTRIES;
        queue.write_buffer(&self.buffer, offset, bytemuck::bytes_of(value));
        offset as u32
    }

    /// Stages `values` in consecutive entries with one write per run that does not wrap, and returns
    /// their dynamic offsets.
    pub(crate) fn push_all<T: bytemuck::Pod>(
        &mut self,
        queue: &wgpu::Queue,
        values: &[T],
    ) -> Vec<u32> {
        let stride = self.stride as usize;
        let mut offsets = Vec::with_capacity(values.len());
        let mut rest = values;
        while !rest.is_empty() {
            let run = rest.len().min((PARAM_RING_ENTRIES - self.next) as usize);
            let (now, later) = rest.split_at(run);
            let mut bytes = vec![0u8; (run - 1) * stride + size_of::<T>()];
            for (i, v) in now.iter().enumerate() {
                bytes[i * stride..i * stride + size_of::<T>()]
                    .copy_from_slice(bytemuck::bytes_of(v));
                offsets.push(((self.next + i as u64) * self.stride) as u32);
            }
            queue.write_buffer(&self.buffer, self.next * self.stride, &bytes);
            self.next = (self.next + run as u64) % PARAM_RING_ENTRIES;
            rest = later;
        }
        offsets
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout_of(name: &str) -> Vec<(&'static str, u32, u32)> {
        WGSL_LAYOUTS
            .iter()
            .filter(|r| r.0 == name)
            .map(|r| (r.1, r.2, r.3))
            .collect()
    }

    #[test]
    fn host_params_match_the_wgsl_structs() {
        let zero = layout_of("ZeroParams");
        assert_eq!(
            zero.first().map(|r| r.2),
            Some(size_of::<ZeroParams>() as u32)
        );
        assert_eq!(
            zero.iter().map(|r| (r.0, r.1)).collect::<Vec<_>>(),
            vec![
                ("start_word", 0),
                ("n_words", 4),
                ("thread_stride", 8),
                ("_pad", 12)
            ]
        );
        let write = layout_of("WriteParams");
        assert_eq!(
            write.first().map(|r| r.2),
            Some(size_of::<WriteParams>() as u32)
        );
        let p = WriteParams::default();
        let base = &p as *const _ as usize;
        let host = [
            ("src_offset", &p.src_offset as *const _ as usize),
            ("seq_stride", &p.seq_stride as *const _ as usize),
            ("n_rows", &p.n_rows as *const _ as usize),
            ("row_elems", &p.row_elems as *const _ as usize),
            ("row_words", &p.row_words as *const _ as usize),
            ("dst_word_offset", &p.dst_word_offset as *const _ as usize),
            ("rank", &p.rank as *const _ as usize),
            ("thread_stride", &p.thread_stride as *const _ as usize),
            ("shape", p.shape.as_ptr() as usize),
            ("stride", p.stride.as_ptr() as usize),
        ];
        assert_eq!(
            write.iter().map(|r| (r.0, r.1)).collect::<Vec<_>>(),
            host.iter()
                .map(|(n, a)| (*n, (a - base) as u32))
                .collect::<Vec<_>>()
        );
    }

    #[test]
    fn grid_caps_workgroups_and_strides_over_the_rest() {
        assert_eq!(grid(1, 65535), (1, 256));
        assert_eq!(grid(257, 65535), (2, 512));
        assert_eq!(grid(0, 65535), (1, 256));
        assert_eq!(grid(1 << 30, 65535), (65535, 65535 * 256));
    }
}
