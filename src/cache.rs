//! The GPU cache: one storage buffer per (layer, slot), the ledger, and the commands that carry out a
//! checked plan. Every operation is checked in full before anything is recorded or written.

use std::sync::{Arc, OnceLock};

use half::{bf16, f16};

use crate::codec::{DType, HostData, decode_rows, encode_rows, padded_row_bytes, row_elems};
use crate::device::read_range;
use crate::error::{Error, Result};
use crate::kernels::{
    GroupCache, Kernels, MAX_SOURCE_RANK, ParamRing, WriteParams, ZeroParams, grid, scoped,
};
use crate::ledger::{AppendPlan, Ledger};
use crate::spec::{CacheSpec, DeviceLimits};

/// One slab from the host: `shape` is `[n_new, ...trailing]`, `data` row-major.
#[derive(Clone, Copy, Debug)]
pub struct HostSlab<'a> {
    pub shape: &'a [usize],
    pub data: HostData<'a>,
}

impl<'a> HostSlab<'a> {
    pub fn f32(data: &'a [f32], shape: &'a [usize]) -> Self {
        Self {
            shape,
            data: HostData::F32(data),
        }
    }
    pub fn f16(data: &'a [f16], shape: &'a [usize]) -> Self {
        Self {
            shape,
            data: HostData::F16(data),
        }
    }
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

/// A range of a slot buffer: the visible rows ([`KvCache::view`]) or the whole capacity
/// ([`KvCache::full_view`]).
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

struct SlotBuffer {
    buffer: wgpu::Buffer,
    row_elems: usize,
    row_bytes: u64,
    zero_group: wgpu::BindGroup,
}

/// 16-byte vectors one zeroing invocation clears per loop step (`BLOCK` in shaders/zero.wgsl).
const ZERO_BLOCK: u64 = 8;

/// Bind groups of GPU sources are cached by (source, bound range, layer, slot): at most this many,
/// keeping at most `SOURCE_PIN_BYTES` of source buffers alive that the app may have dropped.
const SOURCE_GROUPS: usize = 256;
const SOURCE_PIN_BYTES: u64 = 32 << 20;

type SourceKey = (wgpu::Buffer, u64, u64, usize, usize);

/// The two ways attention reads a layer: GQA (scores from slot 0, values from slot 1) and MLA (scores
/// from slots 0 and 1, values from slot 0).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum AttentionKind {
    Gqa = 0,
    Mla = 1,
}

/// A KV / latent cache on the GPU. See the crate docs for the contract.
pub struct KvCache {
    device: wgpu::Device,
    queue: wgpu::Queue,
    spec: CacheSpec,
    ledger: Ledger,
    slots: Vec<Vec<SlotBuffer>>,
    kernels: Arc<Kernels>,
    ring: ParamRing,
    source_groups: GroupCache<SourceKey>,
    /// Copy sources known to belong to this device.
    copy_sources: GroupCache<wgpu::Buffer, ()>,
    /// The destination of the probe copy that checks a copy source's device.
    probe: wgpu::Buffer,
    /// Per layer, the slot bind group of each attention kind, made on first use; owned here so that a
    /// dropped cache takes its buffers with it.
    attention_groups: Vec<[OnceLock<wgpu::BindGroup>; 2]>,
    /// Reused conversion buffer for host appends.
    scratch: Vec<u8>,
    max_workgroups: u32,
    /// Most workgroups of one zeroing dispatch: the device's cap on GPUs, a few on CPU adapters, where
    /// every workgroup costs a fixed start-up and invocations loop instead.
    zero_workgroups: u32,
    min_storage_offset_alignment: u64,
    max_binding: u64,
}

impl KvCache {
    /// Allocates a zeroed cache for `spec` on `device`, whose commands go through `queue` (the pair
    /// `request_device` returned), after checking every slot against the device's limits.
    pub fn new(device: &wgpu::Device, queue: &wgpu::Queue, spec: CacheSpec) -> Result<Self> {
        Self::with_kernels(Kernels::new(device, queue), spec)
    }

    /// [`KvCache::new`] with the kernel registry of its device (`other.kernels().clone()`, or
    /// [`Kernels::new`]), so a second cache compiles nothing. The registry carries its device's queue, so
    /// a cache cannot be given the queue of another device.
    pub fn with_kernels(kernels: Arc<Kernels>, spec: CacheSpec) -> Result<Self> {
        spec.check_limits(&DeviceLimits::from_wgpu(&kernels.device().limits()))?;
        Ok(Self::allocate(kernels, spec))
    }

    /// Creates the buffers of a spec already checked against the device's limits.
    fn allocate(kernels: Arc<Kernels>, spec: CacheSpec) -> Self {
        let device = kernels.device().clone();
        let queue = kernels.queue().clone();
        let limits = device.limits();
        let ring = ParamRing::new(&kernels);
        let zero_workgroups = if kernels.is_cpu() {
            16
        } else {
            limits.max_compute_workgroups_per_dimension
        };
        let slots = spec
            .layers()
            .iter()
            .enumerate()
            .map(|(l, layer)| {
                layer
                    .slots
                    .iter()
                    .map(|slot| {
                        let row_elems = slot.row_elems();
                        let row_bytes = padded_row_bytes(row_elems, spec.dtype());
                        let buffer = device.create_buffer(&wgpu::BufferDescriptor {
                            label: Some(&format!("kvgpu layer {l} {}", slot.name)),
                            // Whole 16-byte vectors, as the zeroing kernel writes them.
                            size: (row_bytes * spec.max_seq_len() as u64).next_multiple_of(16),
                            usage: wgpu::BufferUsages::STORAGE
                                | wgpu::BufferUsages::COPY_DST
                                | wgpu::BufferUsages::COPY_SRC,
                            mapped_at_creation: false,
                        });
                        let zero_group = device.create_bind_group(&wgpu::BindGroupDescriptor {
                            label: Some("kvgpu zero"),
                            layout: kernels.zero_layout(),
                            entries: &[wgpu::BindGroupEntry {
                                binding: 0,
                                resource: buffer.as_entire_binding(),
                            }],
                        });
                        SlotBuffer {
                            buffer,
                            row_elems,
                            row_bytes,
                            zero_group,
                        }
                    })
                    .collect()
            })
            .collect();
        let probe = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("kvgpu source probe"),
            size: 4,
            usage: wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        Self {
            device,
            queue,
            ledger: Ledger::new(&spec),
            attention_groups: (0..spec.n_layers()).map(|_| Default::default()).collect(),
            spec,
            slots,
            kernels,
            ring,
            source_groups: GroupCache::new(SOURCE_GROUPS, SOURCE_PIN_BYTES),
            copy_sources: GroupCache::new(SOURCE_GROUPS, SOURCE_PIN_BYTES),
            probe,
            scratch: Vec::new(),
            max_workgroups: limits.max_compute_workgroups_per_dimension,
            zero_workgroups,
            min_storage_offset_alignment: limits.min_storage_buffer_offset_alignment as u64,
            max_binding: limits.max_storage_buffer_binding_size.min(u32::MAX as u64),
        }
    }

    pub fn spec(&self) -> &CacheSpec {
        &self.spec
    }

    /// The host bookkeeping: positions, pending rows, capacity.
    pub fn ledger(&self) -> &Ledger {
        &self.ledger
    }

    pub fn device(&self) -> &wgpu::Device {
        &self.device
    }

    /// The kernel registry this cache records with, to share with another cache or an
    /// [`crate::Attention`] of the same device.
    pub fn kernels(&self) -> &Arc<Kernels> {
        &self.kernels
    }

    /// The bind group of `layer`'s slots that attention of `kind` reads (group 0 of
    /// `attention_partial.wgsl`), made on first use. The layer has the slots `kind` needs.
    pub(crate) fn attention_group(&self, layer: usize, kind: AttentionKind) -> &wgpu::BindGroup {
        let (a, b, v) = match kind {
            AttentionKind::Gqa => (0, 0, 1),
            AttentionKind::Mla => (0, 1, 0),
        };
        self.attention_groups[layer][kind as usize].get_or_init(|| {
            let slot = |s: usize| self.slots[layer][s].buffer.as_entire_binding();
            self.device.create_bind_group(&wgpu::BindGroupDescriptor {
                label: Some("kvgpu attention slots"),
                layout: self.kernels.attn_slots_layout(),
                entries: &[
                    wgpu::BindGroupEntry {
                        binding: 0,
                        resource: slot(a),
                    },
                    wgpu::BindGroupEntry {
                        binding: 1,
                        resource: slot(b),
                    },
                    wgpu::BindGroupEntry {
                        binding: 2,
                        resource: slot(v),
                    },
                ],
            })
        })
    }

    pub fn queue(&self) -> &wgpu::Queue {
        &self.queue
    }

    /// Committed rows.
    pub fn len(&self) -> usize {
        self.ledger.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ledger.is_empty()
    }

    pub fn capacity(&self) -> usize {
        self.ledger.capacity()
    }

    pub fn remaining(&self) -> usize {
        self.ledger.remaining()
    }

    pub fn is_full(&self) -> bool {
        self.ledger.is_full()
    }

    /// Rows of `layer` that views, reads and attention see: committed plus this step's appends.
    pub fn visible(&self, layer: usize) -> Result<usize> {
        self.ledger.visible(layer)
    }

    fn slot_buffer(&self, layer: usize, slot: usize) -> Result<&SlotBuffer> {
        self.spec.slot(layer, slot)?;
        Ok(&self.slots[layer][slot])
    }

    /// Appends one slab per slot of `layer` from host memory. The rows reach the GPU at the next queue
    /// submission, ahead of the commands submitted with it.
    pub fn append(&mut self, layer: usize, slabs: &[HostSlab<'_>]) -> Result<AppendPlan> {
        let plan = self
            .ledger
            .plan_append_with(layer, slabs.len(), |s| slabs[s].shape)?;
        let storage = self.spec.dtype();
        for (slot, slab) in slabs.iter().enumerate() {
            let got = slab.data.dtype();
            if got != DType::F32 && got != storage {
                return Err(Error::SourceDType {
                    layer,
                    slot,
                    expected: storage,
                    got,
                });
            }
            let expected = row_elems(slab.shape).unwrap_or(usize::MAX);
            if slab.data.len() != expected {
                return Err(Error::SourceSize {
                    layer,
                    slot,
                    shape: slab.shape.to_vec(),
                    expected,
                    got: slab.data.len(),
                });
            }
        }
        for (slot, slab) in slabs.iter().enumerate() {
            let sb = &self.slots[layer][slot];
            if plan.n_new == 0 {
                continue;
            }
            let offset = plan.start_row as u64 * sb.row_bytes;
            let unpadded = (sb.row_elems * storage.size()).is_multiple_of(4);
            let bytes: &[u8] = match slab.data {
                HostData::F32(d) if storage == DType::F32 => bytemuck::cast_slice(d),
                HostData::F16(d) if unpadded => bytemuck::cast_slice(d),
                HostData::BF16(d) if unpadded => bytemuck::cast_slice(d),
                data => {
                    encode_rows(data, storage, sb.row_elems, &mut self.scratch);
                    &self.scratch
                }
            };
            self.queue.write_buffer(&sb.buffer, offset, bytes);
        }
        self.ledger.commit_append(plan);
        Ok(plan)
    }

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
        let jobs = slabs
            .iter()
            .enumerate()
            .map(|(slot, slab)| self.plan_source(layer, slot, slab, plan.n_new))
            .collect::<Result<Vec<_>>>()?;
        // Bind groups (and the device check of each source) before anything is recorded.
        let groups = slabs
            .iter()
            .zip(&jobs)
            .enumerate()
            .map(|(slot, (slab, job))| self.prepare_source(layer, slot, slab, job))
            .collect::<Result<Vec<_>>>()?;
        for (slot, ((slab, job), group)) in slabs.iter().zip(jobs).zip(groups).enumerate() {
            self.record_source(encoder, &plan, slot, slab, job, group);
        }
        self.ledger.commit_append(plan);
        Ok(plan)
    }

    /// [`KvCache::record_append_gpu`] in its own submission.
    pub fn append_gpu(&mut self, layer: usize, slabs: &[GpuSlab<'_>]) -> Result<AppendPlan> {
        let mut encoder = self.encoder("kvgpu append_gpu");
        let plan = self.record_append_gpu(&mut encoder, layer, slabs)?;
        self.queue.submit([encoder.finish()]);
        Ok(plan)
    }

    /// Checks one GPU source completely and decides how to move it.
    fn plan_source(
        &self,
        layer: usize,
        slot: usize,
        slab: &GpuSlab<'_>,
        n_new: usize,
    ) -> Result<SourceJob> {
        let layout_err = |reason: String| Error::SourceLayout {
            layer,
            slot,
            reason,
        };
        let contiguous: Vec<usize>;
        let strides = match slab.strides {
            Some(s) => s,
            None => {
                contiguous = contiguous_strides(slab.shape);
                &contiguous
            }
        };
        if strides.len() != slab.shape.len() {
            return Err(layout_err(format!(
                "{} strides given for the {}-axis shape {:?}",
                strides.len(),
                slab.shape.len(),
                slab.shape
            )));
        }
        let sb = &self.slots[layer][slot];
        if slab.buffer == &sb.buffer {
            return Err(layout_err(
                "the source is the destination slot's own buffer".into(),
            ));
        }
        if n_new == 0 {
            return Ok(SourceJob::Nothing);
        }
        let esize = slab.dtype.size() as u64;
        let buffer_elements = slab.buffer.size() / esize;
        let span = slab
            .shape
            .iter()
            .zip(strides)
            .try_fold(0u64, |acc, (&n, &s)| {
                acc.checked_add((n as u64 - 1).checked_mul(s as u64)?)
            });
        let last_element = span
            .and_then(|s| s.checked_add(slab.offset))
            .unwrap_or(u64::MAX);
        if last_element >= buffer_elements {
            return Err(Error::SourceOutOfBounds {
                layer,
                slot,
                dtype: slab.dtype,
                last_element,
                buffer_elements,
            });
        }
        let usage = slab.buffer.usage();
        let storage = self.spec.dtype();
        let dense = slab.strides.is_none() || strides == contiguous_strides(slab.shape).as_slice();
        let aligned = (sb.row_elems as u64 * esize).is_multiple_of(4)
            && (slab.offset * esize).is_multiple_of(4);
        if slab.dtype == storage && dense && aligned && usage.contains(wgpu::BufferUsages::COPY_SRC)
        {
            return Ok(SourceJob::Copy {
                src_offset: slab.offset * esize,
            });
        }
        if !usage.contains(wgpu::BufferUsages::STORAGE) {
            let why = if slab.dtype != storage {
                format!("it holds {} and the cache stores {storage}", slab.dtype)
            } else if !dense {
                "it is strided".to_string()
            } else if !aligned {
                format!(
                    "a copy must start on a 4-byte boundary with unpadded rows, and this one starts at \
                     byte {} with {}-byte rows",
                    slab.offset * esize,
                    sb.row_elems as u64 * esize
                )
            } else {
                "it lacks COPY_SRC too".to_string()
            };
            return Err(layout_err(format!(
                "the buffer's usage {usage:?} lacks STORAGE, which the slab-write kernel needs: {why}"
            )));
        }
        // Merge trailing axes that are contiguous with each other; drop axes of extent 1.
        let mut dims: Vec<(u64, u64)> = Vec::with_capacity(slab.shape.len());
        for (&n, &s) in slab.shape[1..].iter().zip(&strides[1..]) {
            if n == 1 {
                continue;
            }
            match dims.last_mut() {
                Some(last) if last.1 == s as u64 * n as u64 => {
                    *last = (last.0 * n as u64, s as u64)
                }
                _ => dims.push((n as u64, s as u64)),
            }
        }
        if dims.len() > MAX_SOURCE_RANK {
            return Err(layout_err(format!(
                "{} non-contiguous trailing axes; at most {MAX_SOURCE_RANK} are supported",
                dims.len()
            )));
        }
        let first_word = slab.offset * esize / 4;
        let end_word = ((last_element + 1) * esize).div_ceil(4);
        let bind_offset =
            first_word * 4 / self.min_storage_offset_alignment * self.min_storage_offset_alignment;
        // The 16-byte path: an f32 source whose rows are contiguous runs starting on 16-byte boundaries
        // (binding offsets are multiples of 16), into rows of whole 16-byte vectors.
        let seq_stride = if n_new > 1 { strides[0] as u64 } else { 0 };
        let row_words = sb.row_bytes / 4;
        let vec4 = slab.dtype == DType::F32
            && matches!(dims.as_slice(), [(_, 1)])
            && slab.offset.is_multiple_of(4)
            && seq_stride.is_multiple_of(4)
            && row_words.is_multiple_of(4)
            && (end_word * 4).next_multiple_of(16) <= slab.buffer.size();
        let bind_end = if vec4 {
            (end_word * 4).next_multiple_of(16)
        } else {
            end_word * 4
        };
        if bind_end > slab.buffer.size() {
            return Err(Error::SourceWordTail {
                layer,
                slot,
                needed: bind_end,
                size: slab.buffer.size(),
            });
        }
        let bind_size = bind_end - bind_offset;
        if bind_size > self.max_binding {
            return Err(layout_err(format!(
                "the source spans {bind_size} bytes, more than one storage binding of this device holds ({})",
                self.max_binding
            )));
        }
        let mut params = WriteParams {
            src_offset: (slab.offset - bind_offset / esize) as u32,
            seq_stride: seq_stride as u32,
            n_rows: n_new as u32,
            row_elems: sb.row_elems as u32,
            row_words: row_words as u32,
            rank: dims.len() as u32,
            ..Default::default()
        };
        for (k, (n, s)) in dims.into_iter().enumerate() {
            params.shape[k] = n as u32;
            params.stride[k] = s as u32;
        }
        Ok(SourceJob::Kernel {
            params,
            bind_offset,
            bind_size,
            vec4,
        })
    }

    /// Makes (or finds) the bind group a kernel job needs, and checks that the source belongs to this
    /// device: wgpu refuses a bind group or a copy naming a buffer of another device, and the check
    /// runs here, inside an error scope, so the caller's encoder never sees the refusal.
    fn prepare_source(
        &mut self,
        layer: usize,
        slot: usize,
        slab: &GpuSlab<'_>,
        job: &SourceJob,
    ) -> Result<Option<wgpu::BindGroup>> {
        let foreign = |reason: String| Error::ForeignDevice {
            layer,
            what: format!("GPU source of slot {slot} (wgpu: {reason})"),
        };
        match *job {
            SourceJob::Nothing => Ok(None),
            SourceJob::Copy { .. } => {
                let (device, probe) = (&self.device, &self.probe);
                self.copy_sources
                    .get_or_try_insert(slab.buffer.clone(), &[slab.buffer], || {
                        let (_, error) = scoped(device, || {
                            let mut encoder =
                                device.create_command_encoder(&wgpu::CommandEncoderDescriptor {
                                    label: Some("kvgpu source probe"),
                                });
                            encoder.copy_buffer_to_buffer(slab.buffer, 0, probe, 0, 4);
                            encoder.finish()
                        });
                        error.map_or(Ok(()), |e| Err(foreign(e)))
                    })?;
                Ok(None)
            }
            SourceJob::Kernel {
                bind_offset,
                bind_size,
                ..
            } => {
                let key = (slab.buffer.clone(), bind_offset, bind_size, layer, slot);
                let (device, kernels) = (&self.device, &self.kernels);
                let dst = &self.slots[layer][slot].buffer;
                let group = self
                    .source_groups
                    .get_or_try_insert(key, &[slab.buffer], || {
                        let (group, error) = scoped(device, || {
                            device.create_bind_group(&wgpu::BindGroupDescriptor {
                                label: Some("kvgpu slab_write"),
                                layout: kernels.write_layout(),
                                entries: &[
                                    wgpu::BindGroupEntry {
                                        binding: 0,
                                        resource: wgpu::BindingResource::Buffer(
                                            wgpu::BufferBinding {
                                                buffer: slab.buffer,
                                                offset: bind_offset,
                                                size: wgpu::BufferSize::new(bind_size),
                                            },
                                        ),
                                    },
                                    wgpu::BindGroupEntry {
                                        binding: 1,
                                        resource: dst.as_entire_binding(),
                                    },
                                ],
                            })
                        });
                        error.map_or(Ok(group), |e| Err(foreign(e)))
                    })?;
                Ok(Some(group))
            }
        }
    }

    fn record_source(
        &mut self,
        encoder: &mut wgpu::CommandEncoder,
        plan: &AppendPlan,
        slot: usize,
        slab: &GpuSlab<'_>,
        job: SourceJob,
        group: Option<wgpu::BindGroup>,
    ) {
        let (layer, storage) = (plan.layer, self.spec.dtype());
        let sb = &self.slots[layer][slot];
        let dst_offset = plan.start_row as u64 * sb.row_bytes;
        match (job, group) {
            (SourceJob::Copy { src_offset }, _) => {
                let size = plan.n_new as u64 * sb.row_bytes;
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
                let words = plan.n_new as u64 * sb.row_bytes / 4;
                let outputs = if vec4 { words / 4 } else { words };
                let (groups, stride) = grid(outputs, self.max_workgroups);
                params.thread_stride = stride;
                params.dst_word_offset = (dst_offset / 4) as u32;
                let pipeline = self.kernels.write(slab.dtype, storage, vec4);
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

    /// Commits `n` rows: every layer with slots must have exactly `n` pending rows.
    pub fn advance(&mut self, n: usize) -> Result<()> {
        self.ledger.advance(n)
    }

    /// Rolls back to `new_len` committed rows in O(1), dropping pending rows; the dropped rows keep
    /// their bytes until overwritten (see [`KvCache::truncate_and_scrub`]).
    pub fn truncate(&mut self, new_len: usize) -> Result<()> {
        self.ledger.truncate(new_len).map(drop)
    }

    /// Truncates and records the zeroing of every dropped row into `encoder`.
    pub fn record_truncate_and_scrub(
        &mut self,
        encoder: &mut wgpu::CommandEncoder,
        new_len: usize,
    ) -> Result<()> {
        let dropped = self.ledger.plan_truncate(new_len)?;
        let ranges: Vec<ZeroRange> = dropped
            .iter()
            .flat_map(|d| {
                self.slots[d.layer]
                    .iter()
                    .enumerate()
                    .map(move |(slot, sb)| {
                        let row_words = sb.row_bytes / 4;
                        ZeroRange {
                            layer: d.layer,
                            slot,
                            start_word: d.start as u64 * row_words,
                            n_words: (d.end - d.start) as u64 * row_words,
                        }
                    })
            })
            .collect();
        self.record_zeros(encoder, &ranges);
        self.ledger.truncate(new_len).map(drop)
    }

    /// [`KvCache::record_truncate_and_scrub`] in its own submission.
    pub fn truncate_and_scrub(&mut self, new_len: usize) -> Result<()> {
        let mut encoder = self.encoder("kvgpu truncate");
        self.record_truncate_and_scrub(&mut encoder, new_len)?;
        self.queue.submit([encoder.finish()]);
        Ok(())
    }

    /// Records the zeroing of the whole cache (one zeroing-kernel dispatch per slot buffer, all in one
    /// compute pass) and sets the length to 0.
    pub fn record_reset(&mut self, encoder: &mut wgpu::CommandEncoder) {
        let ranges: Vec<ZeroRange> = (0..self.slots.len())
            .flat_map(|layer| (0..self.slots[layer].len()).map(move |slot| (layer, slot)))
            .map(|(layer, slot)| ZeroRange {
                layer,
                slot,
                start_word: 0,
                n_words: self.slots[layer][slot].buffer.size() / 4,
            })
            .collect();
        self.record_zeros(encoder, &ranges);
        self.ledger.reset();
    }

    /// [`KvCache::record_reset`] in its own submission.
    pub fn reset(&mut self) {
        let mut encoder = self.encoder("kvgpu reset");
        self.record_reset(&mut encoder);
        self.queue.submit([encoder.finish()]);
    }

    /// Sets the length to 0 and keeps the bytes: the next appends overwrite them.
    pub fn reset_fast(&mut self) {
        self.ledger.reset();
    }

    /// Records one zeroing dispatch per non-empty range, in one compute pass, with their parameters
    /// staged in one write.
    fn record_zeros(&mut self, encoder: &mut wgpu::CommandEncoder, ranges: &[ZeroRange]) {
        let ranges: Vec<&ZeroRange> = ranges.iter().filter(|r| r.n_words > 0).collect();
        if ranges.is_empty() {
            return;
        }
        let (groups, params): (Vec<u32>, Vec<ZeroParams>) = ranges
            .iter()
            .map(|r| {
                // One invocation per ZERO_BLOCK 16-byte vectors the range touches.
                let vectors = (r.start_word + r.n_words - 1) / 4 - r.start_word / 4 + 1;
                let (groups, thread_stride) =
                    grid(vectors.div_ceil(ZERO_BLOCK), self.zero_workgroups);
                let params = ZeroParams {
                    start_word: r.start_word as u32,
                    n_words: r.n_words as u32,
                    thread_stride,
                    _pad: 0,
                };
                (groups, params)
            })
            .unzip();
        let slots = self.ring.push_all(&self.queue, &params);
        let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
            label: Some("kvgpu zero"),
            timestamp_writes: None,
        });
        pass.set_pipeline(self.kernels.zero());
        for ((r, groups), params) in ranges.iter().zip(groups).zip(slots) {
            pass.set_bind_group(0, &self.slots[r.layer][r.slot].zero_group, &[]);
            pass.set_bind_group(1, &params.group, &[params.offset]);
            pass.dispatch_workgroups(groups, 1, 1);
        }
    }

    fn encoder(&self, label: &str) -> wgpu::CommandEncoder {
        self.device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some(label) })
    }

    /// The visible rows of a slot, for the app's own kernels.
    pub fn view(&self, layer: usize, slot: usize) -> Result<SlotView<'_>> {
        self.slot_view(layer, slot, false)
    }

    /// The whole capacity of a slot, visible or not: the escape hatch.
    pub fn full_view(&self, layer: usize, slot: usize) -> Result<SlotView<'_>> {
        self.slot_view(layer, slot, true)
    }

    fn slot_view(&self, layer: usize, slot: usize, full: bool) -> Result<SlotView<'_>> {
        let sb = self.slot_buffer(layer, slot)?;
        let rows = if full {
            self.capacity()
        } else {
            self.ledger.visible(layer)?
        };
        Ok(SlotView {
            buffer: &sb.buffer,
            offset: 0,
            size: rows as u64 * sb.row_bytes,
            rows,
            row_bytes: sb.row_bytes,
        })
    }

    async fn read_bytes(&self, layer: usize, slot: usize, full: bool) -> Result<Vec<u8>> {
        let view = self.slot_view(layer, slot, full)?;
        read_range(
            &self.device,
            &self.queue,
            view.buffer,
            view.offset,
            view.size,
        )
        .await
        .map_err(|reason| Error::Readback {
            layer,
            slot,
            reason,
        })
    }

    /// The visible rows of a slot as stored: 32-bit words, 16-bit types packed, rows padded.
    pub async fn read_words_async(&self, layer: usize, slot: usize) -> Result<Vec<u32>> {
        Ok(bytemuck::pod_collect_to_vec(
            &self.read_bytes(layer, slot, false).await?,
        ))
    }

    /// Every word of a slot buffer, visible or not.
    pub async fn read_full_words_async(&self, layer: usize, slot: usize) -> Result<Vec<u32>> {
        Ok(bytemuck::pod_collect_to_vec(
            &self.read_bytes(layer, slot, true).await?,
        ))
    }

    /// The visible rows of a slot as f32, `[visible, ...trailing]` row-major, padding removed.
    pub async fn read_f32_async(&self, layer: usize, slot: usize) -> Result<Vec<f32>> {
        let words = self.read_words_async(layer, slot).await?;
        let sb = self.slot_buffer(layer, slot)?;
        Ok(decode_rows(&words, self.spec.dtype(), sb.row_elems))
    }

    /// [`KvCache::read_words_async`], blocking.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn read_words(&self, layer: usize, slot: usize) -> Result<Vec<u32>> {
        pollster::block_on(self.read_words_async(layer, slot))
    }

    /// [`KvCache::read_full_words_async`], blocking.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn read_full_words(&self, layer: usize, slot: usize) -> Result<Vec<u32>> {
        pollster::block_on(self.read_full_words_async(layer, slot))
    }

    /// [`KvCache::read_f32_async`], blocking.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn read_f32(&self, layer: usize, slot: usize) -> Result<Vec<f32>> {
        pollster::block_on(self.read_f32_async(layer, slot))
    }
}

/// Words `[start_word, start_word + n_words)` of one slot buffer to zero.
struct ZeroRange {
    layer: usize,
    slot: usize,
    start_word: u64,
    n_words: u64,
}

/// How one GPU source reaches its slot.
enum SourceJob {
    Nothing,
    Copy {
        src_offset: u64,
    },
    Kernel {
        params: WriteParams,
        bind_offset: u64,
        bind_size: u64,
        /// Whole 16-byte vectors per invocation (`main_vec4` of shaders/slab_write.wgsl).
        vec4: bool,
    },
}

/// Row-major element strides of `shape`.
pub(crate) fn contiguous_strides(shape: &[usize]) -> Vec<usize> {
    let mut strides = vec![1; shape.len()];
    for k in (0..shape.len().saturating_sub(1)).rev() {
        strides[k] = strides[k + 1] * shape[k + 1];
    }
    strides
}
