//! Which device an app's buffer belongs to.
//!
//! wgpu refuses a bind group or a copy that names a buffer of another device, and such a refusal
//! would spoil the caller's encoder, so kvgpu checks every outside buffer before it records anything.
//! Natively wgpu answers an error scope at once and the synchronous calls check for themselves. A
//! browser cannot: WebGPU gives a `GPUBuffer` no `device` attribute and reports a mismatch only
//! through an error scope that resolves in a later task. There a buffer is verified once with
//! [`verify_buffer`] (async), kvgpu remembers it in a weak set of the device (which keeps neither
//! the buffer nor the device alive), and a synchronous call given a buffer it has not seen is
//! refused with [`Error::UnverifiedBuffer`] before anything is recorded.

use crate::error::{BufferProblem, Error, Result};
use crate::kernels::{Held, allocated, held};

/// Checks that kvgpu may bind or copy `buffer` on `device`, and remembers the answer where a
/// synchronous call cannot find it out itself (in a browser).
///
/// A buffer of another device is refused with [`Error::ForeignBuffer`]; natively, one the app
/// destroyed or whose creation failed with [`Error::UnusableBuffer`] (a browser does not tell: there
/// such a buffer is refused as another device's, or reported by WebGPU at submit, and a buffer
/// verified and then destroyed is still taken as verified: the submission holding a kvgpu command
/// that uses it fails, with the app's other commands in it, while the ledger counts the rows such
/// an append wrote). The probe binds the buffer's
/// first word as read-only storage when it has `STORAGE` usage, otherwise copies it when it has
/// `COPY_SRC`; nothing is submitted. A buffer with neither usage, or under 4 bytes, cannot be used
/// by kvgpu at all: it is not probed and returns `Ok`, and the calls that would use it refuse it
/// for its usage or size.
///
/// Natively this is optional (every call checks its buffers); in a browser every app buffer a
/// synchronous call binds (GPU append sources, attention queries and outputs) must be verified
/// once first. Buffers kvgpu made (a cache's slots, taken as another cache's source, and buffers
/// the app makes through [`create_buffer`] or [`create_buffer_init`]) need not be.
pub async fn verify_buffer(device: &wgpu::Device, buffer: &wgpu::Buffer) -> Result<()> {
    let usage = buffer.usage();
    let storage = usage.contains(wgpu::BufferUsages::STORAGE);
    if buffer.size() < 4 || !(storage || usage.contains(wgpu::BufferUsages::COPY_SRC)) {
        return Ok(());
    }
    // Asked first: the probe would fail on such a buffer too, and read as another device's.
    let problem = match held(buffer) {
        Held::Destroyed => Some(BufferProblem::Destroyed),
        Held::Invalid => Some(BufferProblem::Invalid),
        Held::No | Held::Mapped => None,
    };
    if let Some(problem) = problem {
        return Err(Error::UnusableBuffer { problem });
    }
    let scope = device.push_error_scope(wgpu::ErrorFilter::Validation);
    if storage {
        let layout = device.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
            label: Some("kvgpu buffer probe"),
            entries: &[wgpu::BindGroupLayoutEntry {
                binding: 0,
                visibility: wgpu::ShaderStages::COMPUTE,
                ty: wgpu::BindingType::Buffer {
                    ty: wgpu::BufferBindingType::Storage { read_only: true },
                    has_dynamic_offset: false,
                    min_binding_size: None,
                },
                count: None,
            }],
        });
        let _probe = device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some("kvgpu buffer probe"),
            layout: &layout,
            entries: &[wgpu::BindGroupEntry {
                binding: 0,
                resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                    buffer,
                    offset: 0,
                    size: wgpu::BufferSize::new(4),
                }),
            }],
        });
    } else {
        let probe = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("kvgpu buffer probe"),
            size: 4,
            usage: wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let mut encoder = device.create_command_encoder(&wgpu::CommandEncoderDescriptor {
            label: Some("kvgpu buffer probe"),
        });
        encoder.copy_buffer_to_buffer(buffer, 0, &probe, 0, 4);
        encoder.finish();
    }
    if let Some(e) = scope.pop().await {
        return Err(Error::ForeignBuffer {
            reason: e.to_string(),
        });
    }
    known::insert(device, buffer);
    Ok(())
}

/// Makes a buffer on `device` that every kvgpu call takes without [`verify_buffer`]: it is
/// `device`'s, made here. In a browser this saves the app the asynchronous check of each buffer it
/// makes for kvgpu (per request, per batch size); natively it is `Device::create_buffer`, checked.
/// A descriptor wgpu would refuse is refused first ([`Error::BufferDescriptor`]), so the buffer is
/// never an invalid one taken as verified; natively a device out of memory is
/// [`Error::OutOfMemory`] (in the browser WebGPU reports it itself, later).
pub fn create_buffer(
    device: &wgpu::Device,
    desc: &wgpu::BufferDescriptor<'_>,
) -> Result<wgpu::Buffer> {
    check_descriptor(device, desc.size, desc.usage, desc.mapped_at_creation)?;
    let buffer = allocated(device, "the app's buffer", desc.size, || {
        device.create_buffer(desc)
    })?;
    known::insert(device, &buffer);
    Ok(buffer)
}

/// [`create_buffer`] with contents (as `wgpu::util::DeviceExt::create_buffer_init`, which makes it
/// mapped, of the contents' length in whole words).
pub fn create_buffer_init(
    device: &wgpu::Device,
    desc: &wgpu::util::BufferInitDescriptor<'_>,
) -> Result<wgpu::Buffer> {
    use wgpu::util::DeviceExt;
    let size = (desc.contents.len() as u64).next_multiple_of(wgpu::COPY_BUFFER_ALIGNMENT);
    check_descriptor(device, size, desc.usage, false)?;
    let buffer = allocated(device, "the app's buffer", size, || {
        device.create_buffer_init(desc)
    })?;
    known::insert(device, &buffer);
    Ok(buffer)
}

/// Refuses a buffer descriptor that wgpu's validation would refuse (which, natively, panics
/// without an app's error handler).
fn check_descriptor(
    device: &wgpu::Device,
    size: u64,
    usage: wgpu::BufferUsages,
    mapped_at_creation: bool,
) -> Result<()> {
    use wgpu::BufferUsages as U;
    let webgpu = U::MAP_READ
        | U::MAP_WRITE
        | U::COPY_SRC
        | U::COPY_DST
        | U::INDEX
        | U::VERTEX
        | U::UNIFORM
        | U::STORAGE
        | U::INDIRECT
        | U::QUERY_RESOLVE;
    let mixed = !device
        .features()
        .contains(wgpu::Features::MAPPABLE_PRIMARY_BUFFERS)
        && ((usage.contains(U::MAP_READ) && !(U::MAP_READ | U::COPY_DST).contains(usage))
            || (usage.contains(U::MAP_WRITE) && !(U::MAP_WRITE | U::COPY_SRC).contains(usage)));
    let max = device.limits().max_buffer_size;
    let reason = if usage.is_empty() {
        "its usage is empty".to_string()
    } else if !webgpu.contains(usage) {
        format!("its usage {usage:?} has flags outside WebGPU's")
    } else if mixed {
        format!("its usage {usage:?} maps it with more than a copy the other way")
    } else if size > max {
        format!("{size} bytes, past the device's max_buffer_size of {max}")
    } else if mapped_at_creation && !size.is_multiple_of(wgpu::COPY_BUFFER_ALIGNMENT) {
        format!("mapped at creation, its {size} bytes are not whole 4-byte words")
    } else {
        return Ok(());
    };
    Err(Error::BufferDescriptor { reason })
}

/// Remembers a buffer kvgpu made on `device` as verified (a cache's slot buffers, which another
/// cache of the device may take as a source).
pub(crate) fn remember(device: &wgpu::Device, buffer: &wgpu::Buffer) {
    known::insert(device, buffer);
}

/// Refuses, with [`Error::UnverifiedBuffer`], a buffer that a synchronous call cannot check itself
/// and that [`verify_buffer`] has not accepted for `device`. Natively every buffer passes (the call
/// checks it in an error scope that answers at once).
pub(crate) fn known_or_refused(
    device: &wgpu::Device,
    buffer: &wgpu::Buffer,
    layer: usize,
    what: impl FnOnce() -> String,
) -> Result<()> {
    if known::contains(device, buffer) {
        Ok(())
    } else {
        Err(Error::UnverifiedBuffer {
            layer,
            what: what(),
        })
    }
}

#[cfg(not(target_arch = "wasm32"))]
mod known {
    pub(super) fn insert(_: &wgpu::Device, _: &wgpu::Buffer) {}

    pub(super) fn contains(_: &wgpu::Device, _: &wgpu::Buffer) -> bool {
        true
    }
}

#[cfg(target_arch = "wasm32")]
mod known {
    use js_sys::{WeakMap, WeakSet};
    use wasm_bindgen::JsCast;

    thread_local! {
        /// `GPUDevice` -> `WeakSet` of its verified `GPUBuffer`s. Weak on both levels: a dropped
        /// device or buffer is collected as if kvgpu had never seen it.
        static VERIFIED: WeakMap = WeakMap::new();
    }

    /// The JS objects of a WebGPU device and buffer (none on another backend, such as WebGL).
    fn objects<'a>(
        device: &'a wgpu::Device,
        buffer: &'a wgpu::Buffer,
    ) -> Option<(&'a js_sys::Object, &'a js_sys::Object)> {
        Some((device.as_webgpu()?.as_ref(), buffer.as_webgpu()?.as_ref()))
    }

    pub(super) fn insert(device: &wgpu::Device, buffer: &wgpu::Buffer) {
        let Some((device, buffer)) = objects(device, buffer) else {
            return;
        };
        VERIFIED.with(|verified| {
            let set = match verified.get(device).dyn_into::<WeakSet>() {
                Ok(set) => set,
                Err(_) => {
                    let set = WeakSet::new();
                    verified.set(device, &set);
                    set
                }
            };
            set.add(buffer);
        });
    }

    pub(super) fn contains(device: &wgpu::Device, buffer: &wgpu::Buffer) -> bool {
        // Another backend (WebGL, whose devices kvgpu refuses for want of storage buffers) has no
        // WebGPU objects to remember.
        let Some((device, buffer)) = objects(device, buffer) else {
            return true;
        };
        VERIFIED.with(|verified| {
            verified
                .get(device)
                .dyn_into::<WeakSet>()
                .is_ok_and(|set| set.has(buffer))
        })
    }
}
