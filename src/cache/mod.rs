//! The GPU cache: one storage buffer per (layer, slot), the ledger, and the commands that carry out a
//! checked plan. Every operation is checked in full before anything is recorded or written.

mod gpu_append;
mod read;
mod scatter;
mod slabs;
mod snapshot;
mod source;
mod staged;
mod step;
mod zero;

use std::borrow::Cow;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use crate::codec::{
    DType, HostData, padded_row_bytes, row_elems, scratch_bytes, stored_bytes, used_row_bytes,
};
use crate::error::{BufferProblem, Error, Result};
use crate::kernels::{
    GroupCache, Held, Kernels, ParamRing, Upload, UploadMark, UploadRing, VECTOR_BYTES, allocated,
    binding_limit, check_staging, held,
};
use crate::ledger::{AppendPlan, Ledger};
use crate::placement::{Placement, Run};
use crate::spec::{CacheSpec, DeviceLimits, SlotSpec};
pub(crate) use read::decoded;
pub use slabs::{GpuSlab, HostSlab, SlotView};
pub use snapshot::CacheImport;
pub(crate) use snapshot::{SlotRows, pump, write_slots};
pub(crate) use staged::StagedRows;
use zero::{ZeroRange, zero_vector_bytes};

struct SlotBuffer {
    buffer: wgpu::Buffer,
    /// The slot's storage type.
    dtype: DType,
    /// A scaled fp8 slot's scale.
    scale: Option<f32>,
    row_elems: usize,
    placement: Placement,
    zero_group: wgpu::BindGroup,
    /// The buffer is whole 32-byte vectors and the device has the zeroing kernel of 64-bit words.
    zero_int64: bool,
    /// A view of the buffer was handed to the app, which may destroy it (`wgpu::Buffer::destroy`
    /// takes `&self`): every call that uses the slot asks wgpu first ([`SlotBuffer::unusable`]).
    viewed: AtomicBool,
}

impl SlotBuffer {
    /// Host rows as this slot stores them: borrowed when they already are, else encoded into
    /// `scratch`.
    fn stored<'a>(&self, data: HostData<'a>, scratch: &'a mut Vec<u8>) -> &'a [u8] {
        stored_bytes(data, self.dtype, self.row_elems, self.scale, scratch)
    }

    /// The scratch bytes [`SlotBuffer::rows_bytes`] fills for slot `slot`'s part of `rows` (0 where
    /// it takes the rows as they are).
    fn scratch_bytes(&self, rows: Rows<'_, '_>, slot: usize) -> usize {
        match rows {
            Rows::Slabs(slabs) => scratch_bytes(slabs[slot].data, self.dtype, self.row_elems),
            Rows::Stored(rows) => match self.used_row_bytes() {
                Some(_) => rows[slot].len(),
                None => 0,
            },
        }
    }

    /// The bytes of a stored row that hold its elements, where they are fewer than the row's (the
    /// rest is padding, zeroed on the way in); `None` for rows without padding.
    fn used_row_bytes(&self) -> Option<usize> {
        let used = used_row_bytes(self.row_elems, self.dtype);
        (used != self.placement.row_bytes).then_some(used as usize)
    }

    /// Slot `slot`'s part of `rows` as this slot stores it, row padding (zeros) included.
    fn rows_bytes<'a>(
        &self,
        rows: Rows<'_, 'a>,
        slot: usize,
        scratch: &'a mut Vec<u8>,
    ) -> &'a [u8] {
        let stored = match rows {
            Rows::Slabs(slabs) => return self.stored(slabs[slot].data, scratch),
            Rows::Stored(rows) => rows[slot],
        };
        let Some(used) = self.used_row_bytes() else {
            return stored;
        };
        let row_bytes = self.placement.row_bytes as usize;
        scratch.clear();
        scratch.extend_from_slice(stored);
        for row in scratch.chunks_exact_mut(row_bytes) {
            row[used..].fill(0);
        }
        scratch
    }

    /// The bits of `1 / scale` a scaled fp8 slot's writes multiply by; 0 for any other slot.
    fn inv_scale_bits(&self) -> u32 {
        self.scale
            .map_or(0, |s| crate::codec::inverse_scale(s).to_bits())
    }

    /// Whether the app destroyed the buffer through a view. Only a slot whose view was handed out is
    /// asked, natively: asking costs about 0.5-2 us (a formatted wgpu error). WebGPU has no word for a destroyed
    /// buffer (it reports one at submit), so in a browser nothing is asked.
    fn unusable(&self) -> Option<BufferProblem> {
        if cfg!(target_arch = "wasm32") || !self.viewed.load(Ordering::Relaxed) {
            return None;
        }
        match held(&self.buffer) {
            Held::Destroyed => Some(BufferProblem::Destroyed),
            Held::Invalid => Some(BufferProblem::Invalid),
            Held::No | Held::Mapped => None,
        }
    }
}

/// Bind groups of GPU sources are cached by (source, bound range, layer, slot), and copy sources
/// once found to be of this device: at most this many of each, keeping at most `SOURCE_PIN_BYTES`
/// of source buffers alive in all (half each) that the app may have dropped.
const SOURCE_GROUPS: usize = 256;
const SOURCE_PIN_BYTES: u64 = 32 << 20;

/// A slab-write bind group: source buffer, binding offset and size, layer, slot, row map.
pub(crate) type SourceKey = (wgpu::Buffer, u64, u64, usize, usize, wgpu::Buffer);

/// The two ways attention reads a layer: GQA (scores from slot 0, values from slot 1) and MLA (scores
/// from slots 0 and 1, values from slot 0).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum AttentionKind {
    Gqa = 0,
    Mla = 1,
}

impl AttentionKind {
    /// The slots bound as a (scores), b (second score term) and v (values).
    pub(crate) fn slots(self) -> (usize, usize, usize) {
        match self {
            AttentionKind::Gqa => (0, 0, 1),
            AttentionKind::Mla => (0, 1, 0),
        }
    }
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
    /// The page table attention reads rows through, when this cache holds a paged pool's pages.
    page_table: Option<wgpu::Buffer>,
    /// Reused conversion buffer for host appends (at most [`KEEP_HOST_BYTES`] kept between calls).
    scratch: Vec<u8>,
    /// Scattered appends' uploads, and the host bytes one is assembled in.
    uploads: UploadRing,
    upload_bytes: Vec<u8>,
    max_workgroups: u32,
    /// Most workgroups of one zeroing dispatch: the device's cap on GPUs, a few on CPU adapters, where
    /// every workgroup costs a fixed start-up and invocations loop instead.
    zero_workgroups: u32,
    min_storage_offset_alignment: u64,
    max_binding: u64,
}

/// What [`Error::OutOfMemory`] names for host rows the device cannot stage.
pub(crate) const HOST_ROWS: &str = "the staging of host rows";
/// What an [`Error::OutOfMemory`] names where the device cannot hold an upload of host rows.
pub(crate) const UPLOAD: &str = "an upload of host rows";
/// What [`Error::OutOfMemory`] names for a snapshot's rows the device cannot stage.
pub(crate) const SNAPSHOT_ROWS: &str = "the snapshot's rows";

/// The most capacity a host buffer a cache reuses between calls (`scratch`, `upload_bytes`) keeps:
/// a decode step's bytes stay allocated, a long prefill's are let go once written.
const KEEP_HOST_BYTES: usize = 4 << 20;

/// Lets go of `bytes`' memory where it holds more than [`KEEP_HOST_BYTES`].
pub(crate) fn trim(bytes: &mut Vec<u8>) {
    if bytes.capacity() > KEEP_HOST_BYTES {
        *bytes = Vec::new();
    }
}

/// Checked host rows of one layer and where they go: `(first row of the rows, run)` per run.
pub(crate) struct HostRows<'s, 'a> {
    pub layer: usize,
    pub rows: Rows<'s, 'a>,
    pub runs: Cow<'s, [(usize, Run)]>,
}

impl<'s, 'a> HostRows<'s, 'a> {
    /// `rows` for the one run of a single-sequence cache's `plan`.
    pub(crate) fn of_plan(plan: &AppendPlan, rows: Rows<'s, 'a>) -> Self {
        let [run] = plan.runs();
        HostRows {
            layer: plan.layer,
            rows,
            runs: Cow::Owned(vec![(0, run)]),
        }
    }
}

/// The rows of each slot of a layer, from the host.
#[derive(Clone, Copy)]
pub(crate) enum Rows<'s, 'a> {
    /// Host slabs, converted as the slots store them.
    Slabs(&'s [HostSlab<'a>]),
    /// Rows already as the slots store them (a snapshot's sections), less any row padding.
    Stored(&'s [&'a [u8]]),
}

impl Rows<'_, '_> {
    fn slots(&self) -> usize {
        match self {
            Rows::Slabs(slabs) => slabs.len(),
            Rows::Stored(rows) => rows.len(),
        }
    }
}

impl std::fmt::Debug for KvCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvCache")
            .field("dtype", &self.spec.dtype())
            .field("layers", &self.spec.n_layers())
            .field("len", &self.len())
            .field("capacity", &self.capacity())
            .field("total_bytes", &self.spec.total_bytes())
            .field("kernels", &self.kernels)
            .finish_non_exhaustive()
    }
}

impl KvCache {
    /// Allocates a zeroed cache for `spec` on `device`, whose commands go through `queue` (the pair
    /// `request_device` returned), after checking every slot against the device's limits. A device
    /// that cannot hold its buffers refuses it with [`Error::OutOfMemory`].
    pub fn new(device: &wgpu::Device, queue: &wgpu::Queue, spec: CacheSpec) -> Result<Self> {
        Self::with_kernels(Kernels::new(device, queue)?, spec)
    }

    /// [`KvCache::new`] with the kernel registry of its device (`other.kernels().clone()`, or
    /// [`Kernels::new`]), so a second cache compiles nothing. The registry carries its device's queue, so
    /// a cache cannot be given the queue of another device.
    pub fn with_kernels(kernels: Arc<Kernels>, spec: CacheSpec) -> Result<Self> {
        spec.check_limits(&DeviceLimits::from_wgpu(&kernels.device().limits()))?;
        Self::allocate(kernels, spec)
    }

    /// Creates the buffers of a spec already checked against the device's limits, or says that the
    /// device could not hold them ([`Error::OutOfMemory`]).
    fn allocate(kernels: Arc<Kernels>, spec: CacheSpec) -> Result<Self> {
        let device = kernels.device().clone();
        let queue = kernels.queue().clone();
        let limits = device.limits();
        let ring = ParamRing::new(&kernels);
        let zero_workgroups = if kernels.is_cpu() {
            16.min(limits.max_compute_workgroups_per_dimension)
        } else {
            limits.max_compute_workgroups_per_dimension
        };
        // Whole vectors, as the zeroing kernels write them: of the device's fastest one where that
        // stays within the limits, else 16 bytes.
        let int64 = kernels.has_zero_int64();
        let size_of = |slot: &SlotSpec| {
            let bytes =
                padded_row_bytes(slot.row_elems(), spec.dtype_of(slot)) * spec.max_seq_len() as u64;
            let wide = bytes.next_multiple_of(zero_vector_bytes(int64));
            if wide <= limits.max_buffer_size && wide <= limits.max_storage_buffer_binding_size {
                wide
            } else {
                bytes.next_multiple_of(VECTOR_BYTES)
            }
        };
        let total = spec
            .layers()
            .iter()
            .flat_map(|layer| &layer.slots)
            .map(size_of)
            .sum();
        // Every slot buffer first: a device that cannot hold them all is reported before any is used.
        let buffers: Vec<Vec<wgpu::Buffer>> =
            allocated(&device, "the cache's slot buffers", total, || {
                spec.layers()
                    .iter()
                    .enumerate()
                    .map(|(l, layer)| {
                        layer
                            .slots
                            .iter()
                            .map(|slot| {
                                device.create_buffer(&wgpu::BufferDescriptor {
                                    label: Some(&format!("kvgpu layer {l} {}", slot.name)),
                                    size: size_of(slot),
                                    usage: wgpu::BufferUsages::STORAGE
                                        | wgpu::BufferUsages::COPY_DST
                                        | wgpu::BufferUsages::COPY_SRC,
                                    mapped_at_creation: false,
                                })
                            })
                            .collect()
                    })
                    .collect()
            })?;
        let slots = spec
            .layers()
            .iter()
            .zip(buffers)
            .map(|(layer, buffers)| {
                layer
                    .slots
                    .iter()
                    .zip(buffers)
                    .map(|(slot, buffer)| {
                        let row_elems = slot.row_elems();
                        let dtype = spec.dtype_of(slot);
                        // Made here, so another cache of this device may take it as a source.
                        crate::verify::remember(&device, &buffer);
                        let zero_group = device.create_bind_group(&wgpu::BindGroupDescriptor {
                            label: Some("kvgpu zero"),
                            layout: kernels.zero_layout(),
                            entries: &[wgpu::BindGroupEntry {
                                binding: 0,
                                resource: buffer.as_entire_binding(),
                            }],
                        });
                        SlotBuffer {
                            zero_int64: int64 && buffer.size() % zero_vector_bytes(true) == 0,
                            buffer,
                            dtype,
                            scale: slot.scale,
                            row_elems,
                            placement: Placement {
                                row_bytes: padded_row_bytes(row_elems, dtype),
                            },
                            zero_group,
                            viewed: AtomicBool::new(false),
                        }
                    })
                    .collect()
            })
            .collect();
        let uploads = UploadRing::new(&device);
        let probe = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("kvgpu source probe"),
            size: 4,
            usage: wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        Ok(Self {
            device,
            queue,
            ledger: Ledger::new(&spec),
            attention_groups: (0..spec.n_layers()).map(|_| Default::default()).collect(),
            page_table: None,
            spec,
            slots,
            kernels,
            ring,
            source_groups: GroupCache::new(SOURCE_GROUPS, SOURCE_PIN_BYTES / 2),
            copy_sources: GroupCache::new(SOURCE_GROUPS, SOURCE_PIN_BYTES / 2),
            probe,
            scratch: Vec::new(),
            uploads,
            upload_bytes: Vec::new(),
            max_workgroups: limits.max_compute_workgroups_per_dimension,
            zero_workgroups,
            min_storage_offset_alignment: limits.min_storage_buffer_offset_alignment as u64,
            max_binding: binding_limit(&limits),
        })
    }

    /// The spec the cache was made for: layers, storage types, capacity.
    pub fn spec(&self) -> &CacheSpec {
        &self.spec
    }

    /// The host bookkeeping: positions, pending rows, capacity.
    pub fn ledger(&self) -> &Ledger {
        &self.ledger
    }

    /// The device that holds the cache's buffers.
    pub fn device(&self) -> &wgpu::Device {
        &self.device
    }

    /// The kernel registry this cache records with, to share with another cache or an
    /// [`crate::Attention`] of the same device.
    pub fn kernels(&self) -> &Arc<Kernels> {
        &self.kernels
    }

    /// Whether `buffer` is one of this cache's slot buffers (of any layer).
    pub(crate) fn owns_buffer(&self, buffer: &wgpu::Buffer) -> bool {
        self.slots.iter().flatten().any(|sb| &sb.buffer == buffer)
    }

    /// The bind group of `layer`'s slots that attention of `kind` reads (group 0 of
    /// `attention_partial.wgsl`), made on first use. The layer has the slots `kind` needs.
    pub(crate) fn attention_group(&self, layer: usize, kind: AttentionKind) -> &wgpu::BindGroup {
        let (a, b, v) = kind.slots();
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
                    wgpu::BindGroupEntry {
                        binding: 3,
                        resource: self
                            .page_table
                            .as_ref()
                            .unwrap_or(self.kernels.no_pages())
                            .as_entire_binding(),
                    },
                ],
            })
        })
    }

    /// Makes `table` the page table attention binds with this cache's slots (a paged pool's, whose
    /// pages these slot buffers hold); the slot bind groups made before are dropped.
    pub(crate) fn set_page_table(&mut self, table: wgpu::Buffer) {
        self.page_table = Some(table);
        self.attention_groups = (0..self.spec.n_layers())
            .map(|_| Default::default())
            .collect();
    }

    /// Bytes of the upload ring for `len` bytes that no other upload uses, written later (see
    /// [`UploadRing::reserve`](crate::kernels::UploadRing::reserve)): [`Error::OutOfMemory`] naming
    /// `what` where the device cannot hold a buffer this needs.
    pub(crate) fn reserve_upload(&mut self, what: &str, len: u64) -> Result<Upload> {
        self.uploads.reserve(what, len)
    }

    /// Where the upload ring stands, for [`KvCache::upload_rewind`].
    pub(crate) fn upload_mark(&self) -> UploadMark {
        self.uploads.mark()
    }

    /// Puts the upload ring back where `mark` found it: for a call refused after it reserved
    /// uploads and before it wrote one or recorded a command that names one.
    pub(crate) fn upload_rewind(&mut self, mark: UploadMark) {
        self.uploads.rewind(mark);
    }

    /// Runs `f`, and puts the upload ring back where it stood when `f` is refused: `f` writes no
    /// upload and records nothing before its last refusal, so a refused call keeps no upload bytes
    /// or buffers.
    pub(crate) fn rewinding<T>(&mut self, f: impl FnOnce(&mut Self) -> Result<T>) -> Result<T> {
        let mark = self.upload_mark();
        let made = f(self);
        if made.is_err() {
            self.upload_rewind(mark);
        }
        made
    }

    /// The queue the cache writes host rows and submits its own commands through.
    pub fn queue(&self) -> &wgpu::Queue {
        &self.queue
    }

    /// Committed rows.
    pub fn len(&self) -> usize {
        self.ledger.len()
    }

    /// No row is committed (pending rows of the current step do not count).
    pub fn is_empty(&self) -> bool {
        self.ledger.is_empty()
    }

    /// The most rows the cache holds: the spec's `max_seq_len`.
    pub fn capacity(&self) -> usize {
        self.ledger.capacity()
    }

    /// Rows that can still be committed: the capacity less the committed rows.
    pub fn remaining(&self) -> usize {
        self.ledger.remaining()
    }

    /// The committed rows fill the capacity: no row can be appended.
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

    /// Refuses a slot of `layer` whose buffer the app destroyed through a view
    /// ([`Error::UnusableSlot`]). A layer the cache lacks has no slot to refuse.
    pub(crate) fn check_layer_usable(&self, layer: usize) -> Result<()> {
        let slots = self.slots.get(layer).map_or(0, Vec::len);
        (0..slots).try_for_each(|slot| self.check_slot_usable(layer, slot))
    }

    /// [`KvCache::check_layer_usable`] of every layer.
    pub(crate) fn check_usable(&self) -> Result<()> {
        (0..self.slots.len()).try_for_each(|layer| self.check_layer_usable(layer))
    }

    /// Refuses one slot whose buffer the app destroyed through a view; `(layer, slot)` exists.
    fn check_slot_usable(&self, layer: usize, slot: usize) -> Result<()> {
        match self.slots[layer][slot].unusable() {
            Some(problem) => Err(Error::UnusableSlot {
                layer,
                slot,
                problem,
            }),
            None => Ok(()),
        }
    }

    /// Appends one slab per slot of `layer` from host memory. The rows reach the GPU at the next queue
    /// submission, ahead of the commands submitted with it. Natively, for rows of more than 4 MiB
    /// in all, the call first checks that the device can stage them (a device that cannot refuses
    /// it with [`Error::OutOfMemory`], and nothing changes: wgpu 30 would lose the device).
    pub fn append(&mut self, layer: usize, slabs: &[HostSlab<'_>]) -> Result<AppendPlan> {
        let plan = self
            .ledger
            .plan_append_with(layer, slabs.len(), |s| slabs[s].shape)?;
        let [run] = plan.runs();
        self.check_host_slabs(layer, slabs)?;
        self.check_layer_usable(layer)?;
        self.write_host_runs(layer, slabs, &[(0, run)])?;
        self.ledger.commit_append(plan);
        Ok(plan)
    }

    /// Checks host slabs (shapes already checked against the layer's slots): f32 or the slot's
    /// storage type (any element type for quantized slots), and as many elements as their shapes say.
    pub(crate) fn check_host_slabs(&self, layer: usize, slabs: &[HostSlab<'_>]) -> Result<()> {
        for (slot, slab) in slabs.iter().enumerate() {
            let storage = self.slots[layer][slot].dtype;
            let got = slab.data.dtype();
            // Quantized storage quantizes any element type; the others take f32 or their own type.
            if got != DType::F32 && got != storage && !storage.is_quantized() {
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
        Ok(())
    }

    /// Writes checked host slabs into `runs` of the slot buffers of `layer` (`(first slab row, run)`)
    /// with `Queue::write_buffer`, after [`KvCache::check_host_rows`]: a refused check writes
    /// nothing.
    pub(crate) fn write_host_runs(
        &mut self,
        layer: usize,
        slabs: &[HostSlab<'_>],
        runs: &[(usize, Run)],
    ) -> Result<()> {
        let jobs = [HostRows {
            layer,
            rows: Rows::Slabs(slabs),
            runs: Cow::Borrowed(runs),
        }];
        self.check_host_rows(&jobs, HOST_ROWS)?;
        self.write_host_rows(&jobs);
        Ok(())
    }

    /// Natively, where `jobs` come to more than 4 MiB, whether the device can stage their writes
    /// ([`check_staging`]); [`Error::OutOfMemory`] naming `what` where it cannot. The host memory
    /// their conversion takes is reserved first ([`KvCache::reserve_scratch`]), so the check counts
    /// without it.
    pub(crate) fn check_host_rows(&mut self, jobs: &[HostRows<'_, '_>], what: &str) -> Result<()> {
        self.reserve_scratch(jobs)?;
        check_staging(&self.device, what, self.host_rows_bytes(jobs))
            .inspect_err(|_| trim(&mut self.scratch))
    }

    /// Lets go of the host conversion buffer's memory where it holds more than [`KEEP_HOST_BYTES`]
    /// (a call refused after [`KvCache::reserve_scratch`]).
    pub(crate) fn trim_scratch(&mut self) {
        trim(&mut self.scratch);
    }

    /// Reserves the host memory the largest conversion of `jobs`' rows into their slots' stored
    /// form takes (one job and slot at a time, in the scratch they share): [`Error::OutOfMemory`]
    /// where this process has no room for it, before anything is written. Staging checks made
    /// after this count without it: wgpu 30 loses the device (natively, panics) where a write's
    /// staging finds no room after the conversion took it.
    pub(crate) fn reserve_scratch(&mut self, jobs: &[HostRows<'_, '_>]) -> Result<()> {
        let needed = jobs
            .iter()
            .flat_map(|job| {
                let slots = &self.slots[job.layer][..job.rows.slots()];
                slots
                    .iter()
                    .enumerate()
                    .map(|(slot, sb)| sb.scratch_bytes(job.rows, slot))
            })
            .max()
            .unwrap_or(0);
        self.scratch.clear();
        match self.scratch.try_reserve_exact(needed) {
            Ok(()) => Ok(()),
            Err(_) => Err(Error::OutOfMemory {
                what: "the host rows in their stored form (host memory)".into(),
                bytes: needed as u64,
                reason: "this process could not allocate them".into(),
            }),
        }
    }

    /// Every move of `jobs`' rows, in order: (job, slot, byte in the slot's rows as stored, byte in
    /// the slot, bytes), one per run of rows and slot.
    fn host_moves(&self, jobs: &[HostRows<'_, '_>]) -> Vec<(usize, usize, u64, u64, u64)> {
        let mut moves = Vec::new();
        for (j, job) in jobs.iter().enumerate() {
            for (slot, sb) in self.slots[job.layer][..job.rows.slots()].iter().enumerate() {
                for (first, run) in job.runs.iter().filter(|(_, run)| run.n_rows > 0) {
                    let (to, size) = sb.placement.bytes(run);
                    moves.push((j, slot, *first as u64 * sb.placement.row_bytes, to, size));
                }
            }
        }
        moves
    }

    /// Bytes `jobs` write into their slots.
    pub(crate) fn host_rows_bytes(&self, jobs: &[HostRows<'_, '_>]) -> u64 {
        self.host_moves(jobs).iter().map(|m| m.4).sum()
    }

    /// Calls `each` with every move of [`KvCache::host_moves`] and the bytes of its slot's rows
    /// as stored (converted once per job and slot).
    fn for_each_move(
        &mut self,
        jobs: &[HostRows<'_, '_>],
        moves: &[(usize, usize, u64, u64, u64)],
        mut each: impl FnMut(&wgpu::Queue, &wgpu::Buffer, usize, &[u8]),
    ) {
        let mut at = 0;
        while at < moves.len() {
            let (j, slot, ..) = moves[at];
            let sb = &self.slots[jobs[j].layer][slot];
            let bytes = sb.rows_bytes(jobs[j].rows, slot, &mut self.scratch);
            while at < moves.len() && (moves[at].0, moves[at].1) == (j, slot) {
                each(&self.queue, &sb.buffer, at, bytes);
                at += 1;
            }
        }
        trim(&mut self.scratch);
    }

    /// Writes `jobs`' rows into their slots with `Queue::write_buffer` (landing at the next
    /// submission, ahead of its commands).
    pub(crate) fn write_host_rows(&mut self, jobs: &[HostRows<'_, '_>]) {
        let moves = self.host_moves(jobs);
        self.for_each_move(jobs, &moves, |queue, slot, m, bytes| {
            let (_, _, from, to, size) = moves[m];
            queue.write_buffer(slot, to, &bytes[from as usize..(from + size) as usize]);
        });
    }

    /// Records `jobs`' rows as one upload and one copy per run and slot into `encoder`, where they
    /// add up to no more than the upload ring (4 MiB): they land when the encoder's commands run
    /// (no rows: nothing to do). `false`, with nothing written or recorded, where they are more.
    /// An upload the device cannot make is refused with [`Error::OutOfMemory`], and records
    /// nothing.
    pub(crate) fn record_host_copies(
        &mut self,
        encoder: &mut wgpu::CommandEncoder,
        jobs: &[HostRows<'_, '_>],
    ) -> Result<bool> {
        let moves = self.host_moves(jobs);
        if moves.iter().map(|m| m.4).sum::<u64>() > self.uploads.size() {
            return Ok(false);
        }
        self.record_moves(encoder, jobs, &moves)?;
        Ok(true)
    }

    /// Records `jobs`' rows, however many, as uploads of at most the upload ring's size, packed
    /// (a piece holds the end of one run and the start of the next), each written once and copied
    /// into place by commands recorded into `encoder`, so that they land in the encoder's order.
    /// The uploads are reserved first (ring buffers made under the out-of-memory check), and
    /// natively the writes' staging is checked (above 4 MiB, [`check_staging`]) before and after:
    /// a refusal ([`Error::OutOfMemory`]) writes and records nothing, and leaves the upload ring as
    /// it was.
    pub(crate) fn record_host_pieces(
        &mut self,
        encoder: &mut wgpu::CommandEncoder,
        jobs: &[HostRows<'_, '_>],
    ) -> Result<()> {
        let moves = self.host_moves(jobs);
        self.record_moves(encoder, jobs, &moves)
    }

    /// [`KvCache::record_host_pieces`] of `moves`, the [`KvCache::host_moves`] of `jobs`.
    fn record_moves(
        &mut self,
        encoder: &mut wgpu::CommandEncoder,
        jobs: &[HostRows<'_, '_>],
        moves: &[(usize, usize, u64, u64, u64)],
    ) -> Result<()> {
        let piece = self.uploads.size();
        // (move, byte in its rows, byte in the slot, bytes, piece, byte in the piece), in upload
        // order, cut where a piece ends.
        let mut segments = Vec::new();
        let mut pieces: Vec<u64> = Vec::new();
        for (m, &(.., mut from, mut to, mut left)) in moves.iter().enumerate() {
            while left > 0 {
                if pieces.last().is_none_or(|&used| used == piece) {
                    pieces.push(0);
                }
                let p = pieces.len() - 1;
                let take = left.min(piece - pieces[p]);
                segments.push((m, from, to, take, p, pieces[p]));
                pieces[p] += take;
                (from, to, left) = (from + take, to + take, left - take);
            }
        }
        if segments.is_empty() {
            return Ok(());
        }
        let total = pieces.iter().sum();
        self.reserve_scratch(jobs)?;
        // A refusal lets go of the conversion's memory, as a finished call does.
        let uploads = check_staging(&self.device, HOST_ROWS, total)
            .and_then(|()| {
                self.rewinding(|c| {
                    let uploads = pieces
                        .iter()
                        .map(|&size| c.uploads.reserve(UPLOAD, size))
                        .collect::<Result<Vec<_>>>()?;
                    // The uploads hold their memory now: the writes' staging must fit beside them.
                    check_staging(&c.device, HOST_ROWS, total)?;
                    Ok(uploads)
                })
            })
            .inspect_err(|_| trim(&mut self.scratch))?;
        let mut blob = std::mem::take(&mut self.upload_bytes);
        blob.clear();
        let mut next = segments.iter().peekable();
        let mut filling = 0;
        self.for_each_move(jobs, moves, |queue, _, m, bytes| {
            while let Some(&(_, from, _, take, p, _)) = next.next_if(|s| s.0 == m) {
                if p != filling {
                    uploads[filling].write(queue, &blob);
                    blob.clear();
                    filling = p;
                }
                blob.extend_from_slice(&bytes[from as usize..(from + take) as usize]);
            }
        });
        uploads[filling].write(&self.queue, &blob);
        self.upload_bytes = blob;
        trim(&mut self.upload_bytes);
        for &(m, _, to, take, p, at) in &segments {
            let (j, slot, ..) = moves[m];
            let upload = &uploads[p];
            encoder.copy_buffer_to_buffer(
                &upload.buffer,
                upload.offset + at,
                &self.slots[jobs[j].layer][slot].buffer,
                to,
                take,
            );
        }
        Ok(())
    }

    /// Commits `n` rows: every layer with slots must have exactly `n` pending rows.
    pub fn advance(&mut self, n: usize) -> Result<()> {
        self.ledger.advance(n)
    }

    /// Rolls back to `new_len` committed rows in O(1), dropping pending rows; the dropped rows keep
    /// their bytes until overwritten (see [`KvCache::truncate_and_scrub`]). Submit an encoder holding
    /// recorded appends or attention over the dropped rows first: rows host-appended after this land
    /// at the next submission, ahead of that encoder's commands, which would then write over them
    /// (appends) or read them (attention).
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
        for d in dropped.iter().filter(|d| d.run().n_rows > 0) {
            self.check_layer_usable(d.layer)?;
        }
        let ranges: Vec<ZeroRange> = dropped
            .iter()
            .flat_map(|d| {
                self.slots[d.layer]
                    .iter()
                    .enumerate()
                    .map(move |(slot, sb)| {
                        let (start_word, n_words) = sb.placement.words(&d.run());
                        ZeroRange {
                            layer: d.layer,
                            slot,
                            start_word,
                            n_words,
                            int64: sb.zero_int64,
                        }
                    })
            })
            .collect();
        self.record_zeros(encoder, &ranges)?;
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
    /// compute pass) and sets the length to 0. A slot buffer the app destroyed through a view is
    /// skipped: nothing is left to zero there, and every later call that uses it is refused
    /// ([`Error::UnusableSlot`]). Refused with [`Error::OutOfMemory`], recording nothing and keeping
    /// the length, where the device cannot make the buffer the dispatches' parameters go to.
    pub fn record_reset(&mut self, encoder: &mut wgpu::CommandEncoder) -> Result<()> {
        let ranges: Vec<ZeroRange> = (0..self.slots.len())
            .flat_map(|layer| (0..self.slots[layer].len()).map(move |slot| (layer, slot)))
            .filter(|&(layer, slot)| self.slots[layer][slot].unusable().is_none())
            .map(|(layer, slot)| ZeroRange {
                layer,
                slot,
                start_word: 0,
                n_words: self.slots[layer][slot].buffer.size() / 4,
                int64: self.slots[layer][slot].zero_int64,
            })
            .collect();
        self.record_zeros(encoder, &ranges)?;
        self.ledger.reset();
        Ok(())
    }

    /// Records the zeroing of rows `runs` of every slot buffer (a pool's orphaned rows), skipping
    /// slot buffers the app destroyed; records nothing where the parameters' buffer cannot be made.
    pub(crate) fn record_zero_runs(
        &mut self,
        encoder: &mut wgpu::CommandEncoder,
        runs: &[Run],
    ) -> Result<()> {
        let ranges: Vec<ZeroRange> = (0..self.slots.len())
            .flat_map(|layer| (0..self.slots[layer].len()).map(move |slot| (layer, slot)))
            .filter(|&(layer, slot)| self.slots[layer][slot].unusable().is_none())
            .flat_map(|(layer, slot)| {
                let sb = &self.slots[layer][slot];
                runs.iter().map(move |run| {
                    let (start_word, n_words) = sb.placement.words(run);
                    ZeroRange {
                        layer,
                        slot,
                        start_word,
                        n_words,
                        int64: sb.zero_int64,
                    }
                })
            })
            .collect();
        self.record_zeros(encoder, &ranges)
    }

    /// [`KvCache::record_reset`] in its own submission.
    pub fn reset(&mut self) -> Result<()> {
        let mut encoder = self.encoder("kvgpu reset");
        self.record_reset(&mut encoder)?;
        self.queue.submit([encoder.finish()]);
        Ok(())
    }

    /// Sets the length to 0 and keeps the bytes: the next appends overwrite them.
    pub fn reset_fast(&mut self) {
        self.ledger.reset();
    }

    /// Records one zeroing dispatch per non-empty range, in one compute pass, with their parameters
    /// staged in one write; records nothing where the device cannot make their parameters' buffer
    /// ([`Error::OutOfMemory`]).
    fn record_zeros(
        &mut self,
        encoder: &mut wgpu::CommandEncoder,
        ranges: &[ZeroRange],
    ) -> Result<()> {
        let dispatches = zero::zero_dispatches(ranges, self.zero_workgroups, self.max_workgroups);
        if dispatches.is_empty() {
            return Ok(());
        }
        let params: Vec<_> = dispatches.iter().map(|d| d.2).collect();
        self.ring.reserve(params.len() as u64)?;
        let slots = self.ring.push_all(&self.queue, &params);
        let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
            label: Some("kvgpu zero"),
            timestamp_writes: None,
        });
        for ((r, groups, _), params) in dispatches.iter().zip(slots) {
            pass.set_pipeline(self.kernels.zero(r.int64));
            pass.set_bind_group(0, &self.slots[r.layer][r.slot].zero_group, &[]);
            pass.set_bind_group(1, &params.group, &[params.offset]);
            pass.dispatch_workgroups(*groups, 1, 1);
        }
        Ok(())
    }

    fn encoder(&self, label: &str) -> wgpu::CommandEncoder {
        self.device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some(label) })
    }
}
