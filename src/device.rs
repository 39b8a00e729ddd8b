//! Adapter and device helpers for apps and tests: the backend from `WGPU_BACKEND`, the adapter from
//! `WGPU_ADAPTER_NAME`, the adapter's full limits, and `SHADER_F16` / `TIMESTAMP_QUERY` / `SUBGROUP` /
//! `SHADER_INT64` when present.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll, Waker};

use crate::error::{Error, Result};
use crate::kernels::{Held, held, queue_belongs_to};
use crate::spec::DeviceLimits;

/// How to get an adapter, for errors that find none.
#[cfg(not(target_arch = "wasm32"))]
pub const INSTALL_HINT: &str = "install a software adapter (Debian: `apt-get install mesa-vulkan-drivers \
     libvulkan1` for Vulkan lavapipe; Mesa's EGL + llvmpipe for OpenGL) or choose another backend with \
     WGPU_BACKEND=vulkan|gl|metal|dx12";

/// How to get an adapter, for errors that find none.
#[cfg(target_arch = "wasm32")]
pub const INSTALL_HINT: &str = "use a browser with WebGPU enabled (Chromium: `--enable-unsafe-webgpu` \
     gives SwiftShader's software adapter where no GPU is available)";

/// An adapter with its device and queue.
#[derive(Debug, Clone)]
pub struct Gpu {
    pub adapter: wgpu::Adapter,
    pub device: wgpu::Device,
    pub queue: wgpu::Queue,
}

impl Gpu {
    /// Opens the adapter chosen by `WGPU_BACKEND` and `WGPU_ADAPTER_NAME` (a case-insensitive substring
    /// of the adapter name; an unmatched name is an error listing the adapters found). In the browser,
    /// which has no environment, the page's default WebGPU adapter.
    pub async fn from_env() -> Result<Gpu> {
        let backends = backends_from(std::env::var("WGPU_BACKEND").ok().as_deref())?;
        let name = std::env::var("WGPU_ADAPTER_NAME")
            .ok()
            .filter(|n| !n.is_empty());
        Self::open(backends, name.as_deref()).await
    }

    /// [`Gpu::from_env`], blocking (native only).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn from_env_blocking() -> Result<Gpu> {
        pollster::block_on(Self::from_env())
    }

    /// Opens an adapter of `backends`, the first whose name contains `name` when one is given.
    ///
    /// Natively every call for the same `backends` opens its device on one wgpu instance, kept for
    /// the process: wgpu 30 tells devices and buffers apart by their id within an instance, and ids
    /// of two instances coincide, so a cache or buffer of another `Gpu` could not be refused as
    /// [`Error::ForeignDevice`] if each had its own (it would reach wgpu, which panics or takes the
    /// other instance's object of the same id). The same holds for devices of instances the app
    /// makes, and of two `Gpu`s opened for different `backends`: their objects must not be mixed.
    pub async fn open(backends: wgpu::Backends, name: Option<&str>) -> Result<Gpu> {
        let instance = instance(backends);
        let adapter = match name {
            Some(name) => pick_by_name(&instance, backends, name).await?,
            None => instance
                .request_adapter(&wgpu::RequestAdapterOptions {
                    power_preference: wgpu::PowerPreference::HighPerformance,
                    ..Default::default()
                })
                .await
                .map_err(|e| Error::AdapterNotFound {
                    reason: format!("backends {backends:?}: {e}; {INSTALL_HINT}"),
                })?,
        };
        Self::with_adapter(adapter).await
    }

    /// Opens kvgpu's device on an adapter the app chose (one that can present to its surface, say):
    /// the adapter's full limits and the features of [`features_for`]. The adapter's instance is
    /// the app's: objects of another instance (another `Gpu::open`'s) must not be mixed with it.
    pub async fn with_adapter(adapter: wgpu::Adapter) -> Result<Gpu> {
        let (device, queue) = adapter
            .request_device(&wgpu::DeviceDescriptor {
                label: Some("kvgpu"),
                required_features: features_for(&adapter),
                required_limits: adapter.limits(),
                ..Default::default()
            })
            .await
            .map_err(|e| Error::RequestDevice {
                reason: e.to_string(),
            })?;
        Ok(Gpu {
            adapter,
            device,
            queue,
        })
    }

    /// `name (backend, device type)` of the adapter.
    pub fn describe(&self) -> String {
        let info = self.adapter.get_info();
        format!("{} ({:?}, {:?})", info.name, info.backend, info.device_type)
    }

    /// The limits a cache is checked against.
    pub fn limits(&self) -> DeviceLimits {
        DeviceLimits::from_wgpu(&self.device.limits())
    }
}

/// The features of `adapter` that [`Gpu::open`] requests, for a device an app makes itself:
/// `SUBGROUP` (attention sums a row's dot products across a subgroup) and `SHADER_INT64` (attention
/// on a CPU adapter loads its rows in 64-bit words), which kvgpu's kernels use where the device has
/// them; `TIMESTAMP_QUERY` (the benchmarks' GPU timings) and `SHADER_F16` (for the app's own
/// kernels; kvgpu's use none). kvgpu runs without any of them.
pub fn features_for(adapter: &wgpu::Adapter) -> wgpu::Features {
    adapter.features()
        & (wgpu::Features::SHADER_F16
            | wgpu::Features::TIMESTAMP_QUERY
            | wgpu::Features::SUBGROUP
            | wgpu::Features::SHADER_INT64)
}

/// The wgpu instance of `backends`: natively one per value for the process (see [`Gpu::open`]).
fn instance(backends: wgpu::Backends) -> wgpu::Instance {
    let make = || {
        wgpu::Instance::new(wgpu::InstanceDescriptor {
            backends,
            ..wgpu::InstanceDescriptor::new_without_display_handle_from_env()
        })
    };
    #[cfg(not(target_arch = "wasm32"))]
    {
        static INSTANCES: Mutex<Vec<(wgpu::Backends, wgpu::Instance)>> = Mutex::new(Vec::new());
        let mut made = INSTANCES.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some((_, instance)) = made.iter().find(|(b, _)| *b == backends) {
            return instance.clone();
        }
        let instance = make();
        made.push((backends, instance.clone()));
        instance
    }
    #[cfg(target_arch = "wasm32")]
    make()
}

/// The backends a `WGPU_BACKEND` value names (all of them when unset or empty); a value that names
/// none is an error saying which names exist.
fn backends_from(value: Option<&str>) -> Result<wgpu::Backends> {
    let Some(value) = value.filter(|v| !v.trim().is_empty()) else {
        return Ok(default_backends());
    };
    let backends = wgpu::Backends::from_comma_list(value);
    if backends.is_empty() {
        return Err(Error::AdapterNotFound {
            reason: format!(
                "WGPU_BACKEND={value:?} names no backend; use one or more of vulkan, metal, dx12, \
                 gl, webgpu (comma-separated), or unset it for all"
            ),
        });
    }
    Ok(backends)
}

fn default_backends() -> wgpu::Backends {
    if cfg!(target_arch = "wasm32") {
        wgpu::Backends::BROWSER_WEBGPU
    } else {
        wgpu::Backends::all()
    }
}

async fn pick_by_name(
    instance: &wgpu::Instance,
    backends: wgpu::Backends,
    name: &str,
) -> Result<wgpu::Adapter> {
    let adapters = instance.enumerate_adapters(backends).await;
    let wanted = name.to_lowercase();
    let seen: Vec<String> = adapters
        .iter()
        .map(|a| format!("{} ({:?})", a.get_info().name, a.get_info().backend))
        .collect();
    let found = adapters
        .into_iter()
        .find(|a| a.get_info().name.to_lowercase().contains(&wanted));
    match found {
        Some(adapter) => Ok(adapter),
        None => Err(Error::AdapterNotFound {
            reason: format!(
                "WGPU_ADAPTER_NAME={name:?} matches none of the adapters of {backends:?}: [{}]",
                seen.join(", ")
            ),
        }),
    }
}

/// A one-shot channel for map callbacks: works on native and in the browser without an executor.
/// A sender dropped without sending (a callback wgpu let go of unfired) ends the receiver's wait
/// with `None`, so a readback fails instead of waiting forever.
pub(crate) fn oneshot<T>() -> (Sender<T>, Receiver<T>) {
    let shared = Arc::new(Mutex::new(Slot {
        value: None,
        waker: None,
        closed: false,
    }));
    (Sender(shared.clone()), Receiver(shared))
}

struct Slot<T> {
    value: Option<T>,
    waker: Option<Waker>,
    /// The sender is gone: no value comes after this one.
    closed: bool,
}

pub(crate) struct Sender<T>(Arc<Mutex<Slot<T>>>);
pub(crate) struct Receiver<T>(Arc<Mutex<Slot<T>>>);

impl<T> Sender<T> {
    /// Hands over `value` and wakes the receiver's task (when the sender drops, just after).
    pub(crate) fn send(self, value: T) {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).value = Some(value);
    }
}

impl<T> Drop for Sender<T> {
    /// Closes the channel and wakes the receiver's task, after letting go of the lock (an executor
    /// that polls the task at once locks it again).
    fn drop(&mut self) {
        let waker = {
            let mut slot = self.0.lock().unwrap_or_else(PoisonError::into_inner);
            slot.closed = true;
            slot.waker.take()
        };
        if let Some(w) = waker {
            w.wake();
        }
    }
}

impl<T> Future for Receiver<T> {
    /// The value sent, or `None` where the sender was dropped without one.
    type Output = Option<T>;
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<T>> {
        let mut slot = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        match slot.value.take() {
            Some(v) => Poll::Ready(Some(v)),
            None if slot.closed => Poll::Ready(None),
            None => {
                slot.waker = Some(cx.waker().clone());
                Poll::Pending
            }
        }
    }
}

/// Copies `size` bytes at `offset` of an app's `buffer` to the host: for checking an attention output
/// or any buffer the app wrote. The buffer needs `COPY_SRC`; `offset` and `size` must be multiples of
/// 4 inside the buffer. On native this waits for the GPU; in the browser it resolves when the map
/// callback fires. A buffer mapped for the host, or with a `map_async` still pending, is refused
/// with [`Error::Device`] (kvgpu's other calls refuse such buffers too, but for attention's
/// queries and outputs, whose pending mappings only the browser sees).
pub async fn read_buffer_async(
    device: &wgpu::Device,
    queue: &wgpu::Queue,
    buffer: &wgpu::Buffer,
    offset: u64,
    size: u64,
) -> Result<Vec<u8>> {
    let refuse = |reason: String| Err(Error::Device { reason });
    if !buffer.usage().contains(wgpu::BufferUsages::COPY_SRC) {
        return refuse(format!(
            "cannot read back a buffer whose usage {:?} lacks COPY_SRC",
            buffer.usage()
        ));
    }
    if !offset.is_multiple_of(4) || !size.is_multiple_of(4) {
        return refuse(format!(
            "a readback range must start and end on 4-byte boundaries, not at byte {offset} for {size} bytes"
        ));
    }
    if offset
        .checked_add(size)
        .is_none_or(|end| end > buffer.size())
    {
        return refuse(format!(
            "bytes {offset}..{offset}+{size} are outside the {}-byte buffer",
            buffer.size()
        ));
    }
    match held(buffer) {
        Held::Mapped => {
            return refuse(
                "cannot read back a buffer that is mapped for the host; unmap it first".into(),
            );
        }
        Held::Destroyed => {
            return refuse("cannot read back a destroyed buffer".into());
        }
        Held::Invalid => {
            return refuse("cannot read back an invalid buffer (its creation failed)".into());
        }
        Held::No => {}
    }
    if !queue_belongs_to(device, queue) {
        return Err(Error::QueueMismatch);
    }
    read_ranges::<u8>(device, queue, buffer, &[(offset, size)])
        .await
        .map_err(|failure| failure.or(|reason| Error::Device { reason }))
}

/// [`read_buffer_async`], blocking (native only).
#[cfg(not(target_arch = "wasm32"))]
pub fn read_buffer(
    device: &wgpu::Device,
    queue: &wgpu::Queue,
    buffer: &wgpu::Buffer,
    offset: u64,
    size: u64,
) -> Result<Vec<u8>> {
    pollster::block_on(read_buffer_async(device, queue, buffer, offset, size))
}

/// Why a readback failed: an error of its own kind ([`Error::DeviceLost`]), or a reason for the
/// caller's error to give ([`ReadFailure::or`]).
pub(crate) enum ReadFailure {
    Typed(Error),
    Failed(String),
}

impl ReadFailure {
    /// The error: a typed one as it is, a reason as `refused` names it.
    pub(crate) fn or(self, refused: impl FnOnce(String) -> Error) -> Error {
        match self {
            Self::Typed(e) => e,
            Self::Failed(reason) => refused(reason),
        }
    }
}

impl From<String> for ReadFailure {
    fn from(reason: String) -> Self {
        Self::Failed(reason)
    }
}

/// The bytes of checked ranges `(offset, size)` of `buffer`, one after the other, in one readback,
/// as elements of `T` (whole ones: the ranges' bytes are a multiple of its size).
pub(crate) async fn read_ranges<T: bytemuck::Pod>(
    device: &wgpu::Device,
    queue: &wgpu::Queue,
    buffer: &wgpu::Buffer,
    ranges: &[(u64, u64)],
) -> std::result::Result<Vec<T>, ReadFailure> {
    match Readback::start(device, queue, buffer, ranges).await? {
        Some(readback) => Ok(readback.finish(device).await?),
        None => Ok(Vec::new()),
    }
}

/// A readback under way: the copy of some ranges of a buffer is submitted and its staging buffer is
/// being mapped. Starting the next one before finishing this lets the device copy while the host
/// works on these bytes (an export checksums and writes one slot while the next is read back).
pub(crate) struct Readback {
    staging: Staging,
    size: u64,
    index: wgpu::SubmissionIndex,
    mapped: Receiver<std::result::Result<(), wgpu::BufferAsyncError>>,
}

/// The bytes a readback of `ranges` `(offset, size)` copies.
pub(crate) fn ranges_bytes(ranges: &[(u64, u64)]) -> u64 {
    ranges.iter().map(|r| r.1).sum()
}

/// A staging buffer of a readback. In the browser it is destroyed when dropped, so that its memory
/// goes then (nothing but kvgpu's readback holds it): wgpu 30 does not destroy a dropped WebGPU
/// buffer, and its memory waited for the page's garbage collection after every read and export.
/// Natively a drop frees it already, and `destroy` would wait for every other thread's poll of the
/// device (wgpu-core takes its resource lock for writing).
pub(crate) struct Staging(wgpu::Buffer);

impl Drop for Staging {
    fn drop(&mut self) {
        #[cfg(target_arch = "wasm32")]
        self.0.destroy();
    }
}

impl std::ops::Deref for Staging {
    type Target = wgpu::Buffer;
    fn deref(&self) -> &wgpu::Buffer {
        &self.0
    }
}

/// A staging buffer of `size` bytes for readbacks, or why the device could not allocate it (the
/// error scope is awaited, so the browser answers too; natively a lost device is
/// [`Error::DeviceLost`]).
pub(crate) async fn staging_buffer(
    device: &wgpu::Device,
    size: u64,
) -> std::result::Result<Staging, ReadFailure> {
    let scope = device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
    let staging = device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("kvgpu readback"),
        size,
        usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    });
    match scope.pop().await {
        None => match crate::kernels::made_alive(&staging, "the readback's staging buffer") {
            Err(lost) => Err(ReadFailure::Typed(lost)),
            Ok(()) => Ok(Staging(staging)),
        },
        Some(e) => Err(format!(
            "the device could not allocate a staging buffer of {size} bytes for the readback: {e}"
        )
        .into()),
    }
}

impl Readback {
    /// Submits the copy of checked ranges `(offset, size)` of `buffer`, one after the other, into a
    /// staging buffer and asks for its mapping; `None` when they hold no byte.
    pub(crate) async fn start(
        device: &wgpu::Device,
        queue: &wgpu::Queue,
        buffer: &wgpu::Buffer,
        ranges: &[(u64, u64)],
    ) -> std::result::Result<Option<Self>, ReadFailure> {
        let size = ranges_bytes(ranges);
        if size == 0 {
            return Ok(None);
        }
        // The bytes come back in one host allocation: past isize::MAX (2 GiB on wasm32, where a
        // device may allow 4 GiB buffers) none holds them.
        if size > isize::MAX as u64 {
            return Err(format!(
                "a readback of {size} bytes is more than one allocation of this target holds \
                 ({} bytes)",
                isize::MAX
            )
            .into());
        }
        // A buffer of another device may be larger than any of this one.
        let largest = device.limits().max_buffer_size;
        if size > largest {
            return Err(format!(
                "a readback of {size} bytes needs a staging buffer larger than this device's \
                 largest buffer ({largest} bytes)"
            )
            .into());
        }
        let staging = staging_buffer(device, size).await?;
        Ok(Some(
            Self::start_in(device, queue, buffer, ranges, staging).await?,
        ))
    }

    /// [`Readback::start`] into `staging`, an unmapped buffer from [`staging_buffer`] of at least the
    /// ranges' bytes (a buffer used again saves the host from paging in new memory for every copy).
    pub(crate) async fn start_in(
        device: &wgpu::Device,
        queue: &wgpu::Queue,
        buffer: &wgpu::Buffer,
        ranges: &[(u64, u64)],
        staging: Staging,
    ) -> std::result::Result<Self, String> {
        let size = ranges_bytes(ranges);
        // Recorded in an error scope, so a buffer of another device is an error here, not a wgpu
        // panic (or a silent zero read inside an error scope of the app's). The scope is awaited:
        // in a browser it answers only in a later task.
        let scope = device.push_error_scope(wgpu::ErrorFilter::Validation);
        let mut encoder = device.create_command_encoder(&wgpu::CommandEncoderDescriptor {
            label: Some("kvgpu readback"),
        });
        let mut at = 0;
        for &(offset, n) in ranges.iter().filter(|r| r.1 > 0) {
            encoder.copy_buffer_to_buffer(buffer, offset, &staging, at, n);
            at += n;
        }
        let commands = encoder.finish();
        if let Some(e) = scope.pop().await {
            return Err(format!("wgpu refused the copy: {e}"));
        }
        // The submission in a scope of its own: WebGPU checks a buffer's destroyed state only there
        // (the browser's `held` cannot see it), and the copy of a buffer destroyed meanwhile would
        // otherwise leave the staging buffer as it was and be read as the buffer's bytes.
        let scope = device.push_error_scope(wgpu::ErrorFilter::Validation);
        let index = queue.submit([commands]);
        if let Some(e) = scope.pop().await {
            return Err(format!(
                "the device refused the copy when it was submitted (a buffer destroyed, or mapped \
                 or being mapped for the host?): {e}"
            ));
        }
        let (tx, mapped) = oneshot();
        staging.map_async(wgpu::MapMode::Read, ..size, move |r| tx.send(r));
        Ok(Self {
            staging,
            size,
            index,
            mapped,
        })
    }

    /// Waits for this readback alone (not for work submitted after it) and copies its bytes out,
    /// as elements of `T` ([`Mapped::to_vec`]).
    pub(crate) async fn finish<T: bytemuck::Pod>(
        self,
        device: &wgpu::Device,
    ) -> std::result::Result<Vec<T>, String> {
        self.mapped(device).await?.to_vec()
    }

    /// Waits for this readback alone (not for work submitted after it) until its bytes are mapped.
    pub(crate) async fn mapped(self, device: &wgpu::Device) -> std::result::Result<Mapped, String> {
        #[cfg(not(target_arch = "wasm32"))]
        device
            .poll(wgpu::PollType::Wait {
                submission_index: Some(self.index),
                timeout: None,
            })
            .map_err(|e| e.to_string())?;
        #[cfg(target_arch = "wasm32")]
        let _ = (device, self.index);
        self.mapped
            .await
            .ok_or("wgpu dropped the mapping's callback without calling it (a lost device?)")?
            .map_err(|e| e.to_string())?;
        Ok(Mapped {
            staging: self.staging,
            size: self.size,
        })
    }
}

/// The bytes of a finished [`Readback`], mapped on the host until [`Mapped::release`] (or a drop,
/// which frees the staging buffer with them).
pub(crate) struct Mapped {
    staging: Staging,
    size: u64,
}

/// Bytes of the mapped range a browser copies at a time into wasm memory ([`Mapped::pieces`]).
#[cfg(target_arch = "wasm32")]
const PIECE: usize = 1 << 20;

impl Mapped {
    fn view(&self) -> std::result::Result<wgpu::BufferView, String> {
        self.staging
            .get_mapped_range(..self.size)
            .map_err(|e| e.to_string())
    }

    /// The bytes, copied as elements of `T` (bytes, or the words a slot stores) into memory of
    /// their own, the one copy on the host: refused, not aborted, where the host has no room for
    /// them. In the browser they come straight from the mapped `ArrayBuffer` (wgpu's WebGPU view
    /// would first copy the whole range into wasm memory, infallibly).
    pub(crate) fn to_vec<T: bytemuck::Pod>(&self) -> std::result::Result<Vec<T>, String> {
        let size = self.size as usize;
        let each = std::mem::size_of::<T>();
        if !size.is_multiple_of(each) {
            return Err(format!(
                "{size} bytes read back are not whole elements of {each} bytes"
            ));
        }
        let view = self.view()?;
        let mut out: Vec<T> = Vec::new();
        out.try_reserve_exact(size / each)
            .map_err(|_| format!("the host has no room for the {size} bytes read back"))?;
        out.resize(size / each, T::zeroed());
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut out);
        #[cfg(not(target_arch = "wasm32"))]
        bytes.copy_from_slice(&view);
        #[cfg(target_arch = "wasm32")]
        view.as_uint8array().copy_to(bytes);
        Ok(out)
    }

    /// Hands the bytes to `f` in order, in pieces: natively all at once, in the browser a
    /// megabyte at a time copied out of the mapped `ArrayBuffer` (see [`Mapped::to_vec`]). Stops
    /// at `f`'s first error.
    pub(crate) fn pieces<E>(
        &self,
        mut f: impl FnMut(&[u8]) -> std::result::Result<(), E>,
    ) -> std::result::Result<std::result::Result<(), E>, String> {
        let view = self.view()?;
        #[cfg(not(target_arch = "wasm32"))]
        return Ok(f(&view));
        #[cfg(target_arch = "wasm32")]
        {
            let array = view.as_uint8array();
            // Slot and pool buffers are under 4 GiB (`DeviceLimits::max_slot_bytes`), so the
            // offsets below fit 32 bits.
            debug_assert!(self.size <= u64::from(u32::MAX));
            let size = self.size as usize;
            let mut piece = Vec::new();
            piece.try_reserve_exact(PIECE.min(size)).map_err(|_| {
                "the host has no room for a piece of the bytes read back".to_string()
            })?;
            piece.resize(PIECE.min(size), 0);
            let mut at = 0;
            while at < size {
                let n = PIECE.min(size - at);
                array
                    .subarray(at as u32, (at + n) as u32)
                    .copy_to(&mut piece[..n]);
                if let Err(e) = f(&piece[..n]) {
                    return Ok(Err(e));
                }
                at += n;
            }
            Ok(Ok(()))
        }
    }

    /// Unmaps the bytes and gives the staging buffer back for another readback.
    pub(crate) fn release(self) -> Staging {
        self.staging.unmap();
        self.staging
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[cfg(not(target_arch = "wasm32"))]
    fn a_receiver_gets_the_value_sent_or_none_when_the_sender_is_dropped() {
        let (tx, rx) = oneshot();
        tx.send(7);
        assert_eq!(pollster::block_on(rx), Some(7));
        // Dropped unsent while the receiver waits on another thread: the wait ends.
        let (tx, rx) = oneshot::<u32>();
        let waiter = std::thread::spawn(move || pollster::block_on(rx));
        std::thread::sleep(std::time::Duration::from_millis(50));
        drop(tx);
        assert_eq!(waiter.join().unwrap(), None);
        // Dropped before the receiver is polled.
        let (tx, rx) = oneshot::<u32>();
        drop(tx);
        assert_eq!(pollster::block_on(rx), None);
    }

    #[test]
    fn wgpu_backend_values_are_parsed_or_named_in_the_error() {
        assert_eq!(backends_from(Some("gl")).unwrap(), wgpu::Backends::GL);
        assert_eq!(
            backends_from(Some("vulkan,gl")).unwrap(),
            wgpu::Backends::VULKAN | wgpu::Backends::GL
        );
        assert_eq!(backends_from(None).unwrap(), default_backends());
        assert_eq!(backends_from(Some(" ")).unwrap(), default_backends());
        let e = backends_from(Some("foo")).unwrap_err();
        assert!(
            matches!(&e, Error::AdapterNotFound { reason } if reason.contains("\"foo\"") && reason.contains("vulkan")),
            "{e}"
        );
    }
}
