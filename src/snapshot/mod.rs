//! Snapshots: one sequence's committed rows as a versioned, checksummed byte format that restores
//! bit for bit into any cache or pool of a compatible spec, on any backend. This module owns the
//! format (writing, parsing, checking); the caches read and write the rows
//! ([`crate::KvCache::export_async`], [`crate::KvCache::import`],
//! [`crate::PagedCache::export_sequence_async`], [`crate::PagedCache::import_sequence`]). No wgpu.
//!
//! The format is documented on [`SnapshotHeader`] (the public face of this module).

mod stream;

use std::io::Write;

pub(crate) use stream::{RowSink, SnapshotStream};

use crate::codec::DType;
use crate::error::{Error, Result, SHAPE_KEPT, SnapshotProblem};
use crate::spec::{CacheSpec, LayerSpec, SlotSpec};

/// The first 8 bytes of every snapshot.
pub const SNAPSHOT_MAGIC: [u8; 8] = *b"KVGPUSNP";

/// The format version this kvgpu writes and reads.
/// Version 1 (development builds before slots had their own storage types) is refused.
pub const SNAPSHOT_VERSION: u32 = 2;

/// Magic, version and header length: the bytes before the header.
const PREFIX: usize = 16;

/// The longest header kvgpu writes or reads: a spec's description, which [`CacheSpec::new`] bounds
/// by the same number, so every cache's header fits. A longer one is refused from its length field,
/// before it is read: a stream does not buffer it. Within it the parser builds what it declares
/// before comparing it with a cache: at 4 bytes per empty layer, up to about 4 million layers (an
/// estimated 100-150 MB while parsing).
pub(crate) const MAX_HEADER: u64 = crate::spec::MAX_DESCRIPTION_BYTES;

/// What a snapshot's header says: the source's spec, its committed rows and page size.
///
/// # Format, version 2
/// Little-endian throughout.
///
/// | bytes | field |
/// |---|---|
/// | 8 | magic `KVGPUSNP` |
/// | 4 | format version (`u32`, 2) |
/// | 4 | header length `h` (`u32`, at most 16 MiB): the bytes of the header that follow |
/// | `h` | header (below) |
/// | 4 | CRC-32 of every byte before it (magic to header) |
/// | ... | rows: for each layer, for each of its slots, `len` rows exactly as stored |
/// | 4 | CRC-32 of every byte before it (the whole snapshot) |
///
/// The header: the cache's storage type (`u32`: 0 f32, 1 f16, 2 bf16, 3 q8_0,
/// 4 q4_0, 5 fp8 e4m3, 6 fp8 e5m2), `max_seq_len` of the source (`u64`; a pool's longest sequence), `len` (`u64`,
/// committed rows), page size (`u64`, 0 for a single-sequence cache), the number of layers (`u32`),
/// then per layer its number of slots (`u32`) and per slot its name (`u32` byte length, UTF-8),
/// trailing shape (`u32` rank, `u64` each dimension), storage type (`u32` code) and scale (the `f32`
/// bits of a scaled fp8 slot's [`crate::SlotSpec::scale`], 0 for none). A row is stored
/// as in the cache, in its slot's type: f32 as is, 16-bit types packed two to a word (low half
/// first), the quantized types as [`DType`] lays them out, each row padded with zeros to a multiple
/// of 4 bytes; layers without slots take no bytes.
///
/// A snapshot restores into a cache or pool whose layer count, slot shapes and slots' storage types
/// and scales equal its own (slot names, capacity and page size may differ; the rows must fit). No type conversion is
/// offered: a restore is bit-identical or refused. Parsing checks, in order: the magic, the
/// version, the header's length and checksum, the header itself, the total length, the checksum of
/// the whole, then compatibility with the destination — so a truncated snapshot is
/// [`SnapshotProblem::Truncated`] wherever it is cut, and a flipped bit is a bad magic, another
/// version, a failed checksum, or (in the header's length) a snapshot too short for its header or a
/// header over 16 MiB ([`SnapshotProblem::MalformedHeader`], refused before it is read).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SnapshotHeader {
    /// Layers, slot names and trailing shapes, storage type and `max_seq_len` of the source (read as
    /// `usize::MAX` where it exceeds that, as a pool's may on a 32-bit machine).
    pub spec: CacheSpec,
    /// Committed rows of the sequence.
    pub len: usize,
    /// Rows per page of the source pool; 0 for a single-sequence cache.
    pub page_size: usize,
}

impl SnapshotHeader {
    /// Reads and checks the header of `bytes` (magic, version, header checksum); not the rows, so a
    /// file's first bytes are enough. [`SnapshotHeader::total_bytes`] says how long the whole is.
    pub fn parse(bytes: &[u8]) -> Result<Self> {
        parse_header(bytes).map(|(header, _)| header)
    }

    /// Bytes of the rows of one slot.
    fn section_bytes(&self, layer: usize, slot: usize) -> u64 {
        (self.spec.row_bytes(layer, slot).unwrap_or(0)).saturating_mul(self.len as u64)
    }

    /// Bytes of every slot's rows (`u64::MAX` for a header built by hand whose rows no `u64`
    /// counts; a parsed header has at most `max_seq_len` rows).
    pub fn rows_bytes(&self) -> u64 {
        self.spec.bytes_per_token().saturating_mul(self.len as u64)
    }

    /// Bytes of the whole snapshot: header, rows and checksums.
    pub fn total_bytes(&self) -> u64 {
        // The header and its checksum, the rows, the checksum of the whole.
        (encode_header(&self.spec, self.len, self.page_size).len() as u64 + 4)
            .saturating_add(self.rows_bytes())
            .saturating_add(4)
    }

    /// Refuses a destination whose layers, slot shapes or slots' storage types or scales differ,
    /// naming the first difference (names, capacity and page size may differ).
    pub fn check_compatible(&self, dest: &CacheSpec) -> Result<()> {
        let refuse = |problem| Err(Error::Snapshot { problem });
        let src = &self.spec;
        if src.n_layers() != dest.n_layers() {
            return refuse(SnapshotProblem::LayerCount {
                snapshot: src.n_layers(),
                cache: dest.n_layers(),
            });
        }
        for (layer, (a, b)) in src.layers().iter().zip(dest.layers()).enumerate() {
            if a.slots.len() != b.slots.len() {
                return refuse(SnapshotProblem::SlotCount {
                    layer,
                    snapshot: a.slots.len(),
                    cache: b.slots.len(),
                });
            }
            for (slot, (x, y)) in a.slots.iter().zip(&b.slots).enumerate() {
                let (snapshot, cache) = (src.dtype_of(x), dest.dtype_of(y));
                if snapshot != cache {
                    return refuse(SnapshotProblem::DType {
                        layer,
                        slot,
                        snapshot,
                        cache,
                    });
                }
                if x.trailing != y.trailing {
                    return refuse(SnapshotProblem::SlotShape {
                        layer,
                        slot,
                        snapshot: x.trailing[..x.trailing.len().min(SHAPE_KEPT)].to_vec(),
                        snapshot_rank: x.trailing.len(),
                        cache: y.trailing.clone(),
                    });
                }
                if x.scale.map(f32::to_bits) != y.scale.map(f32::to_bits) {
                    return refuse(SnapshotProblem::Scale {
                        layer,
                        slot,
                        snapshot: x.scale,
                        cache: y.scale,
                    });
                }
            }
        }
        Ok(())
    }
}

/// A whole snapshot, checked (header, length, checksum) and compatible with a destination: the
/// header and the stored bytes of each slot's rows.
pub(crate) struct Snapshot<'a> {
    pub header: SnapshotHeader,
    /// Per layer, per slot, `len` stored rows.
    pub sections: Vec<Vec<&'a [u8]>>,
}

impl<'a> Snapshot<'a> {
    /// Checks everything a restore into `dest` needs but room: see the module docs for the order.
    pub(crate) fn parse_for(bytes: &'a [u8], dest: &CacheSpec) -> Result<Self> {
        let (header, rows_at) = parse_header(bytes)?;
        let total = (rows_at as u64)
            .checked_add(header.rows_bytes())
            .and_then(|t| t.checked_add(4))
            .ok_or_else(|| malformed("its rows come to more bytes than can be counted".into()))?;
        let got = bytes.len() as u64;
        if got < total {
            return problem(SnapshotProblem::Truncated { needed: total, got });
        }
        if got > total {
            return problem(SnapshotProblem::TrailingBytes {
                expected: total,
                got,
            });
        }
        let end = bytes.len() - 4;
        check_crc(bytes, end, "snapshot")?;
        header.check_compatible(dest)?;
        let mut at = rows_at;
        let sections = (0..header.spec.n_layers())
            .map(|l| {
                (0..header.spec.layers()[l].slots.len())
                    .map(|s| {
                        // Fits: the total above counted every section.
                        let n = header.section_bytes(l, s) as usize;
                        at += n;
                        &bytes[at - n..at]
                    })
                    .collect()
            })
            .collect();
        Ok(Self { header, sections })
    }
}

/// Streams a snapshot into `out`: the header first, then each slot's rows in order, then the
/// checksum, never holding more than the caller's current slot.
pub(crate) struct SnapshotWriter<'w, W: Write + ?Sized> {
    out: &'w mut W,
    crc: Crc32,
    written: u64,
}

impl<'w, W: Write + ?Sized> SnapshotWriter<'w, W> {
    /// Writes the header of a snapshot of `len` rows of a cache of `spec` (`page_size` 0 for a
    /// single-sequence cache).
    pub(crate) fn new(
        out: &'w mut W,
        spec: &CacheSpec,
        len: usize,
        page_size: usize,
    ) -> Result<Self> {
        let mut w = Self {
            out,
            crc: Crc32::new(),
            written: 0,
        };
        // At most MAX_HEADER bytes after the prefix: the spec's description, which the spec bounds.
        let mut header = encode_header(spec, len, page_size);
        let crc = crc32(&header);
        header.extend_from_slice(&crc.to_le_bytes());
        w.put(&header)?;
        Ok(w)
    }

    /// Writes the next slot's stored rows.
    pub(crate) fn rows(&mut self, bytes: &[u8]) -> Result<()> {
        self.put(bytes)
    }

    /// Writes the checksum; returns the snapshot's length in bytes.
    pub(crate) fn finish(mut self) -> Result<u64> {
        let crc = self.crc.finish();
        self.put(&crc.to_le_bytes())?;
        self.out.flush().map_err(write_error)?;
        Ok(self.written)
    }

    /// Writes `bytes` whole, with `write` in a loop as `write_all` does; but a writer that says it
    /// wrote more than it was given is refused (`write_all` would slice past the bytes: a panic).
    fn put(&mut self, bytes: &[u8]) -> Result<()> {
        self.crc.update(bytes);
        self.written += bytes.len() as u64;
        let mut left = bytes;
        let broken = |kind, reason: String| Error::Snapshot {
            problem: SnapshotProblem::Write { kind, reason },
        };
        while !left.is_empty() {
            match self.out.write(left) {
                Ok(0) => {
                    return Err(broken(
                        std::io::ErrorKind::WriteZero,
                        format!("the writer took none of {} bytes", left.len()),
                    ));
                }
                Ok(n) if n > left.len() => {
                    let reason = format!("the writer said it wrote {n} bytes of {}", left.len());
                    return Err(broken(std::io::ErrorKind::InvalidData, reason));
                }
                Ok(n) => left = &left[n..],
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(write_error(e)),
            }
        }
        Ok(())
    }
}

/// The `Vec` that `snapshot_async` and `snapshot_sequence_async` write a snapshot into, grown
/// fallibly: a snapshot the host cannot hold in one allocation (past `isize::MAX` bytes, 2 GiB on
/// wasm32, where `Vec`'s own growth would panic; or past what the process can allocate, where it
/// would abort) stops the export, and [`SnapshotBytes::finish`] names it as out of memory.
#[derive(Default)]
pub(crate) struct SnapshotBytes {
    bytes: Vec<u8>,
    /// The length the `Vec` could not grow to.
    refused: Option<u64>,
}

impl SnapshotBytes {
    /// The snapshot, or the export's refusal: [`Error::OutOfMemory`] where the bytes did not fit.
    pub(crate) fn finish(self, exported: Result<u64>) -> Result<Vec<u8>> {
        match (exported, self.refused) {
            (Ok(_), _) => Ok(self.bytes),
            (Err(_), Some(bytes)) => Err(Error::OutOfMemory {
                what: "a snapshot in one Vec (host memory)".into(),
                bytes,
                reason: "this process could not allocate it; export_async writes to any \
                         std::io::Write instead"
                    .into(),
            }),
            (Err(e), None) => Err(e),
        }
    }

    /// Room for `n` more bytes: amortized growth first; where doubling is past what one allocation
    /// holds, exactly. Where neither fits, the length asked for is kept for `finish`.
    fn grow(&mut self, n: usize) -> std::io::Result<()> {
        if self.bytes.try_reserve(n).is_err() && self.bytes.try_reserve_exact(n).is_err() {
            self.refused = Some(self.bytes.len() as u64 + n as u64);
            return Err(std::io::Error::new(
                std::io::ErrorKind::OutOfMemory,
                "the snapshot does not fit in host memory",
            ));
        }
        Ok(())
    }
}

impl Write for SnapshotBytes {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.grow(buf.len())?;
        self.bytes.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn write_error(e: std::io::Error) -> Error {
    Error::Snapshot {
        problem: SnapshotProblem::Write {
            kind: e.kind(),
            reason: e.to_string(),
        },
    }
}

fn problem<T>(problem: SnapshotProblem) -> Result<T> {
    Err(Error::Snapshot { problem })
}

/// `e`'s text cut at 1,024 bytes, its formatting stopped there: a spec parsed from a hostile header
/// may name a slot with megabytes, which the error would otherwise copy whole (and a stream would
/// return again from every later call).
fn bounded(e: &impl std::fmt::Display) -> String {
    const MAX: usize = 1024;
    struct Capped(String);
    impl std::fmt::Write for Capped {
        fn write_str(&mut self, s: &str) -> std::fmt::Result {
            let room = MAX - self.0.len();
            if s.len() <= room {
                self.0.push_str(s);
                return Ok(());
            }
            let mut cut = room;
            while !s.is_char_boundary(cut) {
                cut -= 1;
            }
            self.0.push_str(&s[..cut]);
            Err(std::fmt::Error)
        }
    }
    let mut out = Capped(String::new());
    if std::fmt::write(&mut out, format_args!("{e}")).is_err() {
        out.0.push_str("...");
    }
    out.0
}

fn malformed(detail: String) -> Error {
    Error::Snapshot {
        problem: SnapshotProblem::MalformedHeader { detail },
    }
}

/// Magic, version, header length, header: everything the header checksum covers.
fn encode_header(spec: &CacheSpec, len: usize, page_size: usize) -> Vec<u8> {
    let mut body = Vec::new();
    body.extend_from_slice(&spec.dtype().code().to_le_bytes());
    for n in [spec.max_seq_len(), len, page_size] {
        body.extend_from_slice(&(n as u64).to_le_bytes());
    }
    body.extend_from_slice(&(spec.n_layers() as u32).to_le_bytes());
    for layer in spec.layers() {
        body.extend_from_slice(&(layer.slots.len() as u32).to_le_bytes());
        for slot in &layer.slots {
            body.extend_from_slice(&(slot.name.len() as u32).to_le_bytes());
            body.extend_from_slice(slot.name.as_bytes());
            body.extend_from_slice(&(slot.trailing.len() as u32).to_le_bytes());
            for &d in &slot.trailing {
                body.extend_from_slice(&(d as u64).to_le_bytes());
            }
            body.extend_from_slice(&spec.dtype_of(slot).code().to_le_bytes());
            body.extend_from_slice(&slot.scale.map_or(0, f32::to_bits).to_le_bytes());
        }
    }
    let mut out = Vec::with_capacity(PREFIX + body.len());
    out.extend_from_slice(&SNAPSHOT_MAGIC);
    out.extend_from_slice(&SNAPSHOT_VERSION.to_le_bytes());
    out.extend_from_slice(&(body.len() as u32).to_le_bytes());
    out.extend_from_slice(&body);
    out
}

fn u32_at(bytes: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]])
}

/// Compares the CRC-32 of `bytes[..end]` with the one stored at `end`.
fn check_crc(bytes: &[u8], end: usize, section: &'static str) -> Result<()> {
    let (stored, computed) = (u32_at(bytes, end), crc32(&bytes[..end]));
    if stored != computed {
        return problem(SnapshotProblem::ChecksumMismatch {
            section,
            stored,
            computed,
        });
    }
    Ok(())
}

/// The header of `bytes` and where the rows start.
fn parse_header(bytes: &[u8]) -> Result<(SnapshotHeader, usize)> {
    let got = bytes.len() as u64;
    let shown = bytes.len().min(SNAPSHOT_MAGIC.len());
    if bytes[..shown] != SNAPSHOT_MAGIC[..shown] {
        return problem(SnapshotProblem::BadMagic);
    }
    if bytes.len() >= 12 && u32_at(bytes, 8) != SNAPSHOT_VERSION {
        return problem(SnapshotProblem::UnsupportedVersion {
            found: u32_at(bytes, 8),
            supported: SNAPSHOT_VERSION,
        });
    }
    if bytes.len() < PREFIX {
        return problem(SnapshotProblem::Truncated {
            needed: PREFIX as u64,
            got,
        });
    }
    let body_len = u32_at(bytes, 12) as u64;
    if body_len > MAX_HEADER {
        return Err(malformed(format!(
            "a header of {body_len} bytes is more than a snapshot holds ({MAX_HEADER})"
        )));
    }
    let needed = PREFIX as u64 + body_len + 4;
    if got < needed {
        return problem(SnapshotProblem::Truncated { needed, got });
    }
    let end = PREFIX + body_len as usize;
    check_crc(bytes, end, "header")?;
    let header = parse_body(&bytes[PREFIX..end])?;
    Ok((header, end + 4))
}

/// Reads header fields, each refused as malformed where the header runs out.
struct Fields<'a>(&'a [u8]);

impl Fields<'_> {
    fn take(&mut self, n: usize, what: &str) -> Result<&[u8]> {
        if self.0.len() < n {
            return Err(malformed(format!("the header ends inside {what}")));
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        let b = self.take(4, what)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    /// A storage type's code.
    fn dtype(&mut self, what: &str) -> Result<DType> {
        let code = self.u32(what)?;
        DType::STORAGE
            .into_iter()
            .find(|d| d.code() == code)
            .ok_or_else(|| malformed(format!("{what}: unknown code {code}")))
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        let b = self.take(8, what)?;
        Ok(u64::from_le_bytes([
            b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7],
        ]))
    }

    /// A `u64` that must fit `usize` on this machine.
    fn size(&mut self, what: &str) -> Result<usize> {
        let n = self.u64(what)?;
        usize::try_from(n).map_err(|_| malformed(format!("{what} {n} does not fit this machine")))
    }
}

fn parse_body(body: &[u8]) -> Result<SnapshotHeader> {
    let mut f = Fields(body);
    let dtype = f.dtype("the storage type")?;
    // A pool made natively may declare more rows than a 32-bit machine counts; none of them holds
    // that many, and `len` (checked below against this) must fit anyway.
    let max_seq_len = f.u64("max_seq_len")?;
    let max_seq_len = usize::try_from(max_seq_len).unwrap_or(usize::MAX);
    let len = f.size("the length")?;
    let page_size = f.size("the page size")?;
    let n_layers = f.u32("the layer count")?;
    // Each layer takes at least 4 header bytes, so this loop is bounded by the header's length.
    let mut layers = Vec::new();
    for layer in 0..n_layers {
        let n_slots = f.u32(&format!("layer {layer}'s slot count"))?;
        let mut slots = Vec::new();
        for slot in 0..n_slots {
            let what = format!("layer {layer} slot {slot}");
            let name_len = f.u32(&what)? as usize;
            let name = std::str::from_utf8(f.take(name_len, &what)?)
                .map_err(|_| malformed(format!("{what}: its name is not UTF-8")))?
                .to_string();
            let rank = f.u32(&what)?;
            let trailing = (0..rank)
                .map(|_| f.size(&format!("{what}'s shape")))
                .collect::<Result<Vec<_>>>()?;
            let mut slot = SlotSpec::new(name, &trailing);
            slot = slot.stored_as(f.dtype(&format!("{what}'s storage type"))?);
            let scale = f.u32(&format!("{what}'s scale"))?;
            slot.scale = (scale != 0).then(|| f32::from_bits(scale));
            slots.push(slot);
        }
        layers.push(LayerSpec::new(slots));
    }
    if !f.0.is_empty() {
        return Err(malformed(format!(
            "{} bytes follow the last layer",
            f.0.len()
        )));
    }
    let spec = CacheSpec::new(layers, dtype, max_seq_len)
        .map_err(|e| malformed(format!("its spec is invalid: {}", bounded(&e))))?;
    if len > max_seq_len {
        return Err(malformed(format!(
            "{len} rows exceed its max_seq_len of {max_seq_len}"
        )));
    }
    Ok(SnapshotHeader {
        spec,
        len,
        page_size,
    })
}

/// CRC-32 (IEEE 802.3, reflected, polynomial 0xEDB88320), as zlib and PNG compute it. `crc32fast`
/// computes it with the CPU's carry-less multiply where there is one (tens of GB/s, so the checksum
/// does not hold back export and import; a table-driven byte loop ran at 0.4 GB/s), with tables
/// elsewhere (the browser).
#[derive(Clone, Debug)]
pub(crate) struct Crc32(crc32fast::Hasher);

impl Crc32 {
    pub(crate) fn new() -> Self {
        Self(crc32fast::Hasher::new())
    }

    pub(crate) fn update(&mut self, bytes: &[u8]) {
        self.0.update(bytes);
    }

    pub(crate) fn finish(&self) -> u32 {
        self.0.clone().finalize()
    }
}

/// The CRC-32 of `bytes`.
pub(crate) fn crc32(bytes: &[u8]) -> u32 {
    let mut c = Crc32::new();
    c.update(bytes);
    c.finish()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::used_row_bytes;
    use crate::error::SpecProblem;
    use crate::reference::Xorshift;

    #[test]
    fn crc32_matches_the_standard_check_value() {
        assert_eq!(crc32(b"123456789"), 0xCBF4_3926);
        assert_eq!(crc32(b""), 0);
        let mut c = Crc32::new();
        c.update(b"1234");
        c.update(b"56789");
        assert_eq!(c.finish(), 0xCBF4_3926);
    }

    pub(super) fn spec(dtype: DType) -> CacheSpec {
        CacheSpec::new(
            vec![
                LayerSpec::kv(2, 3, 3),
                LayerSpec::empty(),
                LayerSpec::new(vec![SlotSpec::new("odd", &[5])]),
            ],
            dtype,
            9,
        )
        .unwrap()
    }

    /// A snapshot of `len` rows of pseudo-random stored bytes (zero padding), and where its rows
    /// start.
    pub(super) fn fabricated(spec: &CacheSpec, len: usize, seed: u64) -> (Vec<u8>, usize) {
        let mut out = Vec::new();
        let mut w = SnapshotWriter::new(&mut out, spec, len, 0).unwrap();
        let mut rng = Xorshift::new(seed);
        for l in 0..spec.n_layers() {
            for s in 0..spec.layers()[l].slots.len() {
                let row = spec.row_bytes(l, s).unwrap() as usize;
                let used = used_row_bytes(
                    spec.layers()[l].slots[s].row_elems(),
                    spec.slot_dtype(l, s).unwrap(),
                ) as usize;
                let mut bytes = vec![0u8; row * len];
                for r in 0..len {
                    for b in &mut bytes[r * row..r * row + used] {
                        *b = rng.below(256) as u8;
                    }
                }
                w.rows(&bytes).unwrap();
            }
        }
        let written = w.finish().unwrap();
        assert_eq!(written, out.len() as u64);
        let rows_at = encode_header(spec, len, 0).len() + 4;
        (out, rows_at)
    }

    fn problem_of(r: Result<Snapshot<'_>>) -> SnapshotProblem {
        match r {
            Err(Error::Snapshot { problem }) => problem,
            Err(e) => panic!("not a snapshot problem: {e}"),
            Ok(_) => panic!("accepted"),
        }
    }

    #[test]
    fn written_snapshots_parse_back() {
        for dtype in DType::ALL {
            let spec = spec(dtype);
            let (bytes, rows_at) = fabricated(&spec, 7, 1);
            let snap = Snapshot::parse_for(&bytes, &spec).unwrap();
            assert_eq!(snap.header.spec, spec);
            assert_eq!(snap.header.len, 7);
            assert_eq!(snap.header.total_bytes(), bytes.len() as u64);
            assert_eq!(
                SnapshotHeader::parse(&bytes[..rows_at]).unwrap(),
                snap.header
            );
            assert_eq!(snap.sections[1].len(), 0);
            assert_eq!(
                snap.sections[2][0].len(),
                7 * spec.row_bytes(2, 0).unwrap() as usize
            );
            assert_eq!(
                snap.sections[0][0].as_ptr() as usize - bytes.as_ptr() as usize,
                rows_at
            );
        }
    }

    #[test]
    fn a_failing_writer_is_a_typed_error() {
        /// Takes `left` bytes, then fails.
        struct Full {
            left: usize,
        }
        impl Write for Full {
            fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
                if self.left == 0 {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::StorageFull,
                        "disk full",
                    ));
                }
                let n = buf.len().min(self.left);
                self.left -= n;
                Ok(n)
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let spec = spec(DType::F32);
        let (bytes, rows_at) = fabricated(&spec, 2, 8);
        for left in [0, 10, rows_at + 3, bytes.len() - 1] {
            let out: &mut dyn Write = &mut Full { left };
            let result = SnapshotWriter::new(out, &spec, 2, 0).and_then(|mut w| {
                w.rows(&bytes[rows_at..bytes.len() - 4])?;
                w.finish()
            });
            let problem = match result {
                Err(Error::Snapshot { problem }) => problem,
                r => panic!("{left}: {r:?}"),
            };
            assert!(
                matches!(&problem, SnapshotProblem::Write { kind: std::io::ErrorKind::StorageFull, reason }
                    if reason == "disk full"),
                "{left}: {problem}"
            );
        }
    }

    /// Writers that break `Write`'s contract: one that says it wrote a byte more than it was given
    /// (`write_all` sliced past the bytes: a panic), and one that writes nothing; and one that is
    /// interrupted once per write, which is written through.
    #[test]
    fn a_writer_breaking_its_contract_is_refused() {
        struct Odd {
            extra: Option<usize>,
            interrupted: bool,
            kept: Vec<u8>,
        }
        impl Write for Odd {
            fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
                if std::mem::take(&mut self.interrupted) {
                    return Err(std::io::ErrorKind::Interrupted.into());
                }
                self.interrupted = true;
                match self.extra {
                    // Says it wrote `extra` more bytes than it got, or (0) none.
                    Some(extra) if extra > 0 => Ok(buf.len() + extra),
                    Some(_) => Ok(0),
                    None => {
                        let n = buf.len().min(3);
                        self.kept.extend_from_slice(&buf[..n]);
                        Ok(n)
                    }
                }
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let spec = spec(DType::F32);
        let (bytes, rows_at) = fabricated(&spec, 2, 8);
        let export = |out: &mut Odd| {
            SnapshotWriter::new(out, &spec, 2, 0).and_then(|mut w| {
                w.rows(&bytes[rows_at..bytes.len() - 4])?;
                w.finish()
            })
        };
        for (extra, wanted, want_kind) in [
            (
                1,
                "the writer said it wrote",
                std::io::ErrorKind::InvalidData,
            ),
            (0, "the writer took none of", std::io::ErrorKind::WriteZero),
        ] {
            let result = export(&mut Odd {
                extra: Some(extra),
                interrupted: false,
                kept: Vec::new(),
            });
            assert!(
                matches!(&result, Err(Error::Snapshot { problem: SnapshotProblem::Write { kind, reason } })
                    if reason.contains(wanted) && *kind == want_kind),
                "{extra}: {result:?}"
            );
        }
        let mut honest = Odd {
            extra: None,
            interrupted: true,
            kept: Vec::new(),
        };
        assert_eq!(export(&mut honest).unwrap(), bytes.len() as u64);
        assert_eq!(honest.kept, bytes);
    }

    /// A header past 16 MiB: no spec describes one (`CacheSpec::new` refuses its description), and
    /// one is refused from its length field.
    #[test]
    fn a_header_over_16_mib_is_neither_built_nor_read() {
        let name = "k".repeat(MAX_HEADER as usize);
        let layer = LayerSpec::new(vec![SlotSpec::new(name, &[4])]);
        let e = CacheSpec::new(vec![layer], DType::F32, 2).unwrap_err();
        assert!(
            matches!(&e, Error::InvalidSpec { problem: SpecProblem::DescriptionTooLarge { bytes, .. } }
                if *bytes == MAX_HEADER + 60),
            "{e}"
        );
        let mut bytes = SNAPSHOT_MAGIC.to_vec();
        bytes.extend_from_slice(&SNAPSHOT_VERSION.to_le_bytes());
        bytes.extend_from_slice(&(MAX_HEADER as u32 + 1).to_le_bytes());
        let prefix = bytes.len();
        bytes.resize(prefix + MAX_HEADER as usize + 1, b'k');
        let crc = crc32(&bytes);
        bytes.extend_from_slice(&crc.to_le_bytes());
        for bytes in [&bytes[..], &bytes[..PREFIX]] {
            let p = match SnapshotHeader::parse(bytes) {
                Err(Error::Snapshot { problem }) => problem,
                r => panic!("{r:?}"),
            };
            assert!(matches!(p, SnapshotProblem::MalformedHeader { .. }), "{p}");
        }
    }

    /// Every spec's description counts the bytes its header takes (storage types, scales, empty
    /// layers and shapes of every rank), so no spec `CacheSpec::new` takes has a header too long.
    #[test]
    fn a_specs_description_is_its_headers_length() {
        let layers = vec![
            LayerSpec::empty(),
            LayerSpec::new(vec![
                SlotSpec::new("keys", &[2, 3, 32]).stored_as(DType::Q8_0),
                SlotSpec::new("v", &[5])
                    .stored_as(DType::F8E4M3)
                    .scaled(0.5),
                SlotSpec::new("", &[]),
            ]),
            LayerSpec::mla(512, 64),
        ];
        let spec = CacheSpec::new(layers, DType::F16, 9).unwrap();
        for spec in [spec, CacheSpec::hybrid(DType::F32, 4).unwrap()] {
            assert_eq!(
                (encode_header(&spec, 3, 2).len() - PREFIX) as u64,
                crate::spec::description_bytes(spec.layers())
            );
        }
    }

    /// The format's edges: a header of exactly 16 MiB is written and read; a short input that is
    /// not a snapshot is refused as such from its first byte, and an unknown version from its 12th;
    /// a whole snapshot is checked for its length and checksums before it is compared with the
    /// destination (a truncated one of another storage type is truncated); a writer whose flush
    /// fails fails the export.
    #[test]
    fn the_formats_edges_are_kept() {
        // A body of MAX_HEADER bytes: 60 of fields around one slot's name of one byte per char.
        let name = "k".repeat(MAX_HEADER as usize - 60);
        let layer = LayerSpec::new(vec![SlotSpec::new(name, &[4])]);
        let huge = CacheSpec::new(vec![layer], DType::F32, 2).unwrap();
        assert_eq!(
            encode_header(&huge, 0, 0).len() - PREFIX,
            MAX_HEADER as usize
        );
        let one_more = LayerSpec::new(vec![SlotSpec::new(
            "k".repeat(MAX_HEADER as usize - 59),
            &[4],
        )]);
        assert!(CacheSpec::new(vec![one_more], DType::F32, 2).is_err());
        let (bytes, rows_at) = fabricated(&huge, 1, 9);
        let snap = Snapshot::parse_for(&bytes, &huge).unwrap();
        assert_eq!((snap.header.len, snap.header.spec), (1, huge));
        assert_eq!(rows_at, PREFIX + MAX_HEADER as usize + 4);

        for short in [&b"P"[..], b"PK\x03\x04", b"KVGPUSNX"] {
            let p = match SnapshotHeader::parse(short) {
                Err(Error::Snapshot { problem }) => problem,
                r => panic!("{short:?}: {r:?}"),
            };
            assert_eq!(p, SnapshotProblem::BadMagic, "{short:?}");
        }
        let mut v1 = SNAPSHOT_MAGIC.to_vec();
        v1.extend_from_slice(&1u32.to_le_bytes());
        let p = match SnapshotHeader::parse(&v1) {
            Err(Error::Snapshot { problem }) => problem,
            r => panic!("{r:?}"),
        };
        assert_eq!(
            p,
            SnapshotProblem::UnsupportedVersion {
                found: 1,
                supported: SNAPSHOT_VERSION
            }
        );

        let (f16, _) = fabricated(&spec(DType::F16), 3, 10);
        let f32_spec = spec(DType::F32);
        let p = problem_of(Snapshot::parse_for(&f16[..f16.len() - 1], &f32_spec));
        assert!(matches!(p, SnapshotProblem::Truncated { .. }), "{p}");
        let mut bad_rows = f16.clone();
        let last = bad_rows.len() - 5;
        bad_rows[last] ^= 1;
        let p = problem_of(Snapshot::parse_for(&bad_rows, &f32_spec));
        assert!(matches!(p, SnapshotProblem::ChecksumMismatch { .. }), "{p}");
        let p = problem_of(Snapshot::parse_for(&f16, &f32_spec));
        assert!(matches!(p, SnapshotProblem::DType { .. }), "{p}");

        struct FailingFlush(Vec<u8>);
        impl Write for FailingFlush {
            fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
                self.0.extend_from_slice(buf);
                Ok(buf.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Err(std::io::Error::other("the disk went away"))
            }
        }
        let f32_snapshot = fabricated(&f32_spec, 2, 11).0;
        let mut out = FailingFlush(Vec::new());
        let result = SnapshotWriter::new(&mut out, &f32_spec, 2, 0).and_then(|mut w| {
            w.rows(
                &f32_snapshot[encode_header(&f32_spec, 2, 0).len() + 4..f32_snapshot.len() - 4],
            )?;
            w.finish()
        });
        assert!(
            matches!(&result, Err(Error::Snapshot { problem: SnapshotProblem::Write { kind: std::io::ErrorKind::Other, reason } })
                if reason == "the disk went away"),
            "{result:?}"
        );
        assert_eq!(out.0, f32_snapshot);
    }

    /// [`a_pinned_snapshot_keeps_its_bytes`]'s snapshot, in hex.
    const PINNED: &str = concat!(
        // magic KVGPUSNP, version 2, a header body of 102 bytes
        "4b56475055534e500200000066000000",
        // f16, max_seq_len 4, len 2, page size 0, 1 layer of 2 slots
        "010000000400000000000000020000000000000000000000000000000100000002000000",
        // "k": rank 2 [1, 2], f16, no scale
        "010000006b02000000010000000000000002000000000000000100000000000000",
        // "v": the same
        "010000007602000000010000000000000002000000000000000100000000000000",
        // the header's CRC-32
        "e12475f1",
        // K's two rows, V's two rows
        "00010203040506074041424344454647",
        // the snapshot's CRC-32
        "9aeb3a4b",
    );

    /// One snapshot pinned byte for byte, so that no change of the format (a field's order, width or
    /// byte order, the magic, the version) passes unnoticed: the writer and the parser share their
    /// constants and layout, so round trips alone would not see one. One layer of K and V [1, 2]
    /// in f16, two rows: written, and read back from the pinned bytes.
    #[test]
    fn a_pinned_snapshot_keeps_its_bytes() {
        let spec = CacheSpec::new(vec![LayerSpec::kv(1, 2, 2)], DType::F16, 4).unwrap();
        let mut out = Vec::new();
        let mut w = SnapshotWriter::new(&mut out, &spec, 2, 0).unwrap();
        let row_bytes = spec.row_bytes(0, 0).unwrap() as usize;
        for slot in 0..2u8 {
            let rows: Vec<u8> = (0..2 * row_bytes as u8).map(|b| slot * 0x40 + b).collect();
            w.rows(&rows).unwrap();
        }
        w.finish().unwrap();
        let hex: String = out.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(hex, PINNED, "the snapshot's bytes changed");
        let pinned: Vec<u8> = (0..PINNED.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&PINNED[i..i + 2], 16).unwrap())
            .collect();
        let snap = Snapshot::parse_for(&pinned, &spec).unwrap();
        assert_eq!((&snap.header.spec, snap.header.len), (&spec, 2));
        assert_eq!(snap.sections[0][0], &[0, 1, 2, 3, 4, 5, 6, 7]);
        assert_eq!(
            snap.sections[0][1],
            &[0x40, 0x41, 0x42, 0x43, 0x44, 0x45, 0x46, 0x47]
        );
    }

    #[test]
    fn every_truncation_is_refused_as_truncated() {
        let spec = spec(DType::F16);
        let (bytes, rows_at) = fabricated(&spec, 4, 2);
        for cut in 0..bytes.len() {
            match problem_of(Snapshot::parse_for(&bytes[..cut], &spec)) {
                SnapshotProblem::Truncated { needed, got } => {
                    assert_eq!(got, cut as u64);
                    assert!(needed > got && needed <= bytes.len() as u64, "cut {cut}");
                }
                p => panic!("cut at {cut}: {p}"),
            }
        }
        let e = Snapshot::parse_for(&bytes[..20], &spec).err().unwrap();
        assert_eq!(
            e.to_string(),
            format!(
                "snapshot: truncated: 20 bytes, but at least {} are needed",
                rows_at
            )
        );
        let mut longer = bytes.clone();
        longer.push(0);
        let e = Snapshot::parse_for(&longer, &spec).err().unwrap();
        assert_eq!(
            e.to_string(),
            format!(
                "snapshot: {} bytes, but the snapshot ends after {}",
                bytes.len() + 1,
                bytes.len()
            )
        );
    }

    #[test]
    fn every_bit_flip_is_refused_by_what_it_hits() {
        let spec = spec(DType::BF16);
        let (bytes, rows_at) = fabricated(&spec, 3, 3);
        for at in 0..bytes.len() {
            for bit in 0..8 {
                let mut bad = bytes.clone();
                bad[at] ^= 1 << bit;
                let p = problem_of(Snapshot::parse_for(&bad, &spec));
                let ok = match at {
                    0..8 => p == SnapshotProblem::BadMagic,
                    8..12 => matches!(p, SnapshotProblem::UnsupportedVersion { .. }),
                    // The header length's top byte: over 16 MiB, refused from the field.
                    15 => matches!(p, SnapshotProblem::MalformedHeader { .. }),
                    // Its other bytes: longer than the bytes, or the wrong bytes checksummed.
                    12..15 => matches!(
                        p,
                        SnapshotProblem::Truncated { .. }
                            | SnapshotProblem::ChecksumMismatch {
                                section: "header",
                                ..
                            }
                    ),
                    _ if at < rows_at => matches!(
                        p,
                        SnapshotProblem::ChecksumMismatch {
                            section: "header",
                            ..
                        }
                    ),
                    _ => matches!(
                        p,
                        SnapshotProblem::ChecksumMismatch {
                            section: "snapshot",
                            ..
                        }
                    ),
                };
                assert!(ok, "byte {at} bit {bit}: {p}");
            }
        }
    }

    #[test]
    fn garbage_is_refused_without_panicking() {
        let spec = spec(DType::F32);
        let (good, rows_at) = fabricated(&spec, 2, 4);
        let mut rng = Xorshift::new(5);
        for round in 0..2000 {
            let n = rng.below(200);
            let mut bytes: Vec<u8> = (0..n).map(|_| rng.below(256) as u8).collect();
            // Half keep a valid prefix, so the parser gets past the magic and version.
            if round % 2 == 1 {
                let keep = rng.below(rows_at + 1);
                bytes.splice(0..0, good[..keep].iter().copied());
            }
            assert!(Snapshot::parse_for(&bytes, &spec).is_err());
            let _ = SnapshotHeader::parse(&bytes);
        }
    }

    #[test]
    fn malformed_headers_with_valid_checksums_are_refused() {
        let spec = spec(DType::F32);
        // A header whose checksum is right but whose contents are not: rebuilt around each body.
        let with_body = |body: &[u8]| {
            let mut b = SNAPSHOT_MAGIC.to_vec();
            b.extend_from_slice(&SNAPSHOT_VERSION.to_le_bytes());
            b.extend_from_slice(&(body.len() as u32).to_le_bytes());
            b.extend_from_slice(body);
            let crc = crc32(&b);
            b.extend_from_slice(&crc.to_le_bytes());
            b
        };
        let good = encode_header(&spec, 2, 0)[PREFIX..].to_vec();
        let mut cases: Vec<Vec<u8>> = vec![Vec::new(), good[..good.len() - 1].to_vec()];
        let mut unknown_type = good.clone();
        unknown_type[0] = 9;
        cases.push(unknown_type);
        let mut too_long = good.clone();
        too_long[12] = 10; // len 10 > max_seq_len 9
        cases.push(too_long);
        let mut extra = good.clone();
        extra.push(0);
        cases.push(extra);
        let mut many_layers = good.clone();
        many_layers[28..32].copy_from_slice(&u32::MAX.to_le_bytes());
        cases.push(many_layers);
        // Slot "k"'s name (byte 40 of the body) as a byte that is not UTF-8.
        assert_eq!(good[40], b'k');
        let mut not_utf8 = good.clone();
        not_utf8[40] = 0xff;
        let p = match SnapshotHeader::parse(&with_body(&not_utf8)) {
            Err(Error::Snapshot { problem }) => problem,
            r => panic!("{r:?}"),
        };
        assert!(p.to_string().contains("its name is not UTF-8"), "{p}");
        for body in cases {
            let p = match SnapshotHeader::parse(&with_body(&body)) {
                Err(Error::Snapshot { problem }) => problem,
                r => panic!("{r:?}"),
            };
            assert!(matches!(p, SnapshotProblem::MalformedHeader { .. }), "{p}");
        }
    }

    /// A snapshot that did not fit in host memory is refused as out of memory, naming its length;
    /// any other refusal of the export is passed on, and a finished export gives its bytes.
    #[test]
    fn a_snapshot_past_host_memory_is_out_of_memory() {
        let mut out = SnapshotBytes::default();
        out.write_all(b"kvgpu").unwrap();
        let e = Error::Snapshot {
            problem: SnapshotProblem::Write {
                kind: std::io::ErrorKind::OutOfMemory,
                reason: "the snapshot does not fit in host memory".into(),
            },
        };
        let full = SnapshotBytes {
            refused: Some(3 << 30),
            ..SnapshotBytes::default()
        };
        assert!(matches!(
            full.finish(Err(e.clone())),
            Err(Error::OutOfMemory { bytes, .. }) if bytes == 3 << 30
        ));
        let other = SnapshotBytes::default().finish(Err(e.clone()));
        assert_eq!(other, Err(e));
        assert_eq!(out.finish(Ok(5)).unwrap(), b"kvgpu");
        // Growth past what one allocation holds is refused (no allocation is tried), counted, and
        // named out of memory.
        let mut out = SnapshotBytes::default();
        out.write_all(b"kvgpu").unwrap();
        let refused = out.grow(isize::MAX as usize).unwrap_err();
        assert_eq!(refused.kind(), std::io::ErrorKind::OutOfMemory);
        let wanted = 5 + isize::MAX as u64;
        assert_eq!(out.refused, Some(wanted));
        assert!(matches!(
            out.finish(Err(write_error(refused))),
            Err(Error::OutOfMemory { bytes, .. }) if bytes == wanted
        ));
    }

    /// A header whose spec names a slot with a megabyte and gives it 100,000 dimensions, one of
    /// them 0, is refused with a message of about a kilobyte: the spec's error would name the slot
    /// and its shape whole.
    #[test]
    fn a_hostile_spec_in_a_header_gets_a_short_message() {
        let name = "x".repeat(1 << 20);
        let layer = LayerSpec::new(vec![SlotSpec::new(name, &vec![1; 100_000])]);
        let spec = CacheSpec::new(vec![layer], DType::F32, 2).unwrap();
        let mut bytes = encode_header(&spec, 0, 0);
        // The last dimension, before the slot's type and scale, becomes 0.
        let last = bytes.len() - 16;
        assert_eq!(bytes[last..last + 8], 1u64.to_le_bytes());
        bytes[last..last + 8].copy_from_slice(&0u64.to_le_bytes());
        let crc = crc32(&bytes);
        bytes.extend_from_slice(&crc.to_le_bytes());
        let p = match SnapshotHeader::parse(&bytes) {
            Err(Error::Snapshot { problem }) => problem,
            r => panic!("{r:?}"),
        };
        let text = p.to_string();
        assert!(
            matches!(&p, SnapshotProblem::MalformedHeader { detail } if detail.len() < 1100)
                && text.len() < 1200
                && text.contains("xxxx"),
            "{} bytes: {}",
            text.len(),
            &text[..text.len().min(300)]
        );
        // The shape alone, under a short name: its first dimensions and how many more.
        let layer = LayerSpec::new(vec![SlotSpec::new("k", &vec![0; 100_000])]);
        let e = CacheSpec::new(vec![layer], DType::F32, 2)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("[0, 0, 0, 0, 0, 0, 0, 0] and 99992 more dimensions") && e.len() < 200,
            "{e}"
        );
    }

    /// A valid header whose slot has 100,000 dimensions of 1 is refused by a destination of another
    /// shape with an error that keeps 8 of them, and says how many there were.
    #[test]
    fn a_slot_shape_refusal_keeps_a_few_dimensions_of_a_hostile_shape() {
        let layer = LayerSpec::new(vec![SlotSpec::new("k", &vec![1; 100_000])]);
        let spec = CacheSpec::new(vec![layer], DType::F32, 2).unwrap();
        let (bytes, _) = fabricated(&spec, 1, 1);
        let dest = CacheSpec::new(
            vec![LayerSpec::new(vec![SlotSpec::new("k", &[1, 1])])],
            DType::F32,
            2,
        )
        .unwrap();
        let p = problem_of(Snapshot::parse_for(&bytes, &dest));
        let text = p.to_string();
        match &p {
            SnapshotProblem::SlotShape {
                layer: 0,
                slot: 0,
                snapshot,
                snapshot_rank: 100_000,
                cache,
            } => assert!(snapshot == &[1; 8] && cache == &[1, 1], "{p:?}"),
            _ => panic!("{text}"),
        }
        assert!(
            text.contains("[1, 1, 1, 1, 1, 1, 1, 1] and 99992 more dimensions in the snapshot")
                && text.len() < 200,
            "{text}"
        );
    }

    #[test]
    fn slots_of_their_own_types_round_trip_and_must_match() {
        let spec = spec(DType::F16)
            .with_slot_dtype("v", DType::F8E4M3)
            .and_then(|s| s.with_slot_dtype("odd", DType::F32))
            .and_then(|s| s.with_slot_scale(0, 1, 0.5))
            .unwrap();
        let (bytes, rows_at) = fabricated(&spec, 4, 3);
        let header = SnapshotHeader::parse(&bytes[..rows_at]).unwrap();
        assert_eq!(header.spec, spec);
        assert_eq!(header.total_bytes(), bytes.len() as u64);
        let snap = Snapshot::parse_for(&bytes, &spec).unwrap();
        // V of 2 x 3 fp8 bytes: 8 bytes a row; the odd slot of 5 f32.
        assert_eq!(snap.sections[0][1].len(), 4 * 8);
        assert_eq!(snap.sections[2][0].len(), 4 * 20);
        // A destination whose V is stored otherwise is refused, naming the slot and both types.
        let unscaled = CacheSpec::new(
            spec.layers()
                .iter()
                .map(|l| {
                    LayerSpec::new(
                        l.slots
                            .iter()
                            .map(|s| SlotSpec {
                                scale: None,
                                ..s.clone()
                            })
                            .collect(),
                    )
                })
                .collect(),
            spec.dtype(),
            9,
        )
        .unwrap();
        let f16_v = unscaled.with_slot_dtype("v", DType::F16).unwrap();
        assert_eq!(
            problem_of(Snapshot::parse_for(&bytes, &f16_v)),
            SnapshotProblem::DType {
                layer: 0,
                slot: 1,
                snapshot: DType::F8E4M3,
                cache: DType::F16,
            }
        );
        // So is one whose V has another scale, or none.
        assert_eq!(
            problem_of(Snapshot::parse_for(&bytes, &unscaled)),
            SnapshotProblem::Scale {
                layer: 0,
                slot: 1,
                snapshot: Some(0.5),
                cache: None,
            }
        );
        let other = spec.with_slot_scale(0, 1, 0.25).unwrap();
        assert!(matches!(
            problem_of(Snapshot::parse_for(&bytes, &other)),
            SnapshotProblem::Scale { .. }
        ));
        // Version 1 (one storage type for the whole cache) is refused by its number.
        let mut v1 = bytes.clone();
        v1[8..12].copy_from_slice(&1u32.to_le_bytes());
        assert_eq!(
            SnapshotHeader::parse(&v1).unwrap_err(),
            Error::Snapshot {
                problem: SnapshotProblem::UnsupportedVersion {
                    found: 1,
                    supported: 2
                }
            }
        );
    }

    #[test]
    fn incompatible_destinations_are_named() {
        let spec = spec(DType::F32);
        let (bytes, _) = fabricated(&spec, 2, 6);
        let other = |layers, dtype| CacheSpec::new(layers, dtype, 9).unwrap();
        let cases = [
            (other(spec.layers().to_vec(), DType::F16), "dtype"),
            (other(spec.layers()[..2].to_vec(), DType::F32), "layers"),
            (
                other(
                    vec![
                        LayerSpec::kv(2, 3, 3),
                        LayerSpec::kv(1, 1, 1),
                        LayerSpec::mla(5, 1),
                    ],
                    DType::F32,
                ),
                "slots",
            ),
            (
                other(
                    vec![
                        LayerSpec::kv(2, 3, 3),
                        LayerSpec::empty(),
                        LayerSpec::new(vec![SlotSpec::new("odd", &[5, 1])]),
                    ],
                    DType::F32,
                ),
                "shape",
            ),
        ];
        for (dest, what) in cases {
            let p = problem_of(Snapshot::parse_for(&bytes, &dest));
            let ok = match what {
                "dtype" => matches!(p, SnapshotProblem::DType { .. }),
                "layers" => matches!(p, SnapshotProblem::LayerCount { .. }),
                "slots" => matches!(p, SnapshotProblem::SlotCount { layer: 1, .. }),
                _ => matches!(
                    p,
                    SnapshotProblem::SlotShape {
                        layer: 2,
                        slot: 0,
                        ..
                    }
                ),
            };
            assert!(ok, "{what}: {p}");
        }
        // Names and capacity may differ.
        let renamed = CacheSpec::new(
            vec![
                LayerSpec::new(vec![
                    SlotSpec::new("a", &[2, 3]),
                    SlotSpec::new("b", &[2, 3]),
                ]),
                LayerSpec::empty(),
                LayerSpec::new(vec![SlotSpec::new("c", &[5])]),
            ],
            DType::F32,
            100,
        )
        .unwrap();
        assert!(Snapshot::parse_for(&bytes, &renamed).is_ok());
    }

    /// A header built by hand with more rows than any `u64` counts saturates its sizes.
    #[test]
    fn sizes_of_a_header_built_by_hand_saturate() {
        let header = SnapshotHeader {
            spec: CacheSpec::llama3_8b(DType::F16, 1).unwrap(),
            len: usize::MAX,
            page_size: 0,
        };
        assert_eq!(header.rows_bytes(), u64::MAX);
        assert_eq!(header.total_bytes(), u64::MAX);
        assert_eq!(header.section_bytes(0, 0), u64::MAX);
    }
}
