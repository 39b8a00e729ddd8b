//! A snapshot that arrives in pieces (a file read in chunks, a network stream): checked as
//! [`super::Snapshot::parse_for`] checks a whole one, with each piece of a slot's rows handed on
//! as it arrives, so that nothing holds the whole snapshot. The verdict on the checksum comes only
//! at the end, so the rows must be kept aside until [`SnapshotStream::finish`] accepts them.

use super::{Crc32, SnapshotHeader, malformed, parse_header, problem, u32_at};
use crate::error::{Error, Result, SnapshotProblem};
use crate::spec::CacheSpec;

/// Where a stream's pieces go: told the header once it checks out (and may refuse it), then
/// given every slot's rows in order, in pieces.
pub(crate) trait RowSink {
    fn header(&mut self, header: &SnapshotHeader) -> Result<()>;
    /// Bytes `[offset, offset + bytes.len())` of the stored rows of (`layer`, `slot`); a refusal
    /// ends the stream.
    fn rows(&mut self, layer: usize, slot: usize, offset: u64, bytes: &[u8]) -> Result<()>;
}

/// What the header says about the rest.
struct Layout {
    header: SnapshotHeader,
    /// Where the rows start, and the snapshot's total length.
    rows_at: u64,
    total: u64,
    /// `(layer, slot, first byte, bytes)` of every non-empty section, in order.
    sections: Vec<(usize, usize, u64, u64)>,
}

/// A snapshot being checked piece by piece; see the module docs.
pub(crate) struct SnapshotStream {
    dest: CacheSpec,
    /// The prefix and header, until the header is read.
    head: Vec<u8>,
    layout: Option<Layout>,
    /// The section the next row bytes belong to.
    section: usize,
    crc: Crc32,
    /// The stored checksum's bytes, as they arrive.
    tail: Vec<u8>,
    received: u64,
    /// The first refusal: every later call repeats it.
    failed: Option<Error>,
}

impl SnapshotStream {
    /// A stream of a snapshot to restore into a cache or pool of `dest`.
    pub(crate) fn new(dest: &CacheSpec) -> Self {
        Self {
            dest: dest.clone(),
            head: Vec::new(),
            layout: None,
            section: 0,
            crc: Crc32::new(),
            tail: Vec::new(),
            received: 0,
            failed: None,
        }
    }

    /// Takes the next bytes. A refusal is final: the stream repeats it from then on.
    pub(crate) fn push(&mut self, bytes: &[u8], sink: &mut impl RowSink) -> Result<()> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        self.take(bytes, sink)
            .inspect_err(|e| self.failed = Some(e.clone()))
    }

    fn take(&mut self, mut bytes: &[u8], sink: &mut impl RowSink) -> Result<()> {
        while self.layout.is_none() {
            match parse_header(&self.head) {
                Ok((header, rows_at)) => self.start(header, rows_at as u64, sink)?,
                // A header longer than `MAX_HEADER` is refused before it is buffered.
                Err(Error::Snapshot {
                    problem: SnapshotProblem::Truncated { needed, .. },
                }) => {
                    if bytes.is_empty() {
                        return Ok(());
                    }
                    let n = (needed as usize - self.head.len()).min(bytes.len());
                    self.head.extend_from_slice(&bytes[..n]);
                    bytes = &bytes[n..];
                }
                Err(e) => return Err(e),
            }
        }
        let Some(layout) = &self.layout else {
            return Ok(());
        };
        let (rows_end, total) = (layout.total - 4, layout.total);
        while !bytes.is_empty() {
            let at = self.received;
            if at >= total {
                return problem(SnapshotProblem::TrailingBytes {
                    expected: total,
                    got: at + bytes.len() as u64,
                });
            }
            if at >= rows_end {
                let n = within(total - at, bytes.len());
                self.tail.extend_from_slice(&bytes[..n]);
                self.received += n as u64;
                bytes = &bytes[n..];
                continue;
            }
            let n = within(rows_end - at, bytes.len());
            let (rows, rest) = bytes.split_at(n);
            self.crc.update(rows);
            let mut offset = at - layout.rows_at;
            let mut rows = rows;
            while !rows.is_empty() {
                let (layer, slot, first, size) = layout.sections[self.section];
                let k = within(first + size - offset, rows.len());
                sink.rows(layer, slot, offset - first, &rows[..k])?;
                offset += k as u64;
                rows = &rows[k..];
                if offset == first + size {
                    self.section += 1;
                }
            }
            self.received += n as u64;
            bytes = rest;
        }
        Ok(())
    }

    /// The header checked out: its layout, compatibility with the destination, the sink's say.
    fn start(
        &mut self,
        header: SnapshotHeader,
        rows_at: u64,
        sink: &mut impl RowSink,
    ) -> Result<()> {
        let total = rows_at
            .checked_add(header.rows_bytes())
            .and_then(|t| t.checked_add(4))
            .ok_or_else(|| malformed("its rows come to more bytes than can be counted".into()))?;
        header.check_compatible(&self.dest)?;
        sink.header(&header)?;
        let mut first = 0;
        let mut sections = Vec::new();
        for (l, layer) in header.spec.layers().iter().enumerate() {
            for s in 0..layer.slots.len() {
                let size = header.section_bytes(l, s);
                if size > 0 {
                    sections.push((l, s, first, size));
                }
                first += size;
            }
        }
        self.crc.update(&self.head);
        self.received = self.head.len() as u64;
        self.layout = Some(Layout {
            header,
            rows_at,
            total,
            sections,
        });
        Ok(())
    }

    /// The end of the stream: the header it carried, once the length and the checksum of the whole
    /// check out.
    pub(crate) fn finish(self) -> Result<SnapshotHeader> {
        if let Some(e) = self.failed {
            return Err(e);
        }
        let Some(layout) = self.layout else {
            // Not even the header arrived: the whole parse says what is missing.
            return parse_header(&self.head).map(|(header, _)| header);
        };
        if self.received < layout.total {
            return problem(SnapshotProblem::Truncated {
                needed: layout.total,
                got: self.received,
            });
        }
        let (stored, computed) = (u32_at(&self.tail, 0), self.crc.finish());
        if stored != computed {
            return problem(SnapshotProblem::ChecksumMismatch {
                section: "snapshot",
                stored,
                computed,
            });
        }
        Ok(layout.header)
    }
}

/// Bytes to take of `available` when `remaining` are still wanted: counted in 64 bits, so a stream
/// with more than 4 GiB left does not wrap on 32-bit targets (wasm32), where the cast of 2^32 left
/// took nothing and the import never ended.
fn within(remaining: u64, available: usize) -> usize {
    remaining.min(available as u64) as usize
}

#[cfg(test)]
mod tests {
    use super::super::tests::{fabricated, spec};
    use super::*;
    use crate::codec::DType;
    use crate::reference::Xorshift;

    #[test]
    fn the_bytes_taken_do_not_wrap_past_4_gib() {
        assert_eq!(within(1 << 32, 10), 10);
        assert_eq!(within((1 << 32) + 3, 10), 10);
        assert_eq!(within(3, 10), 3);
        assert_eq!(within(0, 10), 0);
    }

    /// Collects every piece into per-slot byte vectors, refusing nothing (or the header, when told).
    #[derive(Default)]
    struct Collect {
        refuse: bool,
        headers: usize,
        rows: std::collections::BTreeMap<(usize, usize), Vec<u8>>,
    }

    impl RowSink for Collect {
        fn header(&mut self, _: &SnapshotHeader) -> Result<()> {
            self.headers += 1;
            if self.refuse {
                return Err(malformed("refused by the sink".into()));
            }
            Ok(())
        }
        fn rows(&mut self, layer: usize, slot: usize, offset: u64, bytes: &[u8]) -> Result<()> {
            let v = self.rows.entry((layer, slot)).or_default();
            assert_eq!(v.len() as u64, offset, "pieces arrive in order");
            v.extend_from_slice(bytes);
            Ok(())
        }
    }

    /// Feeds `bytes` in pseudo-random pieces; the verdict and what the sink got.
    fn feed(bytes: &[u8], dest: &CacheSpec, seed: u64) -> (Result<SnapshotHeader>, Collect) {
        let mut rng = Xorshift::new(seed);
        let mut stream = SnapshotStream::new(dest);
        let mut sink = Collect::default();
        let mut at = 0;
        while at < bytes.len() {
            let n = match rng.below(4) {
                0 => 1,
                1 => rng.below(8),
                _ => rng.below(64),
            }
            .min(bytes.len() - at);
            if let Err(e) = stream.push(&bytes[at..at + n], &mut sink) {
                // A refusal is final.
                assert_eq!(stream.push(&[], &mut sink).unwrap_err(), e);
                return (Err(e), sink);
            }
            at += n;
        }
        (stream.finish(), sink)
    }

    fn problem_of(r: Result<SnapshotHeader>) -> SnapshotProblem {
        match r {
            Err(Error::Snapshot { problem }) => problem,
            r => panic!("expected a snapshot problem, got {r:?}"),
        }
    }

    #[test]
    fn pieces_of_any_size_give_every_slot_its_rows() {
        for dtype in DType::ALL {
            let spec = spec(dtype);
            for len in [0, 1, 5] {
                let (bytes, rows_at) = fabricated(&spec, len, len as u64);
                for seed in 0..20 {
                    let (header, sink) = feed(&bytes, &spec, seed);
                    let header = header.unwrap();
                    assert_eq!((header.len, sink.headers), (len, 1));
                    let mut at = rows_at;
                    for (l, s) in [(0, 0), (0, 1), (2, 0)] {
                        let n = spec.row_bytes(l, s).unwrap() as usize * len;
                        let got = sink.rows.get(&(l, s)).map_or(&[][..], |v| &v[..]);
                        assert_eq!(got, &bytes[at..at + n], "{dtype} len {len} seed {seed}");
                        at += n;
                    }
                }
            }
        }
    }

    #[test]
    fn truncations_flips_and_trailing_bytes_are_refused_as_a_whole_snapshot_is() {
        let spec = spec(DType::F16);
        let (bytes, _) = fabricated(&spec, 3, 9);
        for cut in 0..bytes.len() {
            let p = problem_of(feed(&bytes[..cut], &spec, cut as u64).0);
            assert!(
                matches!(p, SnapshotProblem::Truncated { got, .. } if got == cut as u64),
                "cut {cut}: {p}"
            );
        }
        let mut longer = bytes.clone();
        longer.extend_from_slice(&[1, 2]);
        // The count is of the bytes received when the refusal came: one or both of the two more.
        let n = bytes.len() as u64;
        for seed in 0..8 {
            let p = problem_of(feed(&longer, &spec, seed).0);
            assert!(
                matches!(p, SnapshotProblem::TrailingBytes { expected, got }
                    if expected == n && (got == n + 1 || got == n + 2)),
                "{p}"
            );
        }
        for at in 0..bytes.len() {
            let mut bad = bytes.clone();
            bad[at] ^= 0x10;
            let whole = super::super::Snapshot::parse_for(&bad, &spec)
                .err()
                .unwrap();
            let streamed = feed(&bad, &spec, at as u64).0.unwrap_err();
            // The header length's lower bytes may be refused as a truncation at a different
            // length; its top byte makes a header over 16 MiB, refused alike.
            if !(12..15).contains(&at) {
                assert_eq!(streamed, whole, "byte {at}");
            }
        }
    }

    #[test]
    fn the_header_is_refused_before_any_rows() {
        let spec = spec(DType::F32);
        let (bytes, _) = fabricated(&spec, 2, 3);
        let other = CacheSpec::new(spec.layers().to_vec(), DType::BF16, 9).unwrap();
        let (r, sink) = feed(&bytes, &other, 0);
        assert!(matches!(problem_of(r), SnapshotProblem::DType { .. }));
        assert!(sink.rows.is_empty() && sink.headers == 0);
        let mut stream = SnapshotStream::new(&spec);
        let mut sink = Collect {
            refuse: true,
            ..Default::default()
        };
        assert!(stream.push(&bytes, &mut sink).is_err());
        assert!(sink.rows.is_empty());
        // A header longer than a stream holds.
        let mut huge = bytes.clone();
        huge[12..16].copy_from_slice(&u32::MAX.to_le_bytes());
        let p = problem_of(feed(&huge, &spec, 0).0);
        assert!(matches!(p, SnapshotProblem::MalformedHeader { .. }), "{p}");
        // Garbage never panics.
        let mut rng = Xorshift::new(4);
        for _ in 0..500 {
            let n = rng.below(100);
            let mut junk: Vec<u8> = (0..n).map(|_| rng.below(256) as u8).collect();
            let keep = rng.below(bytes.len());
            junk.splice(0..0, bytes[..keep].iter().copied());
            assert!(feed(&junk, &spec, n as u64).0.is_err());
        }
    }
}
