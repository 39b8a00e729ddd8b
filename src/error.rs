//! The one error type of kvgpu. Every refused operation returns one of these and changes nothing,
//! but for the three cases [`Error`] lists.

use crate::codec::DType;
use crate::seq::SeqId;

/// Everything kvgpu can refuse, with the layer, slot, shapes, positions and capacity involved.
///
/// A refused operation changes nothing, but for three cases:
/// - a refused export ([`crate::KvCache::export_async`],
///   [`crate::PagedCache::export_sequence_async`] and their blocking forms) may already have
///   written the header and earlier slots of the snapshot to its writer;
/// - an import whose write wgpu still cannot stage after kvgpu's checks ([`Error::OutOfMemory`];
///   [`crate::KvCache::import`], [`crate::PagedCache::import_sequence`]) leaves the rows written
///   before it in the slots: past the cache's length, or in pages that stay free;
/// - [`crate::Attention::prepare`] and [`crate::Attention::prepare_paged`] keep the pipelines they
///   built before a kernel the device refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The layer index is not below the number of layers.
    #[error("layer {layer} is out of range: the cache has {n_layers} layers")]
    LayerOutOfRange { layer: usize, n_layers: usize },

    /// The slot index is not below the number of slots of its layer.
    #[error("slot {slot} of layer {layer} is out of range: the layer has {n_slots} slots")]
    SlotOutOfRange {
        layer: usize,
        slot: usize,
        n_slots: usize,
    },

    /// An append passed a different number of slabs than the layer has slots.
    #[error("layer {layer} has {expected} slots but {got} slabs were given")]
    SlotCount {
        layer: usize,
        expected: usize,
        got: usize,
    },

    /// A step-wide append ([`crate::KvCache::append_layers`]) passed a different number of slab
    /// lists than the cache has layers.
    #[error("the cache has {expected} layers but {got} slab lists were given (one per layer)")]
    LayerLists { expected: usize, got: usize },

    /// A slab's trailing shape differs from its slot's.
    #[error(
        "layer {layer} slot {slot}: slab shape {} does not match [n_new, ...{}] (the slot's \
         trailing shape is {})",
        shape(.got),
        shape(.expected),
        shape(.expected)
    )]
    SlabShape {
        layer: usize,
        slot: usize,
        expected: Vec<usize>,
        got: Vec<usize>,
    },

    /// The slabs of one append disagree on the number of new rows.
    #[error(
        "layer {layer} slot {slot}: slab has {got} rows but slot 0 has {expected}; \
         all slabs of one append share n_new"
    )]
    RowCountMismatch {
        layer: usize,
        slot: usize,
        expected: usize,
        got: usize,
    },

    /// The rows would not fit below the capacity. `seq` names the paged pool's sequence whose rows
    /// they are (in a batch, the first one that would not fit); `None` in a single-sequence cache
    /// and for a sequence a pool's import would add.
    #[error(
        "{}layer {layer}: appending {n_new} rows at position {position} exceeds the capacity of \
         {capacity} rows ({remaining} left)",
        .seq.map_or(String::new(), |seq| format!("{seq}, "))
    )]
    CapacityExceeded {
        seq: Option<SeqId>,
        layer: usize,
        position: usize,
        n_new: usize,
        capacity: usize,
        remaining: usize,
    },

    /// `advance(n)` found a layer whose pending rows are not exactly `n`. `seq` names the paged
    /// pool's sequence; `None` in a single-sequence cache.
    #[error(
        "{}advance({expected}): layer {layer} has {pending} pending rows, expected exactly \
         {expected} (committed length {len})",
        .seq.map_or(String::new(), |seq| format!("{seq}, "))
    )]
    UnevenAdvance {
        seq: Option<SeqId>,
        layer: usize,
        pending: usize,
        expected: usize,
        len: usize,
    },

    /// A batched append whose sequences' counts do not add up to the slabs' rows.
    #[error("layer {layer}: the batch's sequences take {batch} rows but the slabs hold {rows}")]
    BatchRows {
        layer: usize,
        /// The rows the sequences' counts add up to: `usize::MAX` where their sum overflows.
        batch: usize,
        rows: usize,
    },

    /// A paged pool was given a sequence it does not hold (never added, or removed).
    #[error("{seq} is not in the pool (never added, or removed)")]
    UnknownSequence { seq: SeqId },

    /// A paged pool was given a sequence id it did not hand out: another pool's, or
    /// [`SeqId::FIRST`] of a single-sequence cache. (Ids carry their pool, so such an id never names
    /// this pool's sequence of the same number.)
    #[error("{seq} was not handed out by this pool (it is another pool's id)")]
    ForeignSequence { seq: SeqId },

    /// A paged pool has handed out every sequence id it can (2^32 - 1: ids 0 to 2^32 - 2).
    #[error("the pool has handed out every sequence id it can (2^32 - 1)")]
    SequenceIdsExhausted,

    /// `fork(seq, at_len)` past the sequence's committed rows.
    #[error("cannot fork {seq} at {at_len}: it has only {len} committed rows")]
    ForkBeyondLength {
        seq: SeqId,
        at_len: usize,
        len: usize,
    },

    /// `publish_prefix(seq, tokens)` with more tokens than the sequence has committed rows.
    #[error("cannot publish {tokens} tokens of {seq}: it has only {len} committed rows")]
    PrefixBeyondLength {
        seq: SeqId,
        tokens: usize,
        len: usize,
    },

    /// A paged pool's page table cannot hold another sequence within one storage binding: its
    /// `most` rows are taken, by sequences or kept for encoders not yet done with sequences that
    /// were removed or truncated.
    #[error(
        "the pool's page table holds at most {most} sequences in one storage binding, and every \
         row is taken (by a sequence, or kept for an encoder not yet done); remove one first"
    )]
    TooManySequences { most: usize },

    /// A paged pool has fewer free pages than an operation needs (new pages, and private copies of
    /// shared pages it would write into).
    #[error("out of pages: {needed} needed, {free} free")]
    OutOfPages { needed: usize, free: usize },

    /// A paged pool with no page, or pages of no row.
    #[error(
        "a pool needs at least one page of at least one row: {n_pages} pages of {page_size} rows"
    )]
    EmptyPool { page_size: usize, n_pages: usize },

    /// A paged pool whose pool of one slot would not fit one storage binding of the device.
    #[error(
        "layer {layer} slot {slot}: {n_pages} pages of {page_size} rows ({row_bytes} bytes/row) exceed \
         the device's storage binding limit of {limit} bytes; the most pages that fit are {max_pages}"
    )]
    PoolTooLarge {
        layer: usize,
        slot: usize,
        n_pages: usize,
        page_size: usize,
        row_bytes: u64,
        limit: u64,
        max_pages: usize,
    },

    /// `truncate(new_len)` was asked to grow the cache. `seq` names the paged pool's sequence;
    /// `None` in a single-sequence cache.
    #[error(
        "{}cannot truncate to {new_len}: the committed length is only {len}",
        .seq.map_or(String::new(), |seq| format!("{seq}, "))
    )]
    TruncateBeyondLength {
        seq: Option<SeqId>,
        new_len: usize,
        len: usize,
    },

    /// Host data of an element type that cannot go into this cache's storage type.
    #[error(
        "layer {layer} slot {slot}: source element type {got} cannot be stored as {expected} \
         (pass f32, or data already in {expected}; quantized storage takes f32, f16 or bf16)"
    )]
    SourceDType {
        layer: usize,
        slot: usize,
        expected: DType,
        got: DType,
    },

    /// Host data whose length does not match its declared shape.
    #[error(
        "layer {layer} slot {slot}: slab shape {shape:?} needs {expected} elements but the data has {got}"
    )]
    SourceSize {
        layer: usize,
        slot: usize,
        shape: Vec<usize>,
        expected: usize,
        got: usize,
    },

    /// A GPU source whose described elements reach past the end of its buffer.
    #[error(
        "layer {layer} slot {slot}: the source reads up to element {last_element} ({dtype}) but its \
         buffer holds {buffer_elements} elements"
    )]
    SourceOutOfBounds {
        layer: usize,
        slot: usize,
        dtype: DType,
        last_element: u64,
        buffer_elements: u64,
    },

    /// A GPU source that cannot be read the way it is described (usage flags, strides, rank, binding size).
    #[error("layer {layer} slot {slot}: unusable GPU source: {problem}")]
    SourceLayout {
        layer: usize,
        slot: usize,
        problem: SourceProblem,
    },

    /// A 16-bit GPU source is read as 32-bit words, and its last word reaches past the buffer's end.
    #[error(
        "layer {layer} slot {slot}: 16-bit sources are read as whole 32-bit words, up to byte {needed}, \
         but the buffer has {size} bytes; give it a size that covers its last word (a multiple of 4)"
    )]
    SourceWordTail {
        layer: usize,
        slot: usize,
        needed: u64,
        size: u64,
    },

    /// A buffer or cache of another device than the one it is used with (wgpu would refuse it and
    /// spoil the caller's encoder). `layer` is the call's layer; [`crate::Attention::prepare`] and
    /// [`crate::Attention::prepare_paged`], which refuse the whole cache, name layer 0.
    #[error("layer {layer}: the {what} belongs to another device")]
    ForeignDevice { layer: usize, what: String },

    /// [`verify_buffer`](crate::verify_buffer) found that a buffer cannot be used on this device:
    /// it belongs to another one (wgpu's refusal is quoted).
    #[error("the buffer belongs to another device (wgpu refused to bind it: {reason})")]
    ForeignBuffer { reason: String },

    /// [`verify_buffer`](crate::verify_buffer) found a buffer no device can use: the app destroyed
    /// it, or its creation failed ([`BufferProblem::Destroyed`], [`BufferProblem::Invalid`]).
    #[error("the buffer cannot be used: {problem}")]
    UnusableBuffer { problem: BufferProblem },

    /// A slot buffer handed out by a view ([`crate::KvCache::view`], [`crate::KvCache::full_view`],
    /// [`crate::PagedCache::pool_view`]) that the app destroyed ([`BufferProblem::Destroyed`]; natively
    /// only): no call that uses the slot can run again, and the cache or pool has to be made anew.
    #[error(
        "layer {layer} slot {slot}: the slot buffer handed out by a view cannot be used ({problem}); \
         make the cache or pool anew"
    )]
    UnusableSlot {
        layer: usize,
        slot: usize,
        problem: BufferProblem,
    },

    /// In a browser, a synchronous call was given a buffer that
    /// [`verify_buffer`](crate::verify_buffer) has not accepted for this device: WebGPU reports a
    /// buffer of another device only asynchronously, so the call cannot check it before recording.
    #[error(
        "layer {layer}: the {what} has not been verified for this device; in a browser, await \
         kvgpu::verify_buffer(&device, &buffer) once for each app buffer before a synchronous call \
         binds it (WebGPU reports a buffer of another device only asynchronously)"
    )]
    UnverifiedBuffer { layer: usize, what: String },

    /// [`crate::create_buffer`] or [`crate::create_buffer_init`] was given a descriptor wgpu would
    /// refuse (an empty or mixed mappable usage, a usage outside WebGPU's, a size past the device's
    /// `max_buffer_size`, a buffer mapped at creation whose size is not whole words): nothing was
    /// made.
    #[error("cannot make the buffer: {reason}")]
    BufferDescriptor { reason: String },

    /// The cache description itself is unusable.
    #[error("invalid cache spec: {problem}")]
    InvalidSpec { problem: SpecProblem },

    /// One slot would not fit in one storage binding of this device.
    #[error(
        "layer {layer} slot {slot}: {bytes} bytes ({row_bytes} bytes/row x {capacity} rows) exceed the \
         device's storage binding limit of {limit} bytes; the largest capacity that fits is {max_capacity} rows"
    )]
    SlotTooLarge {
        layer: usize,
        slot: usize,
        bytes: u64,
        row_bytes: u64,
        capacity: usize,
        limit: u64,
        max_capacity: usize,
    },

    /// No adapter matched the request (backend from `WGPU_BACKEND`, name from `WGPU_ADAPTER_NAME`).
    #[error("no GPU adapter found: {reason}")]
    AdapterNotFound { reason: String },

    /// The adapter refused to create a device.
    #[error("request_device failed: {reason}")]
    RequestDevice { reason: String },

    /// Mapping a readback buffer failed.
    #[error("readback of layer {layer} slot {slot} failed: {reason}")]
    Readback {
        layer: usize,
        slot: usize,
        reason: String,
    },

    /// The device's `limit` (a field of `wgpu::Limits`) is below what kvgpu's cache kernels need:
    /// two bind groups of four bindings, four storage buffers per shader stage, one dynamic uniform
    /// buffer, workgroups of 256 x 1 x 1 invocations (and one per dispatch dimension) and buffers
    /// of 256 KiB (or one parameter entry, where uniform offsets align coarser). Devices made with
    /// WebGPU's default limits, or wgpu's downlevel ones, have them; a device without compute
    /// shaders (WebGL2's limits) does not. Nothing was created. (What attention needs more, such as eight storage
    /// buffers per stage, is refused per call: [`AttentionProblem::DeviceLimit`].)
    #[error("the device's {limit} is {got}; kvgpu's kernels need at least {needed}")]
    DeviceLimit {
        limit: String,
        needed: u64,
        got: u64,
    },

    /// A queue handed in with a device belongs to another device.
    #[error("the queue belongs to another device than the one it was given with")]
    QueueMismatch,

    /// The device could not allocate the buffers of `what` (`bytes` in all): its memory is taken.
    /// Nothing was changed (but for the rows an import wrote before wgpu failed to stage one, past
    /// every length: [`crate::KvCache::import`]); a smaller request, or one made after dropping
    /// caches, may succeed. Host
    /// rows of more than 4 MiB in one call (appends, imports of a snapshot's bytes, a streamed
    /// import's piece) are checked first: kvgpu makes and drops buffers of the kind and size wgpu
    /// stages them in. Where wgpu itself cannot stage a smaller host write (`Queue::write_buffer`),
    /// wgpu 30 also loses the device. The buffers kvgpu uploads host data through (a step's rows,
    /// a scattered append's row map, page-table entries, a batch's query table), a pool's page
    /// table (made or grown), its copy-on-write staging and the ring of uniform buffers that
    /// dispatches take their parameters from (`what`: "the parameter ring"; a reset, a scrub, a
    /// converting GPU append or an attention call) are made under the same check.
    /// Cache creation, staging, uploads and attention's scratch are checked natively only (on
    /// OpenGL, whose wgpu backend reports no failed allocation, the checks cannot fail): in the
    /// browser WebGPU answers such a check only later, so the failure is left to WebGPU's own
    /// report, the device's uncaptured error. (A readback whose staging buffer cannot be made is
    /// refused with [`Error::Readback`] or [`Error::Device`], also in the browser.) A `read_f32`
    /// whose f32 values this process cannot allocate is refused with this error too, `what` and
    /// `reason` naming host memory, and so is a host append or import whose rows this process has
    /// no room to convert into their stored form (reserved before the staging check).
    #[error("out of memory: could not allocate {bytes} bytes for {what}: {reason}")]
    OutOfMemory {
        what: String,
        bytes: u64,
        reason: String,
    },

    /// The device failed an operation that is not about one slot: a readback of an app's buffer
    /// (refused, or failed on the device), a poll that timed out.
    #[error("device error: {reason}")]
    Device { reason: String },

    /// The device is lost (a driver reset, a removed adapter, `wgpu::Device::destroy`): a buffer
    /// kvgpu made just now for `what` came back invalid though the device reported no error for it.
    /// Nothing more can run on this device; an app recovers by requesting a new device and making
    /// its caches again (from snapshots exported before the loss). Reported natively by every call
    /// that makes a buffer (a readback's staging buffer, the parameter ring, attention's scratch, an
    /// upload, a new cache, pool or registry); calls whose buffers were all made before the loss
    /// return and write nothing. In the browser wgpu 30 shows an app nothing of a loss but through
    /// the device's own lost callback, so readbacks there fail as [`Error::Readback`] or
    /// [`Error::Device`], and the other calls return.
    #[error("the device is lost (wgpu made {what} invalid)")]
    DeviceLost { what: String },

    /// Attention was asked of a layer whose slots are not the kind it reads: GQA needs K
    /// `[n_kv_heads, d_k]` and V `[n_kv_heads, d_v]`, MLA needs `compressed_kv [r]` and `k_pe [p]`.
    #[error("layer {layer} cannot run {kind} attention: its slots have trailing shapes {shapes:?}")]
    NotAttentionLayer {
        layer: usize,
        kind: &'static str,
        shapes: Vec<Vec<usize>>,
    },

    /// Queries whose shape does not fit the layer's slots (or each other).
    #[error("layer {layer}: {which} has shape {got:?} but {expected:?} is needed")]
    QueryShape {
        layer: usize,
        which: &'static str,
        expected: Vec<usize>,
        got: Vec<usize>,
    },

    /// The query heads cannot be split evenly among the KV heads.
    #[error(
        "layer {layer}: {n_heads} query heads are not a (non-zero) multiple of the layer's {n_kv_heads} KV heads"
    )]
    HeadGroups {
        layer: usize,
        n_heads: usize,
        n_kv_heads: usize,
    },

    /// The queries are not 1 to `visible` of the layer's visible rows. `seq` names the paged pool's
    /// sequence read (in a batch, the entry whose count is wrong); `None` for a single-sequence cache.
    #[error(
        "{}layer {layer}: {n_q} queries but the layer has {visible} visible rows; the queries are the last \
         n_q visible rows, so 1 <= n_q <= visible (append this step's rows first)",
        .seq.map_or(String::new(), |seq| format!("{seq}, "))
    )]
    QueryRows {
        seq: Option<SeqId>,
        layer: usize,
        n_q: usize,
        visible: usize,
    },

    /// A query or output buffer smaller than the view it must hold (its shape from its offset,
    /// along its strides).
    #[error(
        "layer {layer}: {which} buffer holds {size} bytes but shape {shape:?} (f32, from its offset \
         along its strides) needs {needed}"
    )]
    BufferTooSmall {
        layer: usize,
        which: &'static str,
        shape: Vec<usize>,
        needed: u64,
        size: u64,
    },

    /// A query or output buffer attention cannot use: usage flags, aliasing, its view's layout or
    /// binding size.
    #[error("layer {layer}: unusable {which} buffer: {problem}")]
    AttentionBuffer {
        layer: usize,
        which: &'static str,
        problem: BufferProblem,
    },

    /// Attention options out of range (scale, window, soft-cap) or a call beyond the device's limits.
    #[error("layer {layer}: invalid attention request: {problem}")]
    AttentionRequest {
        layer: usize,
        problem: AttentionProblem,
    },

    /// A snapshot that cannot be written, read or restored here: truncated, corrupt, of another
    /// format version, of an incompatible spec, or a destination that is not empty.
    #[error("snapshot: {problem}")]
    Snapshot { problem: SnapshotProblem },
}

/// Why a snapshot is refused ([`Error::Snapshot`]).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum SnapshotProblem {
    /// The bytes do not start with the snapshot magic `KVGPUSNP`.
    #[error("not a kvgpu snapshot (the bytes do not start with KVGPUSNP)")]
    BadMagic,
    /// A format version this kvgpu does not read.
    #[error("format version {found}; this kvgpu reads version {supported}")]
    UnsupportedVersion { found: u32, supported: u32 },
    /// The bytes end before the snapshot does.
    #[error("truncated: {got} bytes, but at least {needed} are needed")]
    Truncated { needed: u64, got: u64 },
    /// Bytes follow the end of the snapshot.
    #[error("{got} bytes, but the snapshot ends after {expected}")]
    TrailingBytes { expected: u64, got: u64 },
    /// A stored checksum differs from the bytes' (`section`: `header` or `snapshot`).
    #[error(
        "the {section} checksum is {stored:#010x} but the bytes give {computed:#010x}: corrupt"
    )]
    ChecksumMismatch {
        section: &'static str,
        stored: u32,
        computed: u32,
    },
    /// A header whose checksum is right but whose contents are not a cache spec.
    #[error("malformed header: {detail}")]
    MalformedHeader { detail: String },
    /// A slot's storage type differs between the snapshot and the destination (no conversion is
    /// offered).
    #[error(
        "layer {layer} slot {slot} is stored as {snapshot} in the snapshot and as {cache} in the \
         destination; no conversion is offered"
    )]
    DType {
        layer: usize,
        slot: usize,
        snapshot: DType,
        cache: DType,
    },
    /// A slot's scale differs between the snapshot and the destination (its stored numbers would
    /// mean other values).
    #[error(
        "layer {layer} slot {slot} has the scale {snapshot:?} in the snapshot and {cache:?} in the \
         destination"
    )]
    Scale {
        layer: usize,
        slot: usize,
        snapshot: Option<f32>,
        cache: Option<f32>,
    },
    /// The snapshot has another number of layers than the destination.
    #[error("it has {snapshot} layers and the destination {cache}")]
    LayerCount { snapshot: usize, cache: usize },
    /// A layer with another number of slots than the destination's.
    #[error("layer {layer} has {snapshot} slots in the snapshot and {cache} in the destination")]
    SlotCount {
        layer: usize,
        snapshot: usize,
        cache: usize,
    },
    /// A slot with another trailing shape than the destination's.
    #[error(
        "layer {layer} slot {slot} has trailing shape {} in the snapshot and {} in the \
         destination",
        shape_of(.snapshot, *.snapshot_rank),
        shape(.cache)
    )]
    SlotShape {
        layer: usize,
        slot: usize,
        /// The snapshot's trailing shape, its first 8 dimensions where it has more: a
        /// hostile header may declare millions, which the error would otherwise copy whole (and a
        /// stream would return again from every later call).
        snapshot: Vec<usize>,
        /// How many dimensions the snapshot's trailing shape has.
        snapshot_rank: usize,
        cache: Vec<usize>,
    },
    /// A single-sequence cache restores only into an empty cache (`reset_fast` it first).
    #[error(
        "the destination cache holds {len} committed and {pending} pending rows; a snapshot \
         restores into an empty cache (reset it first)"
    )]
    NotEmpty { len: usize, pending: usize },
    /// The writer the snapshot was exported to failed: `kind` is its `std::io::Error`'s kind
    /// (`WriteZero` for a writer that took no bytes, `InvalidData` for one that said it wrote more
    /// than it was given).
    #[error("writing failed: {reason}")]
    Write {
        kind: std::io::ErrorKind,
        reason: String,
    },
    /// The reader a snapshot was imported from failed: `kind` is its `std::io::Error`'s kind
    /// (`InvalidData` for a reader that said it read more than its buffer holds).
    #[error("reading failed: {reason}")]
    Read {
        kind: std::io::ErrorKind,
        reason: String,
    },
}

/// Why a GPU source cannot be read as described ([`Error::SourceLayout`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SourceProblem {
    /// The strides do not give one stride per axis.
    #[error("{strides} strides given for the {rank}-axis shape {shape:?}")]
    StrideCount {
        strides: usize,
        rank: usize,
        shape: Vec<usize>,
    },
    /// GPU sources hold elements (f32, f16 or bf16); quantized rows cannot be read element by element.
    #[error(
        "the source is declared {dtype}; GPU sources hold f32, f16 or bf16 elements (quantized \
         storage quantizes them on append)"
    )]
    QuantizedSource { dtype: DType },
    /// The source is the destination slot's own buffer.
    #[error("the source is the destination slot's own buffer")]
    IsDestination,
    /// The source cannot be copied and lacks the `STORAGE` usage the slab-write kernel needs.
    #[error("the buffer's usage {usage:?} lacks STORAGE, which the slab-write kernel needs: {why}")]
    NeedsStorage {
        usage: wgpu::BufferUsages,
        why: CopyBlocker,
    },
    /// The buffer is mapped for the host, whole or in part, or a `map_async` of it is still
    /// pending; the GPU cannot use it until it is unmapped.
    #[error("the buffer is mapped for the host; unmap it first")]
    Mapped,
    /// The app destroyed the buffer.
    #[error("the buffer was destroyed")]
    Destroyed,
    /// The buffer is invalid: its creation failed with a validation error. (In the browser WebGPU
    /// reports one at submit instead.)
    #[error("the buffer is invalid: its creation failed")]
    Invalid,
    /// More non-contiguous trailing axes than the slab-write kernel walks.
    #[error("{axes} non-contiguous trailing axes; at most {max} are supported")]
    TooManyAxes { axes: usize, max: usize },
    /// The bytes the source spans exceed one storage binding of the device.
    #[error(
        "the source spans {bytes} bytes, more than one storage binding of this device holds ({limit})"
    )]
    BindingTooLarge { bytes: u64, limit: u64 },
}

/// Why a source is not a plain copy ([`SourceProblem::NeedsStorage`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CopyBlocker {
    /// It holds another element type than the cache stores.
    #[error("it holds {held} and the cache stores {storage}")]
    Type { held: DType, storage: DType },
    /// Its rows or elements are strided.
    #[error("it is strided")]
    Strided,
    /// Copies move whole words: the start or the row length is not a multiple of 4 bytes.
    #[error(
        "a copy must start on a 4-byte boundary with unpadded rows, and this one starts at byte \
         {start} with {row_bytes}-byte rows"
    )]
    Unaligned { start: u64, row_bytes: u64 },
    /// It lacks `COPY_SRC`.
    #[error("it lacks COPY_SRC too")]
    NoCopySrc,
}

/// Why a cache description is unusable ([`Error::InvalidSpec`]).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum SpecProblem {
    /// The spec has no layer.
    #[error("the cache has no layers")]
    NoLayers,
    /// `max_seq_len` is 0.
    #[error("max_seq_len is 0; the cache must hold at least one row")]
    ZeroCapacity,
    /// No layer has a slot.
    #[error("none of the {n_layers} layers has a slot; nothing to cache")]
    NoSlots { n_layers: usize },
    /// A slot's trailing shape has a dimension of 0.
    #[error(
        "layer {layer} slot {slot} ({name}): trailing shape {} has a zero dimension",
        shape(.trailing)
    )]
    ZeroDimension {
        layer: usize,
        slot: usize,
        name: String,
        trailing: Vec<usize>,
    },
    /// A slot's row has more than `u32::MAX` elements, or its `max_seq_len` rows come to more
    /// than `u64::MAX / 4` bytes.
    #[error(
        "layer {layer} slot {slot} ({name}): trailing shape {} x {max_seq_len} rows is too large",
        shape(.trailing)
    )]
    TooLarge {
        layer: usize,
        slot: usize,
        name: String,
        trailing: Vec<usize>,
        max_seq_len: usize,
    },
    /// A block-quantized type needs the innermost trailing dimension to be whole blocks (none is
    /// padded: a padded block would cost its whole scale and values for a few elements).
    #[error(
        "layer {layer} slot {slot} ({name}): innermost dimension {width} is not a multiple of \
         {dtype}'s block of {block} elements"
    )]
    BlockWidth {
        layer: usize,
        slot: usize,
        name: String,
        width: usize,
        dtype: DType,
        block: usize,
    },
    /// The rows of every slot at full capacity come to more than `u64::MAX / 4` bytes.
    #[error("the {n_layers} layers x {max_seq_len} rows come to more bytes than kvgpu can count")]
    TotalTooLarge { n_layers: usize, max_seq_len: usize },
    /// [`CacheSpec::uniform`](crate::CacheSpec::uniform) was asked for more than
    /// [`MAX_LAYERS`](crate::MAX_LAYERS) layers.
    #[error("{n_layers} layers; at most {max} are supported")]
    TooManyLayers { n_layers: usize, max: usize },
    /// The layers' slot names and shapes take more than
    /// [`MAX_DESCRIPTION_BYTES`](crate::MAX_DESCRIPTION_BYTES) to describe, counted as a snapshot
    /// header stores them.
    #[error(
        "the {n_layers} layers' slot names and shapes take {bytes} bytes to describe; at most {max}"
    )]
    DescriptionTooLarge {
        n_layers: usize,
        bytes: u64,
        max: u64,
    },
    /// [`CacheSpec::preset`](crate::CacheSpec::preset) was given a name it does not know.
    #[error("unknown preset {name:?}; known: llama3-8b, qwen3-0.6b, deepseek-v2-lite, hybrid")]
    UnknownPreset { name: String },
    /// [`CacheSpec::with_slot_dtype`](crate::CacheSpec::with_slot_dtype) named no slot of the spec.
    #[error(
        "no slot is named {name:?} (the slots: {}), so none can take its own storage type",
        .names.join(", ")
    )]
    UnknownSlotName { name: String, names: Vec<String> },
    /// A slot not stored as fp8 has a scale.
    #[error("layer {layer} slot {slot} ({name:?}) is {dtype}: only fp8 slots take a scale")]
    ScaleNotFp8 {
        layer: usize,
        slot: usize,
        name: String,
        dtype: DType,
    },
    /// An fp8 slot's scale is not a positive normal number with a normal reciprocal, or its product
    /// with the slot's largest fp8 value is not finite.
    #[error(
        "layer {layer} slot {slot} ({name:?}) has the scale {scale}; a scale is a positive normal \
         number whose reciprocal is normal too (2^-126 <= scale <= 2^126), and the slot's largest fp8 \
         value times it is finite (a scale of at most about 7.6e35 for e4m3, 5.9e33 for e5m2)"
    )]
    BadScale {
        layer: usize,
        slot: usize,
        name: String,
        scale: f32,
    },
}

/// Why attention cannot use a query or output buffer ([`Error::AttentionBuffer`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BufferProblem {
    /// Its usage lacks `STORAGE`.
    #[error("its usage {usage:?} lacks STORAGE")]
    NoStorage { usage: wgpu::BufferUsages },
    /// The binding its view needs (from the device's offset alignment below its first element to
    /// the end of its last) is larger than one storage binding of the device.
    #[error(
        "shape {shape:?} takes {bytes} bytes, more than one storage binding of this device holds \
         ({limit}); split the queries"
    )]
    BindingTooLarge {
        shape: Vec<usize>,
        bytes: u64,
        limit: u64,
    },
    /// The output is one of the cache's own slot buffers.
    #[error("it is one of the cache's own slot buffers")]
    IsSlot,
    /// It is mapped for the host, whole or in part (in the browser also while a mapping of it is
    /// pending).
    #[error("it is mapped for the host; unmap it first")]
    Mapped,
    /// The app destroyed it.
    #[error("it was destroyed")]
    Destroyed,
    /// Its creation failed (as [`SourceProblem::Invalid`]).
    #[error("it is invalid: its creation failed")]
    Invalid,
    /// The view's last element lies beyond any index kvgpu can count.
    #[error(
        "shape {shape:?} from element {offset} along strides {strides:?} overflows: its last element \
         lies past any buffer"
    )]
    Overflow {
        shape: Vec<usize>,
        offset: usize,
        strides: Vec<usize>,
    },
    /// An output view whose strides lead two elements to one address (the axes, from the smallest
    /// stride up, must each step over everything the smaller ones span).
    #[error(
        "strides {strides:?} over shape {shape:?} write some elements to the same address; each axis \
         must step over everything the axes of smaller stride span"
    )]
    Overlapping {
        shape: Vec<usize>,
        strides: Vec<usize>,
    },
    /// The output's bytes overlap those of a query view in the same buffer.
    #[error("its bytes {out:?} overlap bytes {queries:?} of {which}, which attention still reads")]
    AliasesQueries {
        which: &'static str,
        out: (u64, u64),
        queries: (u64, u64),
    },
}

/// Why an attention call is refused ([`Error::AttentionRequest`]).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum AttentionProblem {
    /// The scale ([`AttentionOptions::scale`](crate::AttentionOptions::scale), or its default) is
    /// infinite, NaN or subnormal (0 is taken).
    #[error("scale {scale} must be finite and not subnormal")]
    Scale { scale: f32 },
    /// The soft-cap is not a positive normal number of at most
    /// [`MAX_SOFT_CAP`](crate::MAX_SOFT_CAP) (2^100).
    #[error("soft-cap {cap} must be positive, not subnormal and at most 2^100")]
    SoftCap { cap: f32 },
    /// A sliding window of 0 rows.
    #[error("a sliding window of 0 rows sees nothing")]
    EmptyWindow,
    /// A batch of sequences whose query counts do not add up to the queries given.
    #[error("the batch's sequences take {batch} queries but {queries} were given")]
    BatchRows {
        /// The queries the sequences' counts add up to: `usize::MAX` where their sum overflows.
        batch: usize,
        queries: usize,
    },
    /// A batch that names no sequence.
    #[error("the batch names no sequence")]
    EmptyBatch,
    /// The call needs more than the device allows: `limit` says which, for the app to react
    /// (split a batch, shorten a call, let [`crate::KernelChoice::Auto`] choose), `detail` the
    /// numbers.
    #[error("{detail}")]
    DeviceLimit {
        limit: AttentionLimit,
        detail: String,
    },
}

/// Which of the device's limits an attention call is past ([`AttentionProblem::DeviceLimit`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum AttentionLimit {
    /// Storage buffers per shader stage or bind groups: attention binds 8 storage buffers in 3
    /// groups, and no call runs on this device.
    Bindings,
    /// Workgroups per dispatch dimension: more queries, query heads or KV heads (times head
    /// batches) in one call than one dimension holds. Where it is the queries, fewer per call fit.
    Workgroups,
    /// A ragged batch's query table past what one storage binding holds (a smaller batch fits), or
    /// one sequence's row or page-table entry past what a table entry holds (2^30).
    QueryTable,
    /// More rows than the device can split and merge for one query within its limits (loop
    /// iterations, workgroups, one binding of partial results, beside a batch's query table).
    Rows,
    /// Head dimensions so wide that one tile of rows passes the loop iterations every adapter runs.
    HeadSize,
    /// Workgroup memory: the tiled kernel's tile does not fit.
    WorkgroupMemory,
    /// The kernel chosen with [`crate::Attention::set_kernel`] cannot take this shape on this device,
    /// or the device refused to build it: [`crate::KernelChoice::Auto`] chooses one that can (under
    /// Auto itself: the device refused the tiled kernel too).
    Kernel,
}

/// Shorthand used throughout kvgpu.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// A shape as errors show it: `[2, 64]`, or its first 8 dimensions and how many more (a shape
/// parsed from a hostile snapshot header may have millions).
fn shape(dims: &[usize]) -> impl std::fmt::Display + '_ {
    shape_of(dims, dims.len())
}

/// The dimensions of [`SnapshotProblem::SlotShape`]'s snapshot shape that the error keeps.
pub(crate) const SHAPE_KEPT: usize = 8;

/// A shape of `rank` dimensions of which `dims` holds the first ones (all, or at least
/// [`SHAPE_KEPT`]): at most `SHAPE_KEPT` shown, then a count of the rest.
fn shape_of(dims: &[usize], rank: usize) -> impl std::fmt::Display + '_ {
    struct Shape<'a>(&'a [usize], usize);
    impl std::fmt::Display for Shape<'_> {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            let (dims, rank) = (self.0, self.1);
            write!(f, "{:?}", &dims[..dims.len().min(SHAPE_KEPT)])?;
            if rank > SHAPE_KEPT {
                write!(f, " and {} more dimensions", rank - SHAPE_KEPT)?;
            }
            Ok(())
        }
    }
    Shape(dims, rank)
}
