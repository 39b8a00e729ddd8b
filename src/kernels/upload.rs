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
/// Host bytes of one call above which kvgpu first checks that the device can stage them
/// ([`check_staging`]). wgpu 30 loses the device when it cannot allocate a `Queue::write_buffer`'s
/// own staging, so a large write the device cannot hold would take every buffer on it. Smaller
/// writes (a decode step's rows) are not checked: the check costs about as much as such a write.
/// In the browser nothing is checked: WebGPU reports a failed write itself, and loses nothing.
pub(crate) const CHECKED_BYTES: u64 = RING_BYTES;
/// Every upload starts on a multiple of this (any storage binding offset a device may require).
const ALIGN: u64 = 256;

/// Where one upload landed: its buffer and byte offset.
#[derive(Clone, Debug)]
pub(crate) struct Upload {
    pub buffer: wgpu::Buffer,
    pub offset: u64,
}

/// Where an [`UploadRing`] stood ([`UploadRing::mark`]), to put it back with
/// [`UploadRing::rewind`].
#[derive(Debug)]
pub(crate) struct UploadMark {
    buffer: Option<wgpu::Buffer>,
    next: u64,
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

    /// Where the ring stands now.
    pub(crate) fn mark(&self) -> UploadMark {
        UploadMark {
            buffer: self.buffer.clone(),
            next: self.next,
        }
    }

    /// Puts the ring back where `mark` found it, for a call refused after it reserved uploads and
    /// before it wrote any of them or recorded a command that names them: their bytes are free
    /// again, and a ring buffer made since is dropped (its memory released).
    pub(crate) fn rewind(&mut self, mark: UploadMark) {
        self.buffer = mark.buffer;
        self.next = mark.next;
    }

    /// Bytes for an upload of `len` bytes that no other upload uses, written later with
    /// [`Upload::write`] (so a call can bind them, and check what it binds, before it writes).
    /// A buffer this needs is made under the out-of-memory check: [`crate::Error::OutOfMemory`]
    /// naming `what` where the device cannot hold it, and the ring is as it was.
    pub(crate) fn reserve(&mut self, what: &str, len: u64) -> crate::Result<Upload> {
        let len = len.max(4);
        let device = &self.device;
        let fresh =
            |size: u64| crate::kernels::allocated(device, what, size, || fresh(device, size));
        if len > self.size {
            return Ok(Upload {
                buffer: fresh(len.next_multiple_of(16))?,
                offset: 0,
            });
        }
        let buffer = match &self.buffer {
            Some(buffer) if self.next + len <= self.size => buffer.clone(),
            _ => {
                let buffer = fresh(self.size)?;
                self.buffer = Some(buffer.clone());
                self.next = 0;
                buffer
            }
        };
        let offset = self.next;
        self.next = (offset + len).next_multiple_of(ALIGN);
        Ok(Upload { buffer, offset })
    }
}

/// Natively, where `bytes` is more than [`CHECKED_BYTES`], whether the device can stage a host write
/// of `bytes` bytes (`Queue::write_buffer`): buffers of that size, of the kind wgpu stages such writes
/// in (mappable for writing, in pieces of at most the device's largest buffer), made under the
/// out-of-memory check and destroyed at once, so the write's own staging takes their place; never
/// mapped, so never filled. [`crate::Error::OutOfMemory`] naming `what` where the device cannot make
/// them.
pub(crate) fn check_staging(device: &wgpu::Device, what: &str, bytes: u64) -> crate::Result<()> {
    // wgpu's OpenGL backend reports no buffer the driver could not allocate (wgpu-hal 30 does not
    // read GL_OUT_OF_MEMORY), so the check could not fail there, and it would cost: mappable GL
    // buffers are backed by a zeroed host copy of their size.
    let gl = device.adapter_info().backend == wgpu::Backend::Gl;
    if cfg!(target_arch = "wasm32") || gl || bytes <= CHECKED_BYTES {
        return Ok(());
    }
    let largest = (device.limits().max_buffer_size / 4 * 4).max(4);
    let probes = crate::kernels::allocated(device, what, bytes, || {
        let mut left = bytes.next_multiple_of(4);
        let mut probes = Vec::new();
        while left > 0 {
            let size = left.min(largest);
            probes.push(device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("kvgpu staging check"),
                size,
                usage: wgpu::BufferUsages::MAP_WRITE | wgpu::BufferUsages::COPY_SRC,
                mapped_at_creation: false,
            }));
            left -= size;
        }
        probes
    })?;
    for probe in probes {
        probe.destroy();
    }
    Ok(())
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
