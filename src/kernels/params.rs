//! Kernel parameters: the host twins of the WGSL parameter structs, and the ring that stages them.
//!
//! Every dispatch reads its parameters from its own entry of a uniform buffer, bound as the last bind
//! group of its pipeline with a dynamic offset. Entries are written with
//! `Queue::write_buffer`, which lands at the next submission, before the recorded commands run. An entry
//! is never written twice: when a ring buffer is used up, the ring moves on to a fresh buffer (the old
//! one lives as long as recorded commands still name it). So any number of dispatches may be recorded
//! between two submissions, and none can read another's parameters.

use crate::kernels::Kernels;

/// Parameters of the zeroing kernels (`shaders/zero.wgsl`, `zero_int64.wgsl`); must match `ZeroParams`
/// in `shaders/shared/prelude.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub(crate) struct ZeroParams {
    pub start_word: u32,
    pub n_words: u32,
    pub thread_stride: u32,
    pub _pad: u32,
}

/// Most trailing dimensions a strided GPU source may have after merging contiguous ones.
pub(crate) const MAX_SOURCE_RANK: usize = 8;

/// Parameters of `shaders/slab_write.wgsl`; must match its `WriteParams`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
pub(crate) struct WriteParams {
    pub src_offset: u32,
    pub seq_stride: u32,
    pub n_rows: u32,
    pub row_elems: u32,
    pub row_words: u32,
    pub dst_word_offset: u32,
    pub rank: u32,
    pub thread_stride: u32,
    pub map_word: u32,
    /// A scaled fp8 destination: the bits of `1 / scale`, which values are multiplied by before
    /// rounding; 0 for every other destination.
    pub inv_scale: u32,
    pub _pad: [u32; 2],
    pub shape: [u32; MAX_SOURCE_RANK],
    pub stride: [u32; MAX_SOURCE_RANK],
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
    pub q_first: u32,
    pub q_count: u32,
    /// Paged storage (kernels built for it): rows per page, the sequence's first entry in the page
    /// table, and the pool's pages (every table entry is clamped below it). 0 when not paged.
    pub page_size: u32,
    pub table_base: u32,
    pub n_pages: u32,
    /// Teams (KV head x head batch) side by side in one workgroup of one-invocation teams (1, 2, 4
    /// or 8; the workgroup's other invocations take further chunks); 1 for the other kernels.
    pub team_width: u32,
    /// The f32 views of q_a, q_b and the output: (offset in its binding, query, head and element
    /// strides), in elements.
    pub view_a: [u32; 4],
    pub view_b: [u32; 4],
    pub view_out: [u32; 4],
    /// Scales of slots a, b and v (1 but for scaled fp8 slots), and padding.
    pub slot_scales: [f32; 4],
    /// 1 where pass 1 writes the normalised output itself into the output, bound in place of the
    /// partial results, and no reduce runs (a streaming kernel's call of one chunk); 0 otherwise.
    pub direct: u32,
    pub _pad: [u32; 3],
}

/// Bytes of the binding every parameter bind group exposes: the largest parameter struct.
pub(crate) const PARAMS_BINDING: u64 = {
    let (a, b, c) = (
        size_of::<WriteParams>(),
        size_of::<ZeroParams>(),
        size_of::<AttnParams>(),
    );
    let ab = if a > b { a } else { b };
    (if ab > c { ab } else { c }) as u64
};

/// Entries of one ring buffer (fewer where the device's buffers cannot hold that many at its
/// uniform offset alignment); a full buffer is replaced, never rewritten.
pub(crate) const RING_ENTRIES: u64 = 1024;

/// The parameter entry of one dispatch: the bind group of its ring buffer and the dynamic offset.
#[derive(Clone, Debug)]
pub(crate) struct ParamSlot {
    pub group: wgpu::BindGroup,
    pub offset: u32,
}

/// What [`crate::Error::OutOfMemory`] names when a ring buffer cannot be made.
pub(crate) const RING: &str = "the parameter ring";

/// One ring buffer and its bind group.
#[derive(Debug)]
struct RingBuffer {
    buffer: wgpu::Buffer,
    group: wgpu::BindGroup,
}

/// Uniform parameters of recorded dispatches (see the module docs).
///
/// Buffers are made by [`ParamRing::reserve`], under the out-of-memory check, in a call's checks
/// before it records anything; the pushes that follow take the entries reserved, in order, and make
/// no buffer. (A push with no entry reserved makes its buffer unchecked; every caller reserves.)
#[derive(Debug)]
pub(crate) struct ParamRing {
    device: wgpu::Device,
    layout: wgpu::BindGroupLayout,
    stride: u64,
    /// Entries of each buffer: [`RING_ENTRIES`], or as many as the device's largest buffer holds.
    entries: u64,
    /// The buffer being filled first, then the ones reserved after it; none before the first call.
    buffers: std::collections::VecDeque<RingBuffer>,
    /// The next free entry of the first buffer.
    next: u64,
}

impl ParamRing {
    /// A ring with no buffer yet: the first call's reservation makes one.
    pub(crate) fn new(kernels: &Kernels) -> Self {
        let device = kernels.device().clone();
        let align = device.limits().min_uniform_buffer_offset_alignment as u64;
        let stride = PARAMS_BINDING.next_multiple_of(align);
        // `Kernels::new` checked that the device's buffers hold one entry at least.
        let entries = (device.limits().max_buffer_size / stride).clamp(1, RING_ENTRIES);
        Self {
            device,
            layout: kernels.params_layout().clone(),
            stride,
            entries,
            buffers: std::collections::VecDeque::new(),
            next: 0,
        }
    }

    /// Entries the buffers made so far still have.
    fn free(&self) -> u64 {
        (self.buffers.len() as u64 * self.entries).saturating_sub(self.next)
    }

    /// Makes buffers until the next `n` pushes need none. A buffer the device cannot make is
    /// refused with [`crate::Error::OutOfMemory`] naming [`RING`]; the entries already there stay,
    /// and the buffers this call made go (a refusal keeps no new memory).
    pub(crate) fn reserve(&mut self, n: u64) -> crate::Result<()> {
        let before = self.buffers.len();
        while self.free() < n {
            let size = self.stride * self.entries;
            let made = crate::kernels::allocated(&self.device, RING, size, || self.buffer(size));
            let buffer = made.inspect_err(|_| self.buffers.truncate(before))?;
            self.buffers.push_back(self.bound(buffer));
        }
        Ok(())
    }

    /// A ring buffer of `size` bytes.
    fn buffer(&self, size: u64) -> wgpu::Buffer {
        self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("kvgpu params"),
            size,
            usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        })
    }

    /// A ring buffer with its bind group.
    fn bound(&self, buffer: wgpu::Buffer) -> RingBuffer {
        let group = self.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some("kvgpu params"),
            layout: &self.layout,
            entries: &[wgpu::BindGroupEntry {
                binding: 0,
                resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                    buffer: &buffer,
                    offset: 0,
                    size: wgpu::BufferSize::new(PARAMS_BINDING),
                }),
            }],
        });
        RingBuffer { buffer, group }
    }

    /// Moves a used up buffer out (commands recorded with it keep it alive), so the first buffer
    /// has an entry left; returns how many.
    fn ready(&mut self) -> u64 {
        if self.next == self.entries {
            self.buffers.pop_front();
            self.next = 0;
        }
        if self.buffers.is_empty() {
            let buffer = self.buffer(self.stride * self.entries);
            self.buffers.push_back(self.bound(buffer));
        }
        self.entries - self.next
    }

    /// Stages `value` in a fresh entry.
    pub(crate) fn push<T: bytemuck::Pod>(&mut self, queue: &wgpu::Queue, value: &T) -> ParamSlot {
        self.ready();
        let (offset, ring) = (self.next * self.stride, &self.buffers[0]);
        queue.write_buffer(&ring.buffer, offset, bytemuck::bytes_of(value));
        let slot = ParamSlot {
            group: ring.group.clone(),
            offset: offset as u32,
        };
        self.next += 1;
        slot
    }

    /// Stages `values` in fresh entries, with one write per ring buffer they reach.
    pub(crate) fn push_all<T: bytemuck::Pod>(
        &mut self,
        queue: &wgpu::Queue,
        values: &[T],
    ) -> Vec<ParamSlot> {
        let stride = self.stride as usize;
        let mut slots = Vec::with_capacity(values.len());
        let mut rest = values;
        while !rest.is_empty() {
            let left = self.ready();
            let (first, ring) = (self.next, &self.buffers[0]);
            let (run, tail) = rest.split_at(rest.len().min(left as usize));
            let mut bytes = vec![0u8; (run.len() - 1) * stride + size_of::<T>()];
            for (i, v) in run.iter().enumerate() {
                bytes[i * stride..i * stride + size_of::<T>()]
                    .copy_from_slice(bytemuck::bytes_of(v));
                slots.push(ParamSlot {
                    group: ring.group.clone(),
                    offset: ((first + i as u64) * stride as u64) as u32,
                });
            }
            queue.write_buffer(&ring.buffer, first * stride as u64, &bytes);
            self.next = first + run.len() as u64;
            rest = tail;
        }
        slots
    }
}
