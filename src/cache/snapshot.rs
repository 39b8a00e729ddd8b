//! Snapshots of a single-sequence cache: its committed rows exported as the bytes of
//! [`crate::snapshot`], and restored into an empty cache of a compatible spec.

use std::io::{Read, Write};

use super::staged::StagedRows;
use super::{HostRows, KvCache, Rows, SNAPSHOT_ROWS};
use crate::device::{Mapped, Readback, Staging, ranges_bytes, staging_buffer};
use crate::error::{Error, Result, SnapshotProblem};
use crate::kernels::allocated;
use crate::ledger::AppendPlan;
use crate::placement::Run;
use crate::snapshot::{RowSink, Snapshot, SnapshotHeader, SnapshotStream, SnapshotWriter};

/// Where one slot's rows of a snapshot lie: byte ranges of a slot buffer, in order.
pub(crate) struct SlotRows<'a> {
    pub layer: usize,
    pub slot: usize,
    pub buffer: &'a wgpu::Buffer,
    pub ranges: Vec<(u64, u64)>,
}

impl SlotRows<'_> {
    fn refused(&self, reason: String) -> Error {
        Error::Readback {
            layer: self.layer,
            slot: self.slot,
            reason,
        }
    }
}

/// Starts the readback of one slot's rows into `staging` (or a new buffer of `size` bytes, the
/// largest slot's); `None` when it has none.
async fn start_slot(
    device: &wgpu::Device,
    queue: &wgpu::Queue,
    s: &SlotRows<'_>,
    staging: Option<Staging>,
    size: u64,
) -> Result<Option<Readback>> {
    if ranges_bytes(&s.ranges) == 0 {
        return Ok(None);
    }
    let staging = match staging {
        Some(staging) => staging,
        None => staging_buffer(device, size)
            .await
            .map_err(|failure| failure.or(|reason| s.refused(reason)))?,
    };
    Readback::start_in(device, queue, s.buffer, &s.ranges, staging)
        .await
        .map(Some)
        .map_err(|reason| s.refused(reason))
}

/// Waits until a slot's readback is mapped.
async fn mapped(
    device: &wgpu::Device,
    s: &SlotRows<'_>,
    readback: Option<Readback>,
) -> Result<Option<Mapped>> {
    match readback {
        Some(r) => r.mapped(device).await.map(Some).map_err(|e| s.refused(e)),
        None => Ok(None),
    }
}

/// Checksums and writes one slot's mapped rows.
fn write_slot<W: Write + ?Sized>(
    writer: &mut SnapshotWriter<'_, W>,
    s: &SlotRows<'_>,
    rows: Option<&Mapped>,
) -> Result<()> {
    match rows {
        Some(rows) => rows
            .pieces(|rows| writer.rows(rows))
            .map_err(|reason| s.refused(reason))?,
        None => Ok(()),
    }
}

/// Reads back each slot's rows in turn and hands them to `writer`: the next slot's copy runs while
/// one is checksummed and written, so at most two slots' rows are held (mapped) at once, in two
/// staging buffers for the whole export (a new buffer for each slot costs the host page faults and
/// unmaps of its memory).
pub(crate) async fn write_slots<W: Write + ?Sized>(
    device: &wgpu::Device,
    queue: &wgpu::Queue,
    writer: &mut SnapshotWriter<'_, W>,
    slots: &[SlotRows<'_>],
) -> Result<()> {
    let size = slots
        .iter()
        .map(|s| ranges_bytes(&s.ranges))
        .max()
        .unwrap_or(0);
    #[cfg(not(target_arch = "wasm32"))]
    if device.adapter_info().backend == wgpu::Backend::Gl {
        return write_slots_beside(device, queue, writer, slots, size);
    }
    let mut free = Vec::new();
    let mut next = match slots.first() {
        Some(s) => start_slot(device, queue, s, None, size).await?,
        None => None,
    };
    for (i, s) in slots.iter().enumerate() {
        let rows = mapped(device, s, next.take()).await?;
        if let Some(following) = slots.get(i + 1) {
            next = start_slot(device, queue, following, free.pop(), size).await?;
        }
        write_slot(writer, s, rows.as_ref())?;
        free.extend(rows.map(Mapped::release));
    }
    Ok(())
}

/// [`write_slots`] for wgpu's GL backend, which copies on the thread that submits (where Vulkan
/// copies on a queue of its own): a second thread reads the next slot back while this one checksums
/// and writes the current one. The written rows go back to it, and their staging buffer takes the
/// next slot but one.
#[cfg(not(target_arch = "wasm32"))]
fn write_slots_beside<W: Write + ?Sized>(
    device: &wgpu::Device,
    queue: &wgpu::Queue,
    writer: &mut SnapshotWriter<'_, W>,
    slots: &[SlotRows<'_>],
    size: u64,
) -> Result<()> {
    use std::sync::mpsc::{channel, sync_channel};
    std::thread::scope(|scope| {
        // No buffer: the thread maps the next slot, then waits until this one is written.
        let (tx, rx) = sync_channel(0);
        let (done_tx, done) = channel::<Mapped>();
        scope.spawn(move || {
            let mut free = Vec::new();
            for s in slots {
                free.extend(done.try_iter().map(Mapped::release));
                let rows = pollster::block_on(async {
                    let readback = start_slot(device, queue, s, free.pop(), size).await?;
                    mapped(device, s, readback).await
                });
                let failed = rows.is_err();
                // The receiver is gone when the writer stopped on an error of its own.
                if tx.send(rows).is_err() || failed {
                    break;
                }
            }
            done.iter().for_each(drop);
        });
        for s in slots {
            let rows = rx
                .recv()
                .map_err(|_| s.refused("the thread reading the rows back stopped".to_string()))??;
            write_slot(writer, s, rows.as_ref())?;
            if let Some(rows) = rows {
                let _ = done_tx.send(rows);
            }
        }
        Ok(())
    })
}

impl KvCache {
    /// Writes a snapshot of the committed rows to `out` and returns its length in bytes. Pending
    /// rows of the current step are not part of it. The rows are read back one slot at a time, the
    /// next slot's copy running while this one is checksummed and written, so besides what `out`
    /// keeps the host holds two staging buffers as large as the largest slot's committed rows.
    ///
    /// The rows are read as the GPU holds them when the readback is submitted: submit any encoder
    /// holding recorded appends of committed rows first, or the snapshot holds (and checksums) the
    /// bytes those rows had before. A refused export may have written the header and earlier slots
    /// to `out` already.
    pub async fn export_async<W: Write + ?Sized>(&self, out: &mut W) -> Result<u64> {
        self.check_usable()?;
        let len = self.len();
        let slots: Vec<SlotRows<'_>> = self
            .slots
            .iter()
            .enumerate()
            .flat_map(|(layer, slots)| {
                slots.iter().enumerate().map(move |(slot, sb)| SlotRows {
                    layer,
                    slot,
                    buffer: &sb.buffer,
                    ranges: vec![(0, sb.placement.offset(len))],
                })
            })
            .collect();
        let mut writer = SnapshotWriter::new(out, &self.spec, len, 0)?;
        write_slots(&self.device, &self.queue, &mut writer, &slots).await?;
        writer.finish()
    }

    /// A snapshot of the committed rows (see [`KvCache::export_async`]) in one `Vec`.
    /// A snapshot the host cannot hold in one allocation (on wasm32, past 2 GiB) is refused with
    /// [`Error::OutOfMemory`]; [`KvCache::export_async`] streams to any writer instead.
    pub async fn snapshot_async(&self) -> Result<Vec<u8>> {
        let mut bytes = crate::snapshot::SnapshotBytes::default();
        let exported = self.export_async(&mut bytes).await;
        bytes.finish(exported)
    }

    /// [`KvCache::export_async`], blocking.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn export<W: Write + ?Sized>(&self, out: &mut W) -> Result<u64> {
        pollster::block_on(self.export_async(out))
    }

    /// [`KvCache::snapshot_async`], blocking.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn snapshot(&self) -> Result<Vec<u8>> {
        pollster::block_on(self.snapshot_async())
    }

    /// Restores a snapshot into this cache, which must be empty (no committed or pending rows):
    /// afterwards it holds the snapshot's rows, bit for bit, and its length. Everything is checked
    /// first — the bytes ([`Error::Snapshot`]: truncated, corrupt, another version, another
    /// storage type or shape, a cache that is not empty) and the capacity
    /// ([`Error::CapacityExceeded`]) — and a refusal changes nothing. The rows reach the GPU at the
    /// next queue submission, like host appends (natively checked for memory above 4 MiB:
    /// [`KvCache::append`]), so an encoder holding a recorded reset or scrub of this cache must be
    /// submitted first, or its zeroing runs after the restored rows and wipes them. Returns the rows
    /// restored. One exception to "changes nothing": where wgpu still cannot stage a write after
    /// the check ([`Error::OutOfMemory`]; wgpu 30 then loses the device), the rows written before
    /// it stay in the slots, past the cache's length, where attention and reads of rows do not
    /// reach them (the buffer a view binds, and [`KvCache::full_view`]'s range, hold them).
    pub fn import(&mut self, bytes: &[u8]) -> Result<usize> {
        let snap = Snapshot::parse_for(bytes, &self.spec)?;
        self.check_empty()?;
        let plans = self.plan_import(snap.header.len)?;
        let jobs: Vec<HostRows<'_, '_>> = plans
            .iter()
            .map(|p| HostRows::of_plan(p, Rows::Stored(&snap.sections[p.layer])))
            .collect();
        self.check_snapshot_rows(&jobs)?;
        self.write_snapshot_rows(&jobs)?;
        self.commit_import(plans, snap.header.len)
    }

    /// [`KvCache::import`] of a snapshot that arrives in pieces: [`CacheImport::push`] each piece,
    /// then [`CacheImport::finish`]. The host keeps up to 1 MiB of a slot's rows between pieces, and a
    /// copy of each piece while it is pushed; the rows wait
    /// in GPU staging buffers (as large as the snapshot's rows) until the whole snapshot checks out,
    /// and only then are copied into the cache, so a refusal still changes nothing (the copy is its own
    /// submission: submit a recorded reset or scrub of this cache first). A snapshot of
    /// another storage type or shape, and one that does not fit, are refused as soon as its header
    /// arrives.
    pub fn import_stream(&mut self) -> Result<CacheImport<'_>> {
        self.check_empty()?;
        Ok(CacheImport {
            stream: SnapshotStream::new(&self.spec),
            cache: self,
            staged: None,
        })
    }

    /// [`KvCache::import_stream`] from a reader (a file), in pieces of 1 MiB.
    pub fn import_from(&mut self, reader: impl Read) -> Result<usize> {
        let mut import = self.import_stream()?;
        pump(reader, |piece| import.push(piece))?;
        import.finish()
    }

    /// Refuses a cache with committed or pending rows.
    fn check_empty(&self) -> Result<()> {
        let pending = (0..self.spec.n_layers())
            .filter_map(|l| self.ledger.pending(l).ok())
            .max()
            .unwrap_or(0);
        if !self.is_empty() || pending > 0 {
            return Err(Error::Snapshot {
                problem: SnapshotProblem::NotEmpty {
                    len: self.len(),
                    pending,
                },
            });
        }
        Ok(())
    }

    /// The appends of `len` rows to every layer with slots, checked against the capacity.
    fn plan_import(&self, len: usize) -> Result<Vec<AppendPlan>> {
        self.check_usable()?;
        let shapes: Vec<Vec<Vec<usize>>> = self
            .spec
            .layers()
            .iter()
            .map(|l| {
                l.slots
                    .iter()
                    .map(|s| [&[len][..], &s.trailing].concat())
                    .collect()
            })
            .collect();
        (0..self.spec.n_layers())
            .filter(|&l| !shapes[l].is_empty())
            .map(|l| {
                self.ledger
                    .plan_append_with(l, shapes[l].len(), |s| &shapes[l][s])
            })
            .collect()
    }

    /// Commits the planned appends of an import and its `len` rows.
    fn commit_import(&mut self, plans: Vec<AppendPlan>, len: usize) -> Result<usize> {
        for plan in plans {
            self.ledger.commit_append(plan);
        }
        self.ledger.advance(len)?;
        Ok(len)
    }

    /// Records copies of staged rows (`(first staged row, run)`) into a slot buffer.
    pub(crate) fn record_staged(
        &self,
        encoder: &mut wgpu::CommandEncoder,
        layer: usize,
        slot: usize,
        runs: &[(usize, Run)],
        staging: &wgpu::Buffer,
    ) {
        let sb = &self.slots[layer][slot];
        for (first, run) in runs.iter().filter(|(_, run)| run.n_rows > 0) {
            let (offset, size) = sb.placement.bytes(run);
            let from = sb.placement.offset(*first);
            encoder.copy_buffer_to_buffer(staging, from, &sb.buffer, offset, size);
        }
    }

    /// Checks that the device can stage a snapshot's rows (`jobs`, of stored rows), as
    /// [`KvCache::check_host_rows`] checks host rows: the host memory for padding them reserved,
    /// then natively more than 4 MiB of them through
    /// [`check_staging`](crate::kernels::check_staging), and a device that cannot stage them
    /// refuses. Nothing is kept but that reservation, which the write uses, so a caller checks
    /// before it takes anything else (a page-table row) and a refusal changes nothing.
    pub(crate) fn check_snapshot_rows(&mut self, jobs: &[HostRows<'_, '_>]) -> Result<()> {
        self.check_host_rows(jobs, SNAPSHOT_ROWS)
    }

    /// Writes a snapshot's rows, just checked by [`KvCache::check_snapshot_rows`] (nothing
    /// allocated in between), into their slots with `Queue::write_buffer`, every write inside an
    /// out-of-memory scope. Where wgpu still cannot stage one, the rows written so far (past the
    /// empty cache's length, so unseen) stay; wgpu 30 then also loses the device.
    pub(crate) fn write_snapshot_rows(&mut self, jobs: &[HostRows<'_, '_>]) -> Result<()> {
        let (what, bytes) = (SNAPSHOT_ROWS, self.host_rows_bytes(jobs));
        let device = self.device.clone();
        allocated(&device, what, bytes, || self.write_host_rows(jobs))
    }
}

/// Reads `reader` to its end in pieces of 1 MiB, handing each to `push`.
pub(crate) fn pump(mut reader: impl Read, mut push: impl FnMut(&[u8]) -> Result<()>) -> Result<()> {
    let mut piece = vec![0u8; 1 << 20];
    loop {
        let n = match reader.read(&mut piece) {
            Ok(0) => return Ok(()),
            // A reader that breaks `Read`'s contract is refused, not sliced past the buffer.
            Ok(n) if n > piece.len() => {
                return Err(Error::Snapshot {
                    problem: SnapshotProblem::Read {
                        kind: std::io::ErrorKind::InvalidData,
                        reason: format!(
                            "the reader said it read {n} bytes into a buffer of {}",
                            piece.len()
                        ),
                    },
                });
            }
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => {
                return Err(Error::Snapshot {
                    problem: SnapshotProblem::Read {
                        kind: e.kind(),
                        reason: e.to_string(),
                    },
                });
            }
        };
        push(&piece[..n])?;
    }
}

/// A snapshot being restored into an empty cache piece by piece ([`KvCache::import_stream`]).
pub struct CacheImport<'c> {
    cache: &'c mut KvCache,
    stream: SnapshotStream,
    staged: Option<StagedRows>,
}

impl std::fmt::Debug for CacheImport<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CacheImport").finish_non_exhaustive()
    }
}

impl CacheImport<'_> {
    /// Takes the next piece of the snapshot. A refusal is final: every later call repeats it, the
    /// cache is unchanged, and the rows staged so far are let go at once.
    pub fn push(&mut self, piece: &[u8]) -> Result<()> {
        let mut sink = CacheSink {
            cache: self.cache,
            staged: &mut self.staged,
        };
        self.stream
            .push(piece, &mut sink)
            .inspect_err(|_| self.staged = None)
    }

    /// Checks the length and the checksum of the whole, then copies the staged rows into the cache
    /// (in a submission of its own) and commits them. Returns the rows restored.
    pub fn finish(self) -> Result<usize> {
        let header = self.stream.finish()?;
        let plans = self.cache.plan_import(header.len)?;
        if let Some(mut staged) = self.staged {
            staged.flush();
            let mut encoder = self.cache.encoder("kvgpu snapshot import");
            for plan in &plans {
                let [run] = plan.runs();
                for slot in 0..self.cache.slots[plan.layer].len() {
                    if let Some(buffer) = staged.buffer(plan.layer, slot) {
                        self.cache.record_staged(
                            &mut encoder,
                            plan.layer,
                            slot,
                            &[(0, run)],
                            buffer,
                        );
                    }
                }
            }
            self.cache.queue.submit([encoder.finish()]);
        }
        self.cache.commit_import(plans, header.len)
    }
}

struct CacheSink<'a> {
    cache: &'a KvCache,
    staged: &'a mut Option<StagedRows>,
}

impl RowSink for CacheSink<'_> {
    fn header(&mut self, header: &SnapshotHeader) -> Result<()> {
        self.cache.plan_import(header.len)?;
        *self.staged = Some(StagedRows::new(
            &self.cache.device,
            &self.cache.queue,
            header,
        )?);
        Ok(())
    }

    fn rows(&mut self, layer: usize, slot: usize, offset: u64, bytes: &[u8]) -> Result<()> {
        match self.staged {
            Some(staged) => staged.rows(layer, slot, offset, bytes),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reads `data`, but claims one byte more than the buffer holds once `lie` is set.
    struct Reader {
        data: Vec<u8>,
        lie: bool,
    }

    impl Read for Reader {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            if self.lie {
                return Ok(buf.len() + 1);
            }
            let n = self.data.len().min(buf.len());
            buf[..n].copy_from_slice(&self.data[..n]);
            self.data.drain(..n);
            Ok(n)
        }
    }

    #[test]
    fn a_reader_claiming_more_bytes_than_its_buffer_is_refused() {
        let mut seen = Vec::new();
        let honest = Reader {
            data: (0..=255).collect(),
            lie: false,
        };
        pump(honest, |piece| {
            seen.extend_from_slice(piece);
            Ok(())
        })
        .unwrap();
        assert_eq!(seen, (0..=255).collect::<Vec<u8>>());
        let liar = Reader {
            data: Vec::new(),
            lie: true,
        };
        let e = pump(liar, |_| Ok(())).unwrap_err();
        assert!(
            matches!(
                &e,
                Error::Snapshot {
                    problem: SnapshotProblem::Read {
                        kind: std::io::ErrorKind::InvalidData,
                        ..
                    }
                }
            ),
            "{e}"
        );
    }
}
