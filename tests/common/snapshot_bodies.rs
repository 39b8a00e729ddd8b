//! Snapshots: round trips over pseudo-random caches of every storage type (hybrid layers without
//! slots, MLA shapes, odd 16-bit widths), between single-sequence caches and pool sequences (forked
//! ones sharing pages included), bit for bit and through attention; refusals of corrupt, truncated
//! and incompatible snapshots that change nothing; and the bytes of a seeded cache, the same on
//! every backend. Native (`tests/snapshot.rs`) and browser suites run the same bodies.

use super::{append_random, assert_close, cache_on, kernels_for, values};
use kvgpu::reference::{self, Xorshift};
use kvgpu::*;
use std::sync::Arc;

/// A pseudo-random spec: 1 to 4 layers, each without slots, GQA K/V, MLA latents or one slot of
/// rank 0 to 3, with odd widths; at least one slot somewhere.
fn random_spec(rng: &mut Xorshift, dtype: DType) -> CacheSpec {
    loop {
        let n_layers = 1 + rng.below(4);
        // Innermost dimensions of whole blocks for the block-quantized types.
        let b = dtype.block().unwrap_or(1);
        let mut dim = |n: usize| 1 + rng.below(n);
        let layers: Vec<LayerSpec> = (0..n_layers)
            .map(|_| match dim(4) {
                1 => LayerSpec::empty(),
                2 => LayerSpec::kv(dim(3), b * dim(9), b * dim(9)),
                3 => LayerSpec::mla(b * dim(17), b * dim(5)),
                _ => {
                    let rank = dim(4) - 1;
                    let mut trailing: Vec<usize> = (0..rank).map(|_| dim(4)).collect();
                    if let Some(last) = trailing.last_mut() {
                        *last *= b;
                    }
                    LayerSpec::new(vec![SlotSpec::new("x", &trailing)])
                }
            })
            .collect();
        if let Ok(spec) = CacheSpec::new(layers, dtype, dim(40)) {
            return spec;
        }
    }
}

/// A [`random_spec`] of whole blocks whose every slot is stored in a pseudo-random type of its own
/// (some fp8 slots scaled).
fn random_mixed_spec(rng: &mut Xorshift) -> CacheSpec {
    let spec = random_spec(rng, DType::Q8_0);
    let mut layers = spec.layers().to_vec();
    for slot in layers.iter_mut().flat_map(|l| &mut l.slots) {
        let dtype = DType::STORAGE[rng.below(DType::STORAGE.len())];
        slot.dtype = Some(dtype);
        // Half the fp8 slots scaled.
        if dtype.is_fp8() && rng.below(2) == 0 {
            slot.scale = Some((1 + rng.below(400)) as f32 / 128.0);
        }
    }
    let default = DType::STORAGE[rng.below(DType::STORAGE.len())];
    CacheSpec::new(layers, default, spec.max_seq_len()).unwrap()
}

/// `spec` with another capacity.
fn with_capacity(spec: &CacheSpec, max_seq_len: usize) -> CacheSpec {
    CacheSpec::new(spec.layers().to_vec(), spec.dtype(), max_seq_len).unwrap()
}

/// The (layer, slot) pairs of a spec, in order.
fn slots_of(spec: &CacheSpec) -> Vec<(usize, usize)> {
    (0..spec.n_layers())
        .flat_map(|l| (0..spec.layers()[l].slots.len()).map(move |s| (l, s)))
        .collect()
}

/// Steps of pseudo-random host appends to every layer with slots, `len` committed rows in all.
fn fill(c: &mut KvCache, len: usize, rng: &mut Xorshift) {
    let spec = c.spec().clone();
    while c.len() < len {
        let n = 1 + rng.below((len - c.len()).min(6));
        for (l, layer) in spec.layers().iter().enumerate() {
            if !layer.slots.is_empty() {
                append_random(c, l, n, rng.below(1 << 20) as u64);
            }
        }
        c.advance(n).unwrap();
    }
}

/// The stored words of the first `rows` rows of every slot of a cache.
async fn words(c: &KvCache, rows: usize) -> Vec<Vec<u32>> {
    let mut all = Vec::new();
    for (l, s) in slots_of(c.spec()) {
        let row_words = (c.spec().row_bytes(l, s).unwrap() / 4) as usize;
        let mut w = c.read_words_async(l, s).await.unwrap();
        w.truncate(rows * row_words);
        all.push(w);
    }
    all
}

/// The stored words of the visible rows of every slot of a pool sequence.
async fn seq_words(c: &PagedCache, seq: SeqId) -> Vec<Vec<u32>> {
    let mut all = Vec::new();
    for (l, s) in slots_of(c.spec()) {
        all.push(c.read_words_async(seq, l, s).await.unwrap());
    }
    all
}

/// Every word of every slot buffer of a cache, visible or not.
async fn all_words(c: &KvCache) -> Vec<Vec<u32>> {
    let mut all = Vec::new();
    for (l, s) in slots_of(c.spec()) {
        all.push(c.read_full_words_async(l, s).await.unwrap());
    }
    all
}

/// Every word of every pool buffer.
async fn pool_words(c: &PagedCache) -> Vec<Vec<u32>> {
    let mut all = Vec::new();
    for (l, s) in slots_of(c.spec()) {
        all.push(c.read_pool_words_async(l, s).await.unwrap());
    }
    all
}

fn pool(g: &Gpu, spec: CacheSpec, page_size: usize, n_pages: usize) -> PagedCache {
    PagedCache::with_kernels(kernels_for(g), spec, page_size, n_pages).unwrap()
}

/// Pseudo-random caches of every storage type and of slots in mixed types, some with pending rows of an unfinished step (not
/// part of the snapshot): each snapshot restores bit for bit into an empty cache of another
/// capacity, into a pool sequence of a random page size, and from there back into a cache whose
/// snapshot equals the first one byte for byte.
pub async fn snapshots_round_trip_bit_for_bit(g: &Gpu) {
    let mut rng = Xorshift::new(12);
    // Every storage type, then slots of mixed types.
    for dtype in DType::STORAGE.map(Some).into_iter().chain([None]) {
        for round in 0..10 {
            let spec = match dtype {
                Some(dtype) => random_spec(&mut rng, dtype),
                None => random_mixed_spec(&mut rng),
            };
            let what = format!("{dtype:?} round {round}");
            let mut c = cache_on(g, spec.clone());
            let len = match round {
                0 => 0,
                1 => spec.max_seq_len(),
                _ => rng.below(spec.max_seq_len() + 1),
            };
            fill(&mut c, len, &mut rng);
            let pending = round % 2 == 1 && c.remaining() > 0;
            if pending {
                let layer = slots_of(&spec)[0].0;
                append_random(&mut c, layer, 1, 99);
            }
            let bytes = c.snapshot_async().await.unwrap();
            let header = SnapshotHeader::parse(&bytes).unwrap();
            assert_eq!((header.len, header.page_size), (len, 0), "{what}");
            assert_eq!(header.spec, spec, "{what}");
            assert_eq!(header.total_bytes(), bytes.len() as u64, "{what}");
            let want = words(&c, len).await;

            let mut restored = cache_on(g, with_capacity(&spec, len.max(1) + rng.below(4)));
            assert_eq!(restored.import(&bytes).unwrap(), len, "{what}");
            assert_eq!(restored.len(), len, "{what}");
            assert_eq!(words(&restored, len).await, want, "{what}: restored cache");

            let page_size = 1 + rng.below(5);
            let n_pages = len.div_ceil(page_size) + rng.below(3);
            let mut p = pool(g, spec.clone(), page_size, n_pages.max(1));
            let seq = p.import_sequence(&bytes).unwrap();
            assert_eq!(p.len(seq).unwrap(), len, "{what}");
            assert_eq!(seq_words(&p, seq).await, want, "{what}: pool sequence");

            let from_pool = p.snapshot_sequence_async(seq).await.unwrap();
            assert_eq!(
                SnapshotHeader::parse(&from_pool).unwrap().page_size,
                page_size
            );
            let mut back = cache_on(g, spec.clone());
            back.import(&from_pool).unwrap();
            assert_eq!(
                back.snapshot_async().await.unwrap(),
                bytes,
                "{what}: cache -> pool -> cache"
            );
        }
    }
}

/// The cache the failing writer and reader tests move (GQA, an empty layer and MLA, f16), filled
/// with 20 rows from `seed`; its snapshot and its spec.
async fn filled_f16_cache(g: &Gpu, seed: u64) -> (KvCache, Vec<u8>, CacheSpec) {
    let spec = CacheSpec::new(
        vec![
            LayerSpec::kv(2, 8, 5),
            LayerSpec::empty(),
            LayerSpec::mla(7, 3),
        ],
        DType::F16,
        24,
    )
    .unwrap();
    let mut c = cache_on(g, spec.clone());
    fill(&mut c, 20, &mut Xorshift::new(seed));
    let bytes = c.snapshot_async().await.unwrap();
    (c, bytes, spec)
}

/// A writer that takes `left` bytes and then fails, as a full disk does.
struct FullDisk {
    kept: Vec<u8>,
    left: usize,
}

impl std::io::Write for FullDisk {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.left == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::StorageFull,
                "disk full",
            ));
        }
        let n = buf.len().min(self.left);
        self.kept.extend_from_slice(&buf[..n]);
        self.left -= n;
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// An export into a writer that fails part way (in the header, in the rows of the first, a middle
/// and the last slot, in the checksum) stops with the writer's error after writing what it took, and
/// leaves nothing behind: the cache and a pool sequence export the same bytes again.
pub async fn a_failing_writer_stops_the_export(g: &Gpu) {
    let (c, bytes, spec) = filled_f16_cache(g, 31).await;
    let mut p = pool(g, spec, 4, 6);
    let seq = p.import_sequence(&bytes).unwrap();
    let from_pool = p.snapshot_sequence_async(seq).await.unwrap();
    for whole in [&bytes, &from_pool] {
        let n = whole.len();
        for left in [0, 10, n / 3, n / 2, 3 * n / 4, n - 2] {
            let mut out = FullDisk {
                kept: Vec::new(),
                left,
            };
            let e = if whole == &bytes {
                c.export_async(&mut out).await.unwrap_err()
            } else {
                p.export_sequence_async(seq, &mut out).await.unwrap_err()
            };
            assert!(
                matches!(&e, Error::Snapshot { problem: SnapshotProblem::Write { kind, reason } }
                    if reason == "disk full" && *kind == std::io::ErrorKind::StorageFull),
                "{left} of {n} bytes: {e}"
            );
            assert_eq!(out.kept, whole[..left], "{left} of {n} bytes");
        }
    }
    assert_eq!(c.snapshot_async().await.unwrap(), bytes);
    assert_eq!(p.snapshot_sequence_async(seq).await.unwrap(), from_pool);
}

/// A reader that hands out `whole` in pieces of at most `piece` bytes, is interrupted before every
/// piece (as a reader may be; the import reads again) and fails once it has handed out `fail_at`
/// bytes, as a broken connection does.
struct BrokenReader<'a> {
    whole: &'a [u8],
    at: usize,
    piece: usize,
    fail_at: usize,
    interrupted: bool,
}

impl std::io::Read for BrokenReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.interrupted = !self.interrupted;
        if self.interrupted {
            return Err(std::io::ErrorKind::Interrupted.into());
        }
        if self.at >= self.fail_at {
            return Err(std::io::Error::new(
                std::io::ErrorKind::ConnectionReset,
                "connection reset",
            ));
        }
        let n = (buf.len().min(self.piece))
            .min(self.fail_at - self.at)
            .min(self.whole.len() - self.at);
        buf[..n].copy_from_slice(&self.whole[self.at..self.at + n]);
        self.at += n;
        Ok(n)
    }
}

/// An import from a reader that fails part way (before the header, in it, in the rows, in the
/// checksum) stops with the reader's error and changes nothing: the cache stays empty, the pool's
/// ledger as it was. Interrupted reads are read again, and the same reader that does not fail
/// restores the rows bit for bit, into the cache and into the pool.
pub async fn a_failing_reader_stops_the_import(g: &Gpu) {
    let (c, bytes, spec) = filled_f16_cache(g, 37).await;
    let n = bytes.len();
    let reader = |fail_at| BrokenReader {
        whole: &bytes,
        at: 0,
        piece: 100,
        fail_at,
        interrupted: false,
    };
    let mut fresh = cache_on(g, spec.clone());
    let mut p = pool(g, spec, 4, 6);
    let before = p.ledger().clone();
    let (fresh_words, pool_before) = (all_words(&fresh).await, pool_words(&p).await);
    let broken = |e: &Error| {
        matches!(e, Error::Snapshot { problem: SnapshotProblem::Read { kind, reason } }
            if reason == "connection reset" && *kind == std::io::ErrorKind::ConnectionReset)
    };
    for fail_at in [0, 10, n / 3, n / 2, n - 2] {
        let e = fresh.import_from(reader(fail_at)).unwrap_err();
        assert!(broken(&e), "{fail_at} of {n} bytes: {e}");
        assert_eq!(fresh.len(), 0, "{fail_at} of {n} bytes");
        let e = p.import_sequence_from(reader(fail_at)).unwrap_err();
        assert!(broken(&e), "{fail_at} of {n} bytes, pool: {e}");
        assert_eq!(p.ledger(), &before, "{fail_at} of {n} bytes");
    }
    // Nothing the interrupted imports staged reached a slot.
    assert_eq!(all_words(&fresh).await, fresh_words);
    assert_eq!(pool_words(&p).await, pool_before);
    assert_eq!(fresh.import_from(reader(usize::MAX)).unwrap(), 20);
    assert_eq!(fresh.snapshot_async().await.unwrap(), bytes);
    let seq = p.import_sequence_from(reader(usize::MAX)).unwrap();
    for (layer, slots) in [(0, 2), (2, 2)] {
        for slot in 0..slots {
            assert_eq!(
                p.read_f32_async(seq, layer, slot).await.unwrap(),
                c.read_f32_async(layer, slot).await.unwrap(),
                "layer {layer} slot {slot}"
            );
        }
    }
}

const PAGE: usize = 4;

fn attention_spec(dtype: DType) -> CacheSpec {
    // Whole blocks of 32 for the block-quantized types.
    let (kv, mla) = match dtype.block() {
        Some(b) => (LayerSpec::kv(2, b, b), LayerSpec::mla(2 * b, b)),
        None => (LayerSpec::kv(2, 8, 5), LayerSpec::mla(7, 3)),
    };
    CacheSpec::new(vec![kv, LayerSpec::empty(), mla], dtype, 32).unwrap()
}

/// Attention of the last `n_q` rows of layers 0 (GQA, 4 heads) and 2 (MLA, 2 heads) of
/// [`attention_spec`] over `kv`, against the twins over `rows` (per layer, per slot, the stored
/// values as f32).
async fn check_attention(g: &Gpu, kv: Kv<'_>, rows: &[Vec<Vec<f32>>], n_q: usize, what: &str) {
    let mut att = Attention::with_kernels(kernels_for(g));
    let opts = AttentionOptions::default();
    let spec = match kv {
        Kv::Cache(c) => c.spec(),
        Kv::Sequence(p, _) | Kv::Batch(p, _) => p.spec(),
    };
    let width_of = |l: usize, s: usize| *spec.layers()[l].slots[s].trailing.last().unwrap();
    let (d_k, d_v, r, rope) = (
        width_of(0, 0),
        width_of(0, 1),
        width_of(2, 0),
        width_of(2, 1),
    );
    for (layer, heads, d, width) in [(0, 4, d_k, d_v), (2, 2, r, r)] {
        let q = values(layer as u64 + 5, n_q * heads * d);
        let q2 = values(layer as u64 + 6, n_q * heads * rope);
        let qb = super::f32_buffer(&g.device, &q).await;
        let q2b = super::f32_buffer(&g.device, &q2).await;
        let out = super::output(&g.device, n_q * heads * width).await;
        let want = if layer == 0 {
            att.gqa(kv, 0, Queries::new(&qb, n_q, heads, d), &out, &opts)
                .unwrap();
            reference::attention_gqa(&q, [n_q, heads, d], &rows[0][0], &rows[0][1], 2, d_v, &opts)
        } else {
            let mla = MlaQueries {
                latent: Queries::new(&qb, n_q, heads, d),
                rope: Queries::new(&q2b, n_q, heads, rope),
            };
            att.mla(kv, 2, mla, &out, &opts).unwrap();
            let (latent, pe) = (&rows[2][0], &rows[2][1]);
            reference::attention_mla(&q, &q2, [n_q, heads, d], latent, pe, rope, &opts)
        };
        let got = super::read_f32(g, &out).await;
        assert_close(&got, &want, &format!("{what}: layer {layer} attention"));
    }
}

/// The stored values of `seq`'s visible rows, per layer, per slot.
async fn seq_rows(c: &PagedCache, seq: SeqId) -> Vec<Vec<Vec<f32>>> {
    let mut rows = Vec::new();
    for (l, layer) in c.spec().layers().iter().enumerate() {
        let mut slots = Vec::new();
        for s in 0..layer.slots.len() {
            slots.push(c.read_f32_async(seq, l, s).await.unwrap());
        }
        rows.push(slots);
    }
    rows
}

/// Appends `n` pseudo-random rows to every layer with slots of `seq` and commits them.
fn grow(c: &mut PagedCache, seq: SeqId, n: usize, seed: u64) {
    let spec = c.spec().clone();
    for (l, layer) in spec.layers().iter().enumerate() {
        let shapes: Vec<Vec<usize>> = layer
            .slots
            .iter()
            .map(|s| [&[n][..], &s.trailing].concat())
            .collect();
        let data: Vec<Vec<f32>> = shapes
            .iter()
            .enumerate()
            .map(|(s, sh)| values(seed * 13 + (l * 2 + s) as u64, sh.iter().product()))
            .collect();
        let slabs: Vec<HostSlab> = data
            .iter()
            .zip(&shapes)
            .map(|(d, sh)| HostSlab::f32(d, sh))
            .collect();
        if !slabs.is_empty() {
            c.append(seq, l, &slabs).unwrap();
        }
    }
    c.advance(seq, n).unwrap();
}

/// A pool's sequence and a fork of it that shares its pages (cut inside a page, then grown), each
/// exported and restored into a single-sequence cache, into another pool and into the same pool:
/// the rows are the same bit for bit, and attention over every copy matches the twins over the
/// originals' rows. The forked snapshot restores into pages of its own.
pub async fn pool_sequences_and_forks_round_trip(g: &Gpu) {
    for dtype in DType::STORAGE {
        note!("-- {dtype}");
        let spec = attention_spec(dtype);
        let mut p = pool(g, spec.clone(), PAGE, 24);
        let parent = p.add_sequence().unwrap();
        grow(&mut p, parent, 10, 1);
        let child = p.fork(parent, 6).unwrap();
        grow(&mut p, child, 3, 2);
        for (seq, len) in [(parent, 10), (child, 9)] {
            let what = format!("{dtype} {seq}");
            let rows = seq_rows(&p, seq).await;
            let want = seq_words(&p, seq).await;
            let bytes = p.snapshot_sequence_async(seq).await.unwrap();
            assert_eq!(SnapshotHeader::parse(&bytes).unwrap().len, len);

            let mut c = cache_on(g, spec.clone());
            c.import(&bytes).unwrap();
            assert_eq!(words(&c, len).await, want, "{what}: into a cache");
            check_attention(g, Kv::Cache(&c), &rows, 3, &format!("{what} cache")).await;

            let mut other = pool(g, with_capacity(&spec, len), 3, 4);
            let copy = other.import_sequence(&bytes).unwrap();
            assert_eq!(
                seq_words(&other, copy).await,
                want,
                "{what}: into another pool"
            );
            check_attention(
                g,
                Kv::Sequence(&other, copy),
                &rows,
                1,
                &format!("{what} pool"),
            )
            .await;

            let free = p.free_pages();
            let again = p.import_sequence(&bytes).unwrap();
            assert_eq!(
                free - p.free_pages(),
                len.div_ceil(PAGE),
                "{what}: fresh pages"
            );
            assert_eq!(
                seq_words(&p, again).await,
                want,
                "{what}: into the same pool"
            );
            check_attention(
                g,
                Kv::Sequence(&p, again),
                &rows,
                2,
                &format!("{what} same pool"),
            )
            .await;
        }
        // The originals are untouched by the restores beside them.
        assert_eq!(p.len(parent).unwrap(), 10);
        assert_eq!(p.len(child).unwrap(), 9);
        // Rows appended and not yet advanced are not part of a snapshot: the fork's is as before
        // (they fill the rest of its last page and a page past it).
        let before = p.snapshot_sequence_async(child).await.unwrap();
        let (k, v) = (&spec.layers()[0].slots[0], &spec.layers()[0].slots[1]);
        let n = PAGE + 1;
        let shapes = [
            [&[n][..], &k.trailing].concat(),
            [&[n][..], &v.trailing].concat(),
        ];
        let data = [
            values(90, shapes[0].iter().product()),
            values(91, shapes[1].iter().product()),
        ];
        let slabs = [
            HostSlab::f32(&data[0], &shapes[0]),
            HostSlab::f32(&data[1], &shapes[1]),
        ];
        p.append(child, 0, &slabs).unwrap();
        let after = p.snapshot_sequence_async(child).await.unwrap();
        assert!(
            after == before,
            "{dtype}: pending rows in the snapshot ({} bytes, {} before)",
            after.len(),
            before.len()
        );
    }
}

/// The problem of a refused snapshot.
/// The snapshot of a cache of `spec` holding two random rows.
async fn two_rows_of(g: &Gpu, spec: CacheSpec, rng: &mut Xorshift) -> Vec<u8> {
    let mut c = cache_on(g, spec);
    fill(&mut c, 2, rng);
    c.snapshot_async().await.unwrap()
}

fn problem_of<T: std::fmt::Debug>(r: Result<T>, what: &str) -> SnapshotProblem {
    match r {
        Err(Error::Snapshot { problem }) => problem,
        r => panic!("{what}: expected a snapshot problem, got {r:?}"),
    }
}

/// Truncations inside every part (magic, version, header, header checksum, each slot's rows, the
/// final checksum), bit flips in each, trailing bytes, other storage types and shapes, a cache that
/// is not empty, too little capacity, too few pages: each refused with its error, and neither the
/// destination's bytes nor its ledger change.
pub async fn refused_snapshots_change_nothing(g: &Gpu) {
    let mut rng = Xorshift::new(7);
    for dtype in DType::STORAGE {
        let spec = attention_spec(dtype);
        let mut src = cache_on(g, spec.clone());
        fill(&mut src, 9, &mut rng);
        let bytes = src.snapshot_async().await.unwrap();
        let header = SnapshotHeader::parse(&bytes).unwrap();
        let rows_at = bytes.len() - header.rows_bytes() as usize - 4;

        // Destinations with something in them: a cache and a pool with a sequence.
        let mut cache = cache_on(g, spec.clone());
        fill(&mut cache, 3, &mut rng);
        cache.truncate(0).unwrap();
        let mut p = pool(g, spec.clone(), PAGE, 5);
        let held = p.add_sequence().unwrap();
        grow(&mut p, held, 10, 3);
        let (cache_before, pool_before) = (all_words(&cache).await, pool_words(&p).await);
        let (cache_ledger, pool_ledger) = (cache.ledger().clone(), p.ledger().clone());

        let mut cases: Vec<(String, Vec<u8>, &str)> = Vec::new();
        let section_ends: Vec<usize> = slots_of(&spec)
            .iter()
            .scan(rows_at, |at, &(l, s)| {
                *at += spec.row_bytes(l, s).unwrap() as usize * 9;
                Some(*at)
            })
            .collect();
        let mut cuts = vec![
            0,
            3,
            8,
            10,
            12,
            15,
            16,
            20,
            rows_at - 5,
            rows_at - 1,
            rows_at,
        ];
        for &end in &section_ends {
            cuts.extend([end - 3, end - 1, end]);
        }
        cuts.push(bytes.len() - 1);
        for cut in cuts {
            cases.push((format!("cut at {cut}"), bytes[..cut].to_vec(), "truncated"));
        }
        for (at, kind) in [
            (0, "magic"),
            (9, "version"),
            (17, "header"),
            (rows_at - 2, "header"),
            (rows_at + 1, "rows"),
            (section_ends[1] + 2, "rows"),
            (bytes.len() - 6, "rows"),
            (bytes.len() - 1, "rows"),
        ] {
            let mut bad = bytes.clone();
            bad[at] ^= 1 << rng.below(8);
            cases.push((format!("bit flip at {at}"), bad, kind));
        }
        let mut longer = bytes.clone();
        longer.extend_from_slice(&[0; 4]);
        cases.push(("4 more bytes".into(), longer, "trailing"));
        for other in DType::STORAGE.into_iter().filter(|&d| d != dtype) {
            let bad = two_rows_of(g, attention_spec(other), &mut rng).await;
            cases.push((format!("{other} snapshot"), bad, "dtype"));
        }
        if dtype.is_fp8() {
            // The same types, but K scaled: a snapshot scaled otherwise is refused like another type.
            let scaled = attention_spec(dtype).with_slot_scale(0, 0, 2.5).unwrap();
            let bad = two_rows_of(g, scaled, &mut rng).await;
            cases.push(("K scaled by 2.5".into(), bad, "scale"));
        }
        // attention_spec with a narrower latent slot.
        let mut layers = attention_spec(dtype).layers().to_vec();
        layers[2].slots[0].trailing[0] -= dtype.block().unwrap_or(1);
        let narrower = CacheSpec::new(layers, dtype, 32).unwrap();
        let bad = two_rows_of(g, narrower, &mut rng).await;
        cases.push(("another shape".into(), bad, "shape"));

        for (what, bad, kind) in &cases {
            let what = format!("{dtype} {what}");
            for p in [
                problem_of(cache.import(bad), &what),
                problem_of(p.import_sequence(bad), &what),
            ] {
                let ok = match *kind {
                    "truncated" => matches!(p, SnapshotProblem::Truncated { .. }),
                    "magic" => p == SnapshotProblem::BadMagic,
                    "version" => matches!(p, SnapshotProblem::UnsupportedVersion { .. }),
                    "header" => matches!(
                        p,
                        SnapshotProblem::ChecksumMismatch {
                            section: "header",
                            ..
                        }
                    ),
                    "rows" => matches!(
                        p,
                        SnapshotProblem::ChecksumMismatch {
                            section: "snapshot",
                            ..
                        }
                    ),
                    "trailing" => matches!(p, SnapshotProblem::TrailingBytes { .. }),
                    "dtype" => matches!(p, SnapshotProblem::DType { .. }),
                    "scale" => matches!(
                        p,
                        SnapshotProblem::Scale {
                            layer: 0,
                            slot: 0,
                            snapshot: Some(2.5),
                            cache: None,
                        }
                    ),
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
        }

        // Too little capacity, and a pool with too few pages or too short a longest sequence.
        let e = p.import_sequence(&bytes).unwrap_err();
        assert_eq!(e, Error::OutOfPages { needed: 3, free: 2 }, "{dtype}");
        let mut small = cache_on(g, with_capacity(&spec, 8));
        let small_before = all_words(&small).await;
        let e = small.import(&bytes).unwrap_err();
        assert!(
            matches!(
                e,
                Error::CapacityExceeded {
                    seq: None,
                    n_new: 9,
                    capacity: 8,
                    ..
                }
            ),
            "{dtype}: {e}"
        );
        assert_eq!(
            all_words(&small).await,
            small_before,
            "{dtype}: small cache"
        );
        assert_eq!(small.len(), 0);
        let mut short = pool(g, with_capacity(&spec, 8), PAGE, 8);
        let e = short.import_sequence(&bytes).unwrap_err();
        // The sequence the import would have added is not named: the pool never handed it out.
        assert!(
            matches!(e, Error::CapacityExceeded { seq: None, .. }),
            "{dtype}: {e}"
        );
        assert_eq!(short.ledger().sequences().count(), 0);
        assert_eq!(short.free_pages(), 8);

        assert_eq!(cache.ledger(), &cache_ledger, "{dtype}: cache ledger");
        assert_eq!(p.ledger(), &pool_ledger, "{dtype}: pool ledger");
        assert_eq!(
            all_words(&cache).await,
            cache_before,
            "{dtype}: cache bytes"
        );
        assert_eq!(pool_words(&p).await, pool_before, "{dtype}: pool bytes");

        // A cache that is not empty: pending rows, then committed ones.
        append_random(&mut cache, 0, 1, 5);
        let e = problem_of(cache.import(&bytes), "pending");
        assert_eq!(e, SnapshotProblem::NotEmpty { len: 0, pending: 1 });
        cache.truncate(0).unwrap();
        let mut full = cache_on(g, spec.clone());
        fill(&mut full, 2, &mut rng);
        let e = problem_of(full.import(&bytes), "committed");
        assert_eq!(e, SnapshotProblem::NotEmpty { len: 2, pending: 0 });
        assert_eq!(full.len(), 2);

        // And the same destinations still take the good snapshot.
        cache.import(&bytes).unwrap();
        assert_eq!(words(&cache, 9).await, words(&src, 9).await);
    }
}

/// A cache of `spec` filled the same way on any device: host appends (converted on the host) and
/// appends from an f32 GPU buffer (converted by the slab-write kernel), 11 rows.
async fn seeded(g: &Gpu, kernels: &Arc<Kernels>, spec: CacheSpec) -> KvCache {
    let mut c = KvCache::with_kernels(kernels.clone(), spec.clone()).unwrap();
    let mut rng = Xorshift::new(2024);
    fill(&mut c, 6, &mut rng);
    let n = 5;
    let data: Vec<Vec<Vec<f32>>> = spec
        .layers()
        .iter()
        .enumerate()
        .map(|(l, layer)| {
            (0..layer.slots.len())
                .map(|s| values((l * 2 + s) as u64 + 77, n * layer.slots[s].row_elems()))
                .collect()
        })
        .collect();
    for (l, layer) in spec.layers().iter().enumerate() {
        let mut buffers = Vec::new();
        for d in &data[l] {
            buffers.push(super::f32_buffer(&g.device, d).await);
        }
        let shapes: Vec<Vec<usize>> = layer
            .slots
            .iter()
            .map(|s| [&[n][..], &s.trailing].concat())
            .collect();
        let slabs: Vec<GpuSlab> = buffers
            .iter()
            .zip(&shapes)
            .map(|(buffer, shape)| GpuSlab {
                buffer,
                dtype: DType::F32,
                offset: 0,
                shape,
                strides: None,
            })
            .collect();
        if !slabs.is_empty() {
            c.append_gpu(l, &slabs).unwrap();
        }
    }
    c.advance(n).unwrap();
    c
}

/// A seeded cache and a pool sequence forked from it, exported on `from` and restored on `to`: the
/// rows are the same bit for bit, and the restored cache's snapshot equals the original byte for
/// byte (natively `tests/snapshot.rs` runs this from Vulkan to OpenGL and back).
pub async fn restore_on_another_device(from: &Gpu, to: &Gpu) {
    // Registries of their own: wgpu compares devices of two instances by an id that may be equal,
    // so the suite's registry-per-device lookup could hand one device's registry to the other.
    let (kf, kt) = (
        Kernels::new(&from.device, &from.queue).unwrap(),
        Kernels::new(&to.device, &to.queue).unwrap(),
    );
    let cache = |k: &Arc<Kernels>, spec: &CacheSpec| {
        KvCache::with_kernels(k.clone(), spec.clone()).unwrap()
    };
    let pool = |k: &Arc<Kernels>, spec: &CacheSpec, page_size, n_pages| {
        PagedCache::with_kernels(k.clone(), spec.clone(), page_size, n_pages).unwrap()
    };
    for dtype in DType::STORAGE {
        let spec = attention_spec(dtype);
        let c = seeded(from, &kf, spec.clone()).await;
        let bytes = c.snapshot_async().await.unwrap();
        let want = words(&c, 11).await;
        let mut there = cache(&kt, &spec);
        there.import(&bytes).unwrap();
        assert_eq!(
            words(&there, 11).await,
            want,
            "{dtype}: cache on the other device"
        );
        assert_eq!(
            there.snapshot_async().await.unwrap(),
            bytes,
            "{dtype}: its snapshot"
        );

        let mut p = pool(&kf, &spec, 3, 12);
        let seq = p.import_sequence(&bytes).unwrap();
        let fork = p.fork(seq, 7).unwrap();
        grow(&mut p, fork, 2, 9);
        let fork_bytes = p.snapshot_sequence_async(fork).await.unwrap();
        let mut q = pool(&kt, &spec, 5, 4);
        let moved = q.import_sequence(&fork_bytes).unwrap();
        assert_eq!(
            seq_words(&q, moved).await,
            seq_words(&p, fork).await,
            "{dtype}: forked pool sequence on the other device"
        );
    }
}

/// The same seeded cache gives the same snapshot on every backend (Vulkan, OpenGL, the browser's
/// WebGPU): its length and last four bytes, the checksum of the whole, are pinned here per storage
/// type and for a cache of mixed types. (The header ends in its own checksum, after which a CRC-32's
/// state is the same whatever the header held: the pinned checksum speaks for the rows, the length
/// and the header's own checks for the header.)
pub async fn the_snapshot_of_a_seeded_cache_is_the_same_on_every_backend(g: &Gpu) {
    const MIXED_SIZE: usize = 3103;
    const MIXED_CRC: u32 = 0x7d83_df5e;
    // Measured on lavapipe (Vulkan) and llvmpipe (OpenGL); the browser suite checks SwiftShader.
    let pinned = [
        (DType::F32, 1783, 0xcad1_678e),
        (DType::F16, 1035, 0xc24b_8734),
        (DType::BF16, 1035, 0x9b99_00fc),
        (DType::Q8_0, 2839, 0x0620_d4ac),
        (DType::Q4_0, 1607, 0x8ff4_2065),
        (DType::F8E4M3, 639, 0x58f0_f2d4),
        (DType::F8E5M2, 639, 0xc991_1140),
    ];
    // And K, V, latent and rope key in four types, the rope key's fp8 scaled by 1/4.
    let mixed = attention_spec(DType::Q8_0)
        .with_slot_dtype("v", DType::Q4_0)
        .and_then(|s| s.with_slot_dtype("k_pe", DType::F8E4M3))
        .and_then(|s| s.with_slot_dtype("compressed_kv", DType::BF16))
        .and_then(|s| s.with_slot_scale(2, 1, 0.25))
        .unwrap();
    let cases = pinned
        .map(|(dtype, size, crc)| (dtype.to_string(), attention_spec(dtype), size, crc))
        .into_iter()
        .chain([("mixed".to_string(), mixed, MIXED_SIZE, MIXED_CRC)]);
    // Every case is measured (and noted) before the first mismatch is reported.
    let mut got = Vec::new();
    for (what, spec, size, checksum) in cases {
        let c = seeded(g, &kernels_for(g), spec).await;
        let bytes = c.snapshot_async().await.unwrap();
        let crc = u32::from_le_bytes(bytes[bytes.len() - 4..].try_into().unwrap());
        note!("{what}: {} bytes, checksum {crc:#010x}", bytes.len());
        got.push((what, (bytes.len(), crc), (size, checksum)));
    }
    for (what, got, want) in got {
        assert_eq!(got, want, "{what}: the snapshot's bytes");
    }
}

/// [`restore_on_another_device`] from the suite's device to a second device of WebGPU's default
/// limits.
pub async fn snapshots_move_between_devices(g: &Gpu) {
    let other = super::default_limits_gpu(g).await;
    restore_on_another_device(g, &other).await;
    restore_on_another_device(&other, g).await;
}

/// Pushes `bytes` into a streamed cache import in pseudo-random pieces (some empty, some of one
/// byte); the first refusal, or the rows restored.
fn push_cache(c: &mut KvCache, bytes: &[u8], seed: u64) -> Result<usize> {
    let mut import = c.import_stream()?;
    for piece in pieces(bytes, seed) {
        import.push(piece)?;
    }
    import.finish()
}

/// [`push_cache`] for a pool sequence.
fn push_pool(p: &mut PagedCache, bytes: &[u8], seed: u64) -> Result<SeqId> {
    let mut import = p.import_sequence_stream();
    for piece in pieces(bytes, seed) {
        import.push(piece)?;
    }
    import.finish()
}

/// `bytes` cut into pseudo-random pieces: empty, single bytes, short and long ones.
fn pieces(bytes: &[u8], seed: u64) -> Vec<&[u8]> {
    let mut rng = Xorshift::new(seed);
    let mut out = Vec::new();
    let mut at = 0;
    while at < bytes.len() {
        let n = match rng.below(5) {
            0 => 0,
            1 => 1,
            2 => rng.below(16),
            3 => rng.below(4096),
            _ => rng.below(3 << 20),
        }
        .min(bytes.len() - at);
        out.push(&bytes[at..at + n]);
        at += n;
    }
    out
}

/// Streamed imports (pieces of any size, and `import_from` a reader) restore what whole imports
/// restore, into caches and pool sequences, for pseudo-random caches of every storage type and a
/// snapshot of 17 MiB (past the staging piece and the flushing submission); a stream refused at
/// its header (another shape, no room, too few pages) or at its end (cut short, a flipped bit)
/// changes nothing.
pub async fn streamed_imports_match_whole_ones(g: &Gpu) {
    let mut rng = Xorshift::new(31);
    for dtype in DType::STORAGE {
        for round in 0..4 {
            let what = format!("{dtype} round {round}");
            let spec = random_spec(&mut rng, dtype);
            let mut c = cache_on(g, spec.clone());
            let len = rng.below(spec.max_seq_len() + 1);
            fill(&mut c, len, &mut rng);
            let bytes = c.snapshot_async().await.unwrap();
            let want = words(&c, len).await;
            let mut a = cache_on(g, spec.clone());
            assert_eq!(push_cache(&mut a, &bytes, round).unwrap(), len, "{what}");
            assert_eq!(words(&a, len).await, want, "{what}: streamed into a cache");
            let mut b = cache_on(g, spec.clone());
            b.import_from(std::io::Cursor::new(&bytes)).unwrap();
            assert_eq!(words(&b, len).await, want, "{what}: from a reader");
            let mut p = pool(g, spec.clone(), 1 + rng.below(4), len.max(1));
            let seq = push_pool(&mut p, &bytes, round + 7).unwrap();
            assert_eq!(
                seq_words(&p, seq).await,
                want,
                "{what}: streamed into a pool"
            );
            let seq = p.import_sequence_from(std::io::Cursor::new(&[][..]));
            assert!(matches!(
                seq,
                Err(Error::Snapshot {
                    problem: SnapshotProblem::Truncated { needed: 16, got: 0 }
                })
            ));
        }
    }

    // 17 MiB: 70,000 rows of 64 f32, and an odd f16 slot whose padding lands across pieces.
    let spec = CacheSpec::new(
        vec![LayerSpec::new(vec![
            SlotSpec::new("wide", &[64]),
            SlotSpec::new("odd", &[3]),
        ])],
        DType::F32,
        70_000,
    )
    .unwrap();
    let mut c = cache_on(g, spec.clone());
    append_random(&mut c, 0, 70_000, 4);
    c.advance(70_000).unwrap();
    let bytes = c.snapshot_async().await.unwrap();
    assert!(bytes.len() > 17 << 20);
    let mut a = cache_on(g, spec.clone());
    push_cache(&mut a, &bytes, 3).unwrap();
    assert_eq!(words(&a, 70_000).await, words(&c, 70_000).await, "17 MiB");

    // Refusals: at the header, and at the end, each leaving the destination as it was.
    let spec = attention_spec(DType::F16);
    let mut src = cache_on(g, spec.clone());
    fill(&mut src, 9, &mut rng);
    let bytes = src.snapshot_async().await.unwrap();
    let mut cache = cache_on(g, spec.clone());
    fill(&mut cache, 4, &mut rng);
    cache.truncate(0).unwrap();
    // A pool with room for it, and one with two pages too few.
    let mut p = pool(g, spec.clone(), PAGE, 8);
    let mut tight = pool(g, spec.clone(), PAGE, 5);
    for q in [&mut p, &mut tight] {
        let held = q.add_sequence().unwrap();
        grow(q, held, 10, 3);
    }
    let (cache_before, pool_before) = (all_words(&cache).await, pool_words(&p).await);
    let (cache_ledger, pool_ledger) = (cache.ledger().clone(), p.ledger().clone());
    let (tight_before, tight_ledger) = (pool_words(&tight).await, tight.ledger().clone());
    let mut flipped = bytes.clone();
    flipped[bytes.len() - 9] ^= 4;
    for (what, bad) in [
        ("cut short", bytes[..bytes.len() - 3].to_vec()),
        ("a flipped bit", flipped),
    ] {
        // Cut short, the stream ends before the length its header gave; a flipped row bit fails
        // the checksum of the whole.
        let named = |e: &SnapshotProblem| match what {
            "cut short" => matches!(e, SnapshotProblem::Truncated { .. }),
            _ => matches!(e, SnapshotProblem::ChecksumMismatch { .. }),
        };
        let e = problem_of(push_cache(&mut cache, &bad, 1), what);
        assert!(named(&e), "{what}: {e}");
        let e = problem_of(push_pool(&mut p, &bad, 2), what);
        assert!(named(&e), "{what}: {e}");
    }
    // Too few pages and too little room are known from the header: the first push refuses.
    let mut import = tight.import_sequence_stream();
    let e = import.push(&bytes[..200]).unwrap_err();
    assert_eq!(e, Error::OutOfPages { needed: 3, free: 2 });
    assert_eq!(
        import.push(&bytes[200..]).unwrap_err(),
        e,
        "a refusal is final"
    );
    assert_eq!(import.finish().unwrap_err(), e);
    let mut small = cache_on(g, with_capacity(&spec, 8));
    let mut import = small.import_stream().unwrap();
    let e = import.push(&bytes).unwrap_err();
    assert!(matches!(e, Error::CapacityExceeded { .. }), "{e}");
    let mut other = cache_on(g, attention_spec(DType::BF16));
    let e = problem_of(push_cache(&mut other, &bytes, 5), "bf16 cache");
    assert!(matches!(e, SnapshotProblem::DType { .. }), "{e}");

    assert_eq!(cache.ledger(), &cache_ledger, "cache ledger");
    assert_eq!(p.ledger(), &pool_ledger, "pool ledger");
    assert_eq!(all_words(&cache).await, cache_before, "cache bytes");
    assert_eq!(pool_words(&p).await, pool_before, "pool bytes");
    assert_eq!(tight.ledger(), &tight_ledger, "tight pool ledger");
    assert_eq!(pool_words(&tight).await, tight_before, "tight pool bytes");

    // A cache that is not empty is refused before anything arrives.
    append_random(&mut cache, 0, 1, 1);
    let e = problem_of(cache.import_stream().map(drop), "pending");
    assert_eq!(e, SnapshotProblem::NotEmpty { len: 0, pending: 1 });
}

/// Where a snapshot's header checksum sits (after the magic, the version, the header's length and
/// the header); its rows start 4 bytes later.
fn header_end(bytes: &[u8]) -> usize {
    16 + u32::from_le_bytes(bytes[12..16].try_into().unwrap()) as usize
}

/// Writes both checksums of a snapshot whose bytes a test changed: the header's and the whole's.
fn reseal(bytes: &mut [u8]) {
    let at = header_end(bytes);
    let crc = crc32fast::hash(&bytes[..at]);
    bytes[at..at + 4].copy_from_slice(&crc.to_le_bytes());
    let end = bytes.len() - 4;
    let crc = crc32fast::hash(&bytes[..end]);
    bytes[end..].copy_from_slice(&crc.to_le_bytes());
}

/// A snapshot whose header declares a longest sequence of 2^40 rows (a pool made natively may) and
/// holds 5: it restores on every target, whole and streamed, into a cache and into a pool. A 32-bit
/// machine reads that `max_seq_len` as `usize::MAX`.
pub async fn a_longest_sequence_past_32_bits_restores_everywhere(g: &Gpu) {
    let mut rng = Xorshift::new(40);
    let spec = CacheSpec::new(
        vec![LayerSpec::kv(2, 4, 4), LayerSpec::mla(6, 2)],
        DType::F16,
        8,
    )
    .unwrap();
    let mut c = cache_on(g, spec.clone());
    fill(&mut c, 5, &mut rng);
    let mut bytes = c.snapshot_async().await.unwrap();
    let want = words(&c, 5).await;
    // After the magic, the version, the header's length and its storage type.
    bytes[20..28].copy_from_slice(&(1u64 << 40).to_le_bytes());
    reseal(&mut bytes);

    let header = SnapshotHeader::parse(&bytes).unwrap();
    let declared = usize::try_from(1u64 << 40).unwrap_or(usize::MAX);
    assert_eq!(
        (header.spec.max_seq_len(), header.len),
        (declared, 5),
        "{header:?}"
    );
    let mut restored = cache_on(g, spec.clone());
    assert_eq!(restored.import(&bytes).unwrap(), 5);
    assert_eq!(words(&restored, 5).await, want, "restored cache");
    let mut streamed = cache_on(g, spec.clone());
    assert_eq!(push_cache(&mut streamed, &bytes, 3).unwrap(), 5);
    assert_eq!(words(&streamed, 5).await, want, "streamed into a cache");
    let mut p = pool(g, spec, 2, 6);
    let seq = p.import_sequence(&bytes).unwrap();
    assert_eq!(seq_words(&p, seq).await, want, "pool sequence");
    let seq = push_pool(&mut p, &bytes, 4).unwrap();
    assert_eq!(seq_words(&p, seq).await, want, "streamed into a pool");
}

/// A snapshot whose rows carry set bits in their padding (another writer may leave them; the
/// checksums cover them): every import, whole and streamed in pieces of 7 bytes (rows cut
/// anywhere), into a cache and into a pool, stores the rows with zero padding as appends do, and the
/// values as they were. Then a slot of 1.2 MB streamed in pieces of 64 KiB, whose staging is
/// written in more than one part.
pub async fn imported_rows_get_zero_padding(g: &Gpu) {
    let layer = LayerSpec::new(vec![
        SlotSpec::new("x", &[3]),
        SlotSpec::new("y", &[5]).stored_as(DType::F8E4M3),
    ]);
    let spec = CacheSpec::new(vec![layer], DType::F16, 9).unwrap();
    let mut rng = Xorshift::new(77);
    let mut c = cache_on(g, spec.clone());
    fill(&mut c, 9, &mut rng);
    let want = words(&c, 9).await;
    let mut bytes = c.snapshot_async().await.unwrap();
    // Rows of 8 bytes: f16 [3] uses 6 of them, fp8 [5] 5.
    let rows_at = header_end(&bytes) + 4;
    for (slot, used) in [(0, 6), (1, 5)] {
        for row in 0..9 {
            let at = rows_at + slot * 9 * 8 + row * 8;
            bytes[at + used..at + 8].fill(0xff);
        }
    }
    reseal(&mut bytes);
    let whole = |words: &[Vec<u32>], what: &str| {
        assert_eq!(words, want, "{what}: the rows or their padding");
    };
    let mut restored = cache_on(g, spec.clone());
    restored.import(&bytes).unwrap();
    whole(&words(&restored, 9).await, "cache");
    let mut streamed = cache_on(g, spec.clone());
    let mut import = streamed.import_stream().unwrap();
    for piece in bytes.chunks(7) {
        import.push(piece).unwrap();
    }
    import.finish().unwrap();
    whole(&words(&streamed, 9).await, "cache, streamed");
    let mut p = pool(g, spec, 4, 6);
    let seq = p.import_sequence(&bytes).unwrap();
    whole(&seq_words(&p, seq).await, "pool");
    let mut import = p.import_sequence_stream();
    for piece in bytes.chunks(7) {
        import.push(piece).unwrap();
    }
    let seq = import.finish().unwrap();
    whole(&seq_words(&p, seq).await, "pool, streamed");

    // Rows of 12 bytes (f16 [5], 10 used) over 1.2 MB: a streamed import writes what it holds once
    // it holds a megabyte, then the rest, which starts inside a row here (byte 1,114,028, 8 bytes
    // into row 92,835; the unit test of `zero_padding` checks every start).
    let rows = 100_000;
    let layer = LayerSpec::new(vec![SlotSpec::new("z", &[5])]);
    let spec = CacheSpec::new(vec![layer], DType::F16, rows).unwrap();
    let mut c = cache_on(g, spec.clone());
    let x = values(78, rows * 5);
    c.append(0, &[HostSlab::f32(&x, &[rows, 5])]).unwrap();
    c.advance(rows).unwrap();
    let want = words(&c, rows).await;
    let mut bytes = c.snapshot_async().await.unwrap();
    let rows_at = header_end(&bytes) + 4;
    for row in 0..rows {
        let at = rows_at + row * 12;
        bytes[at + 10..at + 12].fill(0xff);
    }
    reseal(&mut bytes);
    let mut streamed = cache_on(g, spec.clone());
    let mut import = streamed.import_stream().unwrap();
    for piece in bytes.chunks(64 << 10) {
        import.push(piece).unwrap();
    }
    import.finish().unwrap();
    assert!(
        words(&streamed, rows).await == want,
        "rows of 12 bytes, streamed: the rows or their padding"
    );
    let mut p = pool(g, spec, 1000, 100);
    let mut import = p.import_sequence_stream();
    for piece in bytes.chunks(64 << 10) {
        import.push(piece).unwrap();
    }
    let seq = import.finish().unwrap();
    assert!(
        seq_words(&p, seq).await == want,
        "rows of 12 bytes, streamed into a pool: the rows or their padding"
    );
}
