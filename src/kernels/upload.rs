//! Host data that recorded commands read from a storage buffer: the rows and destination map of a
//! scattered append, the query table of a ragged attention batch.
//!
//! Like the parameter ring, each upload gets bytes of its own, written with `Queue::write_buffer`
//! (so they land at the next submission, before the recorded commands run) and never written again:
//! a full buffer is replaced by a fresh one, which the commands that still name the old one keep
//! alive. Uploads larger than the ring keeps get a buffer of their own, dropped after use.

/// Bytes of the ring buffer (less on a device whose storage bindings are smaller: the ring is bound
/// whole); larger uploads get a buffer of their own.
pub(crate) const RING_BYTES: u64 = 4 << 20;
/// Host bytes of one call above which kvgpu stages them itself, in a buffer made under the
/// out-of-memory check ([`crate::Error::OutOfMemory`]), and copies them into place. wgpu 30 loses the
/// device when it cannot allocate a `Queue::write_buffer`'s own staging, so a large write the device
/// cannot hold would take every buffer on it. Smaller writes (a decode step's rows) keep
/// `write_buffer`, which costs less per call. In the browser writes always go by `write_buffer`:
/// WebGPU reports a failed one itself, and loses nothing.
pub(crate) const CHECKED_BYTES: u64 = RING_BYTES;
/// Every upload starts on a multiple of this (any storage binding offset a device may require).
const ALIGN: u64 = 256;

/// Where one upload landed: its buffer and byte offset.
#[derive(Clone, Debug)]
pub(crate) struct Upload {
    pub buffer: wgpu::Buffer,
    pub offset: u64,
}

#[derive(Debug)]
pub(crate) struct UploadRing {
    device: wgpu::Device,
    /// Bytes of the ring buffer: [`RING_BYTES`], or one binding of the device where that is less.
    size: u64,
    buffer: Option<wgpu::Buffer>,
    next: u64,
}

impl UploadRing {
    pub(crate) fn new(device: &wgpu::Device) -> Self {
        let binding = super::binding_limit(&device.limits());
        Self {
            device: device.clone(),
            size: RING_BYTES.min(binding / 16 * 16).max(16),
            buffer: None,
            next: 0,
        }
    }

    /// Bytes of the ring buffer: uploads up to this share it.
    pub(crate) fn size(&self) -> u64 {
        self.size
    }

    /// Stages `bytes` (a multiple of 4) in bytes no other upload uses.
    pub(crate) fn push(&mut self, queue: &wgpu::Queue, bytes: &[u8]) -> Upload {
        let upload = self.reserve(bytes.len() as u64);
        upload.write(queue, bytes);
        upload
    }

    /// Bytes for an upload of `len` bytes that no other upload uses, written later with
    /// [`Upload::write`] (so a call can bind them, and check what it binds, before it writes).
    pub(crate) fn reserve(&mut self, len: u64) -> Upload {
        let len = len.max(4);
        if len > self.size {
            Upload {
                buffer: fresh(&self.device, len.next_multiple_of(16)),
                offset: 0,
            }
        } else {
            if self.next + len > self.size {
                self.buffer = None;
                self.next = 0;
            }
            let (device, size) = (&self.device, self.size);
            let buffer = self
                .buffer
                .get_or_insert_with(|| fresh(device, size))
                .clone();
            let offset = self.next;
            self.next = (offset + len).next_multiple_of(ALIGN);
            Upload { buffer, offset }
        }
    }
}

impl UploadRing {
    /// [`UploadRing::push`] for bytes that commands recorded into `encoder` read. Natively, an
    /// upload of more than [`CHECKED_BYTES`] gets its buffer and a staging buffer under the
    /// out-of-memory check, and a copy recorded into `encoder` (ahead of the commands that read
    /// it) moves its bytes in. A refused upload records nothing.
    pub(crate) fn push_recorded(
        &mut self,
        queue: &wgpu::Queue,
        encoder: &mut wgpu::CommandEncoder,
        bytes: &[u8],
    ) -> crate::Result<Upload> {
        let len = bytes.len() as u64;
        if cfg!(target_arch = "wasm32") || len <= CHECKED_BYTES {
            return Ok(self.push(queue, bytes));
        }
        let size = len.next_multiple_of(16);
        let device = &self.device;
        let (buffer, from) =
            crate::kernels::allocated(device, "an upload of host rows", 2 * size, || {
                (fresh(device, size), staging_buffer(device, size))
            })?;
        mapped(&from)?.slice(..bytes.len()).copy_from_slice(bytes);
        from.unmap();
        encoder.copy_buffer_to_buffer(&from, 0, &buffer, 0, size);
        Ok(Upload { buffer, offset: 0 })
    }
}

/// Buffers of `sizes` bytes (multiples of 4) to copy from, mapped for writing, made under one
/// out-of-memory check for `what` (see [`CHECKED_BYTES`]).
pub(crate) fn staging(
    device: &wgpu::Device,
    what: &str,
    sizes: &[u64],
) -> crate::Result<Vec<wgpu::Buffer>> {
    crate::kernels::allocated(device, what, sizes.iter().sum(), || {
        sizes
            .iter()
            .map(|&size| staging_buffer(device, size))
            .collect()
    })
}

/// The whole of a buffer mapped at creation, to write into.
pub(crate) fn mapped(buffer: &wgpu::Buffer) -> crate::Result<wgpu::BufferViewMut> {
    buffer
        .get_mapped_range_mut(..)
        .map_err(|e| crate::Error::Device {
            reason: format!("a staging buffer of kvgpu could not be mapped: {e}"),
        })
}

fn staging_buffer(device: &wgpu::Device, size: u64) -> wgpu::Buffer {
    device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("kvgpu staging"),
        size,
        usage: wgpu::BufferUsages::MAP_WRITE | wgpu::BufferUsages::COPY_SRC,
        mapped_at_creation: true,
    })
}

impl Upload {
    /// Writes `bytes` (at most the reserved length) to this upload's place.
    pub(crate) fn write(&self, queue: &wgpu::Queue, bytes: &[u8]) {
        if !bytes.is_empty() {
            queue.write_buffer(&self.buffer, self.offset, bytes);
        }
    }
}

/// A buffer for uploads, known in the browser as this device's own (calls that bind it check that).
fn fresh(device: &wgpu::Device, size: u64) -> wgpu::Buffer {
    let buffer = device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("kvgpu upload"),
        size,
        usage: wgpu::BufferUsages::STORAGE
            | wgpu::BufferUsages::COPY_DST
            | wgpu::BufferUsages::COPY_SRC,
        mapped_at_creation: false,
    });
    crate::verify::remember(device, &buffer);
    buffer
}
