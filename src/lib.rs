//! kvgpu keeps the KV / latent cache of LLM inference on the GPU: one wgpu storage buffer per
//! (layer, slot), WGSL kernels for strided slab writes and zeroing, narrowed views for attention and the
//! app's own kernels, and a host [`Ledger`] that checks every operation completely before any command is
//! recorded — a refused operation returns an [`Error`] and changes nothing (but for the three cases
//! [`Error`] lists).
//!
//! ```
//! use kvgpu::{CacheSpec, DType, Gpu, HostSlab, KvCache};
//!
//! # #[cfg(not(target_arch = "wasm32"))] // blocking helpers are native only; see tests/web.rs
//! # fn main() -> kvgpu::Result<()> {
//! let gpu = Gpu::from_env_blocking()?; // WGPU_BACKEND / WGPU_ADAPTER_NAME pick the adapter
//! let spec = CacheSpec::deepseek_v2_lite(DType::BF16, 4096)?; // 27 layers of MLA latents
//! let mut cache = KvCache::new(&gpu.device, &gpu.queue, spec)?;
//!
//! // One decode step: every layer appends its token's compressed_kv [512] and k_pe [64]...
//! let (c_kv, k_pe) = (vec![0.5f32; 512], vec![0.25f32; 64]);
//! for layer in 0..27 {
//!     cache.append(layer, &[HostSlab::f32(&c_kv, &[1, 512]), HostSlab::f32(&k_pe, &[1, 64])])?;
//! }
//! // ...and the step commits once all of them have.
//! cache.advance(1)?;
//! assert_eq!(cache.len(), 1);
//! assert_eq!(cache.read_f32(26, 1)?, k_pe);
//!
//! // Attention and the app's kernels bind only the visible rows.
//! assert_eq!(cache.view(0, 0)?.size, 512 * 2);
//!
//! // Forgetting a layer is caught, and nothing changes.
//! cache.append(0, &[HostSlab::f32(&c_kv, &[1, 512]), HostSlab::f32(&k_pe, &[1, 64])])?;
//! assert!(cache.advance(1).is_err());
//! assert_eq!(cache.len(), 1);
//! # Ok(())
//! # }
//! # #[cfg(target_arch = "wasm32")]
//! # fn main() {}
//! ```
//!
//! The contract:
//! - `append(layer, slabs)` takes one slab `[n_new, ...trailing]` per slot, in slot order; rows land at
//!   `len + pending[layer]`. From the host ([`HostSlab`], f32 or the storage type; any of f32, f16 and
//!   bf16 for quantized storage) the rows go through
//!   `Queue::write_buffer` (natively, more than 4 MiB of them checked first for memory:
//!   [`Error::OutOfMemory`]). Rows in GPU buffers ([`GpuSlab`], any element type and strides;
//!   [`GpuSlab::contiguous`] for row-major rows from the buffer's start) go
//!   through [`KvCache::record_append_gpu`] instead, copied or converted by the slab-write kernel
//!   inside the caller's encoder ([`KvCache::append_gpu`] submits them on its own).
//!   [`KvCache::append_layers`] takes one slab list per layer (a whole decode step) and uploads all of
//!   it at once (steps up to 4 MiB; larger ones are written slot by slot), copied into place, instead
//!   of one write per slot; it checks every layer first. [`KvCache::record_append_layers`] records
//!   the copies into the caller's encoder, a step over 4 MiB in pieces of 4 MiB, so its rows land in
//!   the encoder's order, after a scrub or an attention recorded before them.
//! - `advance(n)` commits `n` rows once every layer with slots holds exactly `n` pending rows.
//! - Views, reads and attention of layer `l` see rows `[0, len + pending[l])`.
//! - Attention ([`Attention`]) reads its queries and writes its output through f32 views of the app's
//!   buffers ([`Queries`], [`Output`]: an element offset and strides, so Q can come straight out of a
//!   fused QKV projection and the output can land inside a larger buffer), checked like [`GpuSlab`]
//!   before anything is recorded.
//! - An app buffer of another device is refused before anything is recorded. In a browser, where
//!   WebGPU reports that only asynchronously, the app verifies each buffer once with
//!   [`verify_buffer`] and the synchronous calls refuse unverified ones ([`Error::UnverifiedBuffer`]).
//! - `truncate(new_len)` is O(1); `truncate_and_scrub` also zeroes the dropped rows. `reset()` zeroes the
//!   whole cache with one zeroing-kernel dispatch per slot buffer; `reset_fast()` only forgets.
//! - Each slot is one buffer, so a slot must fit one storage binding of the device (128 MiB on WebGPU's
//!   defaults): a larger one is refused with [`Error::SlotTooLarge`], which names the largest capacity
//!   that fits, rather than split.
//! - 16-bit types are stored packed in `u32` words and rows are padded to 4 bytes, so every adapter works
//!   without `shader-f16`; f32 → f16/bf16 conversion rounds to nearest even, bit-identical to `half`.
//! - Quantized storage ([`DType::Q8_0`], [`DType::Q4_0`], [`DType::F8E4M3`], [`DType::F8E5M2`]) takes
//!   0.53, 0.28 or 0.5 of f16's bytes: appends quantize (host rows on the CPU, GPU rows in the slab-write kernel), attention
//!   and reads dequantize, and every adapter stores the bits the CPU twin computes. The layout and the
//!   rounding are documented on [`DType`], `kvgpu::reference` has the twins. Slots may be stored in
//!   types of their own ([`CacheSpec::with_slot_dtype`]: keys in q8_0, values in q4_0), and fp8 slots
//!   may carry a scale ([`CacheSpec::with_slot_scale`]).
//!
//! Many sequences share one pool of GPU memory in a [`PagedCache`]: pages of token rows, sequences that
//! fork by sharing pages (a write into a shared page copies it for the writer, and a copy recorded into
//! the app's encoder keeps the page until the encoder is done), truncate and removal
//! that return pages (or zero them too: [`PagedCache::remove_and_scrub`]; pages an encoder recorded
//! over the sequence still reads or writes return once it is done), an admission check
//! ([`PagedCache::admits`], and [`PagedCache::admits_new`] for a request not yet a sequence), and
//! attention through the page tables over one sequence ([`Kv::Sequence`]) or a ragged batch of
//! sequences in one dispatch pair ([`Kv::Batch`]). Whole pages published under the tokens they hold
//! ([`PagedCache::publish_prefix`]) start later requests with the same prompt
//! ([`PagedCache::add_sequence_with_prefix`]) until evicted ([`PagedCache::evict_prefixes`],
//! [`PagedCache::evictable_pages`]).
//!
//! A sequence moves between processes, machines and backends as a snapshot: a versioned,
//! checksummed byte format of its committed rows ([`KvCache::export_async`],
//! [`PagedCache::export_sequence_async`]) that restores bit for bit into an empty cache or as a new
//! pool sequence of the same storage type and slot shapes ([`KvCache::import`],
//! [`PagedCache::import_sequence`], or piece by piece with [`KvCache::import_stream`] and
//! [`PagedCache::import_sequence_stream`]); truncated, corrupt or incompatible bytes are refused with
//! [`Error::Snapshot`] and change nothing. [`SnapshotHeader`] documents the format.
//!
//! Ordering: host appends take effect at the next queue submission, before the commands submitted with
//! it. Submit a recorded `record_reset` / `record_truncate_and_scrub` before appending from the host
//! rows that must survive it. Any number of operations may be recorded between two submissions: every
//! kernel dispatch reads its parameters from an entry of its own, never reused. A recorded append
//! ([`KvCache::record_append_gpu`], [`KvCache::record_append_layers`]) counts as made when it is
//! recorded: submit its encoder. If the encoder is dropped (or fails), `truncate` the cache back to
//! its length before the append, or the pending rows it counts hold whatever the slots held
//! before (an earlier sequence's rows after `truncate` or `reset_fast`).

// In the browser wgpu objects are not Send/Sync and everything runs on one thread; caches still share
// their pipelines through an `Arc` so native and wasm have one code path.
#![cfg_attr(target_arch = "wasm32", allow(clippy::arc_with_non_send_sync))]

mod attention;
mod cache;
mod codec;
mod device;
mod error;
mod kernels;
mod ledger;
mod paged;
mod placement;
pub mod reference;
mod seq;
mod snapshot;
mod spec;
mod verify;

/// The wgpu kvgpu is built with: use it for the devices and buffers you hand to kvgpu, so the versions
/// match.
pub use wgpu;

/// The `half` kvgpu is built with: [`HostSlab::f16`] and [`HostSlab::bf16`] take its `f16` and `bf16`.
pub use half;

pub use attention::{
    Attention, AttentionOptions, KernelChoice, Kv, MAX_SOFT_CAP, MlaQueries, Output, Queries,
};
pub use cache::{CacheImport, GpuSlab, HostSlab, KvCache, SlotView};
pub use codec::{DType, HostData};
#[cfg(not(target_arch = "wasm32"))]
pub use device::read_buffer;
pub use device::{Gpu, INSTALL_HINT, features_for, read_buffer_async};
pub use error::{
    AttentionLimit, AttentionProblem, BufferProblem, CopyBlocker, Error, Result, SnapshotProblem,
    SourceProblem, SpecProblem,
};
pub use kernels::Kernels;
pub use ledger::{AppendPlan, Ledger, SeqId};
pub use paged::{PageLedger, PagedCache, ScatterChoice, SequenceImport};
pub use placement::Run;
pub use snapshot::{SNAPSHOT_MAGIC, SNAPSHOT_VERSION, SnapshotHeader};
pub use spec::{CacheSpec, DeviceLimits, LayerSpec, MAX_DESCRIPTION_BYTES, MAX_LAYERS, SlotSpec};
pub use verify::{create_buffer, create_buffer_init, verify_buffer};

// Stored words are little-endian, and kvgpu views host slices and stored rows in place (f16 halves,
// fp8 bytes), which holds only where the host is little-endian too: a big-endian build is refused
// here instead of storing swapped elements.
#[cfg(target_endian = "big")]
compile_error!("kvgpu supports little-endian targets only: it views host slices as stored words");

// Natively the caches, the pool, attention and the registry may move to and be shared between
// threads (apps load layers or serve sequences on several): checked when the crate compiles, so
// that no later field takes it away.
#[cfg(not(target_arch = "wasm32"))]
const _: () = {
    const fn send_sync<T: Send + Sync>() {}
    send_sync::<KvCache>();
    send_sync::<PagedCache>();
    send_sync::<Attention>();
    send_sync::<Kernels>();
    send_sync::<Gpu>();
    send_sync::<Error>();
    send_sync::<CacheImport<'static>>();
    send_sync::<SequenceImport<'static>>();
};

// And the futures of the async forms are `Send` natively (an app spawns them on a multi-threaded
// executor): checked when the crate compiles. Never called.
#[cfg(not(target_arch = "wasm32"))]
#[allow(dead_code)]
fn async_forms_are_send(
    cache: &KvCache,
    pool: &PagedCache,
    seq: SeqId,
    device: &wgpu::Device,
    queue: &wgpu::Queue,
    buffer: &wgpu::Buffer,
    out: &mut Vec<u8>,
) {
    fn send<T: Send>(_: T) {}
    send(cache.read_words_async(0, 0));
    send(cache.read_full_words_async(0, 0));
    send(cache.read_f32_async(0, 0));
    send(cache.snapshot_async());
    send(pool.read_pool_words_async(0, 0));
    send(pool.read_words_async(seq, 0, 0));
    send(pool.read_f32_async(seq, 0, 0));
    send(pool.snapshot_sequence_async(seq));
    send(verify_buffer(device, buffer));
    send(read_buffer_async(device, queue, buffer, 0, 4));
    send(Gpu::from_env());
    send(Gpu::open(wgpu::Backends::all(), None));
    send(cache.export_async(out));
    send(pool.export_sequence_async(seq, out));
}
