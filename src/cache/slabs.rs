//! What an app hands a cache (slabs from the host or from GPU buffers) and what it gets back (views).

use half::{bf16, f16};

use crate::codec::{DType, HostData};

/// One slab from the host: `shape` is `[n_new, ...trailing]`, `data` row-major.
#[derive(Clone, Copy, Debug)]
pub struct HostSlab<'a> {
    pub shape: &'a [usize],
    pub data: HostData<'a>,
}

impl<'a> HostSlab<'a> {
    /// A slab of f32 elements shaped `shape`.
    pub fn f32(data: &'a [f32], shape: &'a [usize]) -> Self {
        Self {
            shape,
            data: HostData::F32(data),
        }
    }
    /// A slab of f16 elements shaped `shape`.
    pub fn f16(data: &'a [f16], shape: &'a [usize]) -> Self {
        Self {
            shape,
            data: HostData::F16(data),
        }
    }
    /// A slab of bf16 elements shaped `shape`.
    pub fn bf16(data: &'a [bf16], shape: &'a [usize]) -> Self {
        Self {
            shape,
            data: HostData::BF16(data),
        }
    }
}

/// One slab read from a GPU buffer: element `(i0, i1, ...)` of the `shape` `[n_new, ...trailing]` is
/// element `offset + Σ i_k · strides[k]` of `buffer`, of type `dtype` (16-bit types packed two per word,
/// low half first). `strides: None` means row-major contiguous.
///
/// A slab of no rows (or with an axis of extent 0) moves nothing: its buffer is not read, so its size,
/// usage and device are not checked. A buffer that is mapped, destroyed or the destination slot is
/// refused all the same.
///
/// K out of a fused QKV output `[n_tokens, q_dim + 2·kv_dim]` with `kv_dim = heads · dim`:
/// `offset: q_dim`, `shape: [n_tokens, heads, dim]`, `strides: [q_dim + 2·kv_dim, dim, 1]`.
#[derive(Clone, Copy, Debug)]
pub struct GpuSlab<'a> {
    pub buffer: &'a wgpu::Buffer,
    pub dtype: DType,
    pub offset: u64,
    pub shape: &'a [usize],
    pub strides: Option<&'a [usize]>,
}

impl<'a> GpuSlab<'a> {
    /// A row-major slab of `dtype` elements shaped `shape`, from the buffer's first element (an
    /// offset of 0, no strides).
    pub fn contiguous(buffer: &'a wgpu::Buffer, dtype: DType, shape: &'a [usize]) -> Self {
        Self {
            buffer,
            dtype,
            offset: 0,
            shape,
            strides: None,
        }
    }
}

/// A range of a slot buffer: the visible rows ([`crate::KvCache::view`]) or the whole capacity
/// (`KvCache::full_view`).
#[derive(Clone, Copy, Debug)]
pub struct SlotView<'a> {
    pub buffer: &'a wgpu::Buffer,
    /// Byte offset of row 0 (always 0: every slot has its own buffer).
    pub offset: u64,
    /// Bytes covered: `rows · row_bytes`.
    pub size: u64,
    pub rows: usize,
    /// Stored bytes per row (padded to 4).
    pub row_bytes: u64,
}

impl<'a> SlotView<'a> {
    /// The range as a binding for the app's own kernels; `None` when it covers no row.
    pub fn binding(&self) -> Option<wgpu::BufferBinding<'a>> {
        wgpu::BufferSize::new(self.size).map(|size| wgpu::BufferBinding {
            buffer: self.buffer,
            offset: self.offset,
            size: Some(size),
        })
    }
}
