//! Host data that recorded commands read from a storage buffer: the rows and destination map of a
//! scattered append, the query table of a ragged attention batch.
//!
//! Like the parameter ring, each upload gets bytes of its own, written with `Queue::write_buffer`
//! (so they land at the next submission, before the recorded commands run) and never written again:
//! a full buffer is replaced by a fresh one, which the commands that still name the old one keep
//! alive. Uploads larger than the ring keeps get a buffer of their own, dropped after use.

/// Bytes of the ring buffer; larger uploads get a buffer of their own.
pub(crate) const RING_BYTES: u64 = 4 << 20;
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
    buffer: Option<wgpu::Buffer>,
    next: u64,
}

impl UploadRing {
    pub(crate) fn new(device: &wgpu::Device) -> Self {
        Self {
            device: device.clone(),
            buffer: None,
            next: 0,
        }
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
        if len > RING_BYTES {
            Upload {
                buffer: fresh(&self.device, len.next_multiple_of(16)),
                offset: 0,
            }
        } else {
            if self.next + len > RING_BYTES {
                self.buffer = None;
                self.next = 0;
            }
            let device = &self.device;
            let buffer = self
                .buffer
                .get_or_insert_with(|| fresh(device, RING_BYTES))
                .clone();
            let offset = self.next;
            self.next = (offset + len).next_multiple_of(ALIGN);
            Upload { buffer, offset }
        }
    }
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
