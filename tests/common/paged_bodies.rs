//! The paged pool against a plain-Rust model written from the contract (not from the ledger's code):
//! sequences as rows per (layer, slot), pages as shared objects that a writer copies. Pseudo-random
//! runs of valid and invalid operations (add, remove, fork, truncate, host and GPU appends, whole
//! steps, admission checks) on every storage type; after every refusal the ledger and every word of
//! every pool buffer are unchanged, and every few operations each sequence's rows, read through its
//! page table, equal the model's bit for bit. Native (`tests/paged.rs`) and browser suites run the
//! same bodies.

use super::{buffer_with, values};
use kvgpu::reference;
use kvgpu::*;
use std::collections::BTreeMap;

const PAGE: usize = 3;
const PAGES: usize = 12;
const MAX_LEN: usize = 20;

/// Odd widths, or whole blocks of 32 for the block-quantized types.
fn spec(dtype: DType) -> CacheSpec {
    let (kv, mla) = match dtype.block() {
        Some(b) => (LayerSpec::kv(2, b, b), LayerSpec::mla(2 * b, b)),
        None => (LayerSpec::kv(2, 3, 3), LayerSpec::mla(5, 2)),
    };
    CacheSpec::new(vec![kv, LayerSpec::empty(), mla], dtype, MAX_LEN).unwrap()
}

/// Elements per row of every slot of `spec`, per layer.
fn widths_of(spec: &CacheSpec) -> Vec<Vec<usize>> {
    spec.layers()
        .iter()
        .map(|l| l.slots.iter().map(|s| s.row_elems()).collect())
        .collect()
}

/// The trailing shapes of `layer`'s slots.
fn trailing_of(spec: &CacheSpec, layer: usize) -> Vec<Vec<usize>> {
    spec.layers()[layer]
        .slots
        .iter()
        .map(|s| s.trailing.clone())
        .collect()
}

/// The layers with slots and their slots' row widths.
const SLOTTED: [usize; 2] = [0, 2];

/// One sequence of the model: rows per (layer, slot) as stored f32 values, committed length, and its
/// pages as model page names (shared names are shared pages).
#[derive(Clone, Debug)]
struct ModelSeq {
    rows: Vec<Vec<Vec<f32>>>,
    len: usize,
    pages: Vec<u64>,
    /// Elements per row of each layer's first slot.
    widths: Vec<usize>,
}

impl ModelSeq {
    fn visible(&self, layer: usize) -> usize {
        self.rows[layer]
            .first()
            .map_or(self.len, |r| r.len() / self.widths[layer])
    }
}

struct Model {
    seqs: BTreeMap<SeqId, ModelSeq>,
    /// Published prefixes: token ids of whole pages, to the name of the prefix's last page and the
    /// rows of the prefix.
    published: BTreeMap<Vec<u32>, (u64, SeqRows)>,
    next_page: u64,
    row_elems: Vec<Vec<usize>>,
    /// Private copies of shared pages the appends made.
    copies: usize,
    /// Sequences started from published pages, and published pages evicted.
    matched: usize,
    evicted: usize,
}

impl Model {
    /// Pages in use: the distinct page names the sequences and the published prefixes hold.
    fn used(&self) -> usize {
        let mut names: Vec<u64> = self.seqs.values().flat_map(|s| s.pages.clone()).collect();
        names.extend(self.published.values().map(|p| p.0));
        names.sort();
        names.dedup();
        names.len()
    }

    fn holders(&self, page: u64) -> usize {
        self.seqs
            .values()
            .filter(|s| s.pages.contains(&page))
            .count()
            + self.published.values().filter(|p| p.0 == page).count()
    }

    /// Token ids of the first `n` rows of `seq`: the bits of each layer-0 K row's first value (every
    /// append writes rows of its own; rows alike in one sequence are rows shared with another).
    /// Rows past the committed ones get an id no row has.
    fn tokens(&self, seq: SeqId, n: usize) -> Vec<u32> {
        let s = &self.seqs[&seq];
        let w = self.row_elems[0][0];
        (0..n)
            .map(|r| match r < s.len {
                true => s.rows[0][0][r * w].to_bits(),
                false => u32::MAX,
            })
            .collect()
    }

    /// The first `n` rows of `seq`, per layer, per slot.
    fn prefix_rows(&self, seq: SeqId, n: usize) -> SeqRows {
        self.seqs[&seq]
            .rows
            .iter()
            .enumerate()
            .map(|(l, slots)| {
                slots
                    .iter()
                    .enumerate()
                    .map(|(k, r)| r[..n * self.row_elems[l][k]].to_vec())
                    .collect()
            })
            .collect()
    }

    /// A sequence holding `rows` (committed) in `pages`.
    fn new_seq(&self, rows: SeqRows, pages: Vec<u64>) -> ModelSeq {
        let widths: Vec<usize> = self
            .row_elems
            .iter()
            .map(|l| l.first().copied().unwrap_or(1))
            .collect();
        let len = rows[0].first().map_or(0, |r| r.len() / widths[0]);
        ModelSeq {
            rows,
            len,
            pages,
            widths,
        }
    }

    /// A sequence without rows.
    fn empty_seq(&self) -> ModelSeq {
        let rows = self
            .row_elems
            .iter()
            .map(|l| vec![Vec::new(); l.len()])
            .collect();
        self.new_seq(rows, Vec::new())
    }

    /// `PagedCache::publish_prefix` as the contract says: the rows it publishes.
    fn publish(&mut self, seq: SeqId, tokens: &[u32]) -> usize {
        let mut rows = 0;
        for k in 0..tokens.len() / PAGE {
            let key = &tokens[..(k + 1) * PAGE];
            if !self.published.contains_key(key) {
                let own = self.seqs[&seq].pages[k];
                if self.published.values().any(|p| p.0 == own) {
                    break;
                }
                let held = self.prefix_rows(seq, (k + 1) * PAGE);
                self.published.insert(key.to_vec(), (own, held));
            }
            rows += PAGE;
        }
        rows
    }

    /// The longest published prefix of `tokens` (rows), within a sequence's capacity.
    fn published_rows(&self, tokens: &[u32]) -> usize {
        (0..=tokens.len().min(MAX_LEN) / PAGE)
            .rev()
            .map(|k| k * PAGE)
            .find(|&n| n == 0 || self.published.contains_key(&tokens[..n]))
            .unwrap_or(0)
    }

    /// Pages an append of rows `[from, to)` to `seq` takes: new pages past its table, and a private
    /// copy of every shared page it writes into.
    fn pages_needed(&self, seq: SeqId, from: usize, to: usize) -> usize {
        let s = &self.seqs[&seq];
        if from == to {
            return 0;
        }
        (from / PAGE..to.div_ceil(PAGE))
            .filter(|&i| i >= s.pages.len() || self.holders(s.pages[i]) > 1)
            .count()
    }

    /// Applies an append the model accepts: private copies, new pages, the rows.
    fn append(&mut self, seq: SeqId, layer: usize, rows: Vec<Vec<f32>>) {
        let n = rows[0].len() / self.row_elems[layer][0];
        let from = self.seqs[&seq].visible(layer);
        let touched = if n == 0 {
            0..0
        } else {
            from / PAGE..(from + n).div_ceil(PAGE)
        };
        for i in touched {
            let shared = {
                let s = &self.seqs[&seq];
                i < s.pages.len() && self.holders(s.pages[i]) > 1
            };
            let name = self.next_page;
            let s = self.seqs.get_mut(&seq).unwrap();
            if i >= s.pages.len() {
                s.pages.push(name);
                self.next_page += 1;
            } else if shared {
                s.pages[i] = name;
                self.next_page += 1;
                self.copies += 1;
            }
        }
        let s = self.seqs.get_mut(&seq).unwrap();
        for (slot, r) in rows.into_iter().enumerate() {
            s.rows[layer][slot].extend(r);
        }
    }
}

/// A verified f32 buffer holding the rows of `v` (`w` elements each) from element `lead` on, one row
/// every `w + pad` elements: a strided source, which the slab-write kernel moves.
async fn padded_rows(g: &Gpu, v: &[f32], w: usize, pad: usize, lead: usize) -> wgpu::Buffer {
    let n = v.len() / w;
    let mut words = vec![0u32; lead + (n + 1) * (w + pad)];
    for (r, row) in v.chunks(w).enumerate() {
        for (e, x) in row.iter().enumerate() {
            words[lead + r * (w + pad) + e] = x.to_bits();
        }
    }
    buffer_with(&g.device, &words, super::USAGE).await
}

/// Element strides of a slab shaped `shape` whose rows lie every `row` elements, the trailing axes
/// contiguous.
fn row_strides(shape: &[usize], row: usize) -> Vec<usize> {
    let mut st = vec![row];
    st.extend((1..shape.len()).map(|d| shape[d + 1..].iter().product::<usize>()));
    st
}

/// Every word of every pool buffer.
async fn pool_words(c: &PagedCache) -> Vec<Vec<u32>> {
    let mut all = Vec::new();
    for (layer, spec) in c.spec().layers().iter().enumerate() {
        for slot in 0..spec.slots.len() {
            all.push(c.read_pool_words_async(layer, slot).await.unwrap());
        }
    }
    all
}

/// Each sequence's rows, read through its page table, equal the model's; the pages in use too.
async fn check_rows(c: &PagedCache, m: &Model, what: &str) {
    assert_eq!(c.pages_in_use(), m.used(), "{what}: pages in use");
    assert_eq!(
        c.ledger().sequences().collect::<Vec<_>>(),
        m.seqs.keys().copied().collect::<Vec<_>>(),
        "{what}: sequences"
    );
    for (&seq, s) in &m.seqs {
        assert_eq!(c.len(seq).unwrap(), s.len, "{what}: {seq} length");
        for layer in SLOTTED {
            for slot in 0..2 {
                let got = c.read_f32_async(seq, layer, slot).await.unwrap();
                let want = &s.rows[layer][slot];
                let same = got.len() == want.len()
                    && got
                        .iter()
                        .zip(want)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(
                    same,
                    "{what}: {seq} layer {layer} slot {slot}: {got:?} != {want:?}"
                );
            }
        }
    }
}

/// Attention of the newest row of up to three sequences, as one ragged batch per attention layer (GQA
/// on layer 0, MLA on layer 2), against the twins over the model's rows; returns how many layers it
/// checked (a layer no sequence has rows in is not).
async fn check_attention(
    g: &Gpu,
    c: &PagedCache,
    m: &Model,
    att: &mut Attention,
    seed: u64,
    what: &str,
) -> usize {
    let mut checked = 0;
    // K/V widths of layer 0 and the latent and rope widths of layer 2.
    let width_of = |l: usize, s: usize| *c.spec().layers()[l].slots[s].trailing.last().unwrap();
    let (dk, r, rope) = (width_of(0, 0), width_of(2, 0), width_of(2, 1));
    for (layer, heads) in [(0, 4), (2, 2)] {
        let batch: Vec<(SeqId, usize)> = m
            .seqs
            .iter()
            .filter(|(_, s)| s.visible(layer) > 0)
            .take(3)
            .map(|(&id, _)| (id, 1))
            .collect();
        if batch.is_empty() {
            continue;
        }
        let n = batch.len();
        let opts = AttentionOptions::default();
        let (q, q2) = (
            values(seed, n * heads * r.max(dk)),
            values(seed + 1, n * heads * rope),
        );
        let qb = super::f32_buffer(&g.device, &q).await;
        let q2b = super::f32_buffer(&g.device, &q2).await;
        let width = if layer == 0 { dk } else { r };
        let out = super::output(&g.device, n * heads * width).await;
        if layer == 0 {
            att.gqa(
                Kv::Batch(c, &batch),
                0,
                Queries::new(&qb, n, heads, dk),
                &out,
                &opts,
            )
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        } else {
            let mla = MlaQueries {
                latent: Queries::new(&qb, n, heads, r),
                rope: Queries::new(&q2b, n, heads, rope),
            };
            att.mla(Kv::Batch(c, &batch), 2, mla, &out, &opts)
                .unwrap_or_else(|e| panic!("{what}: {e}"));
        }
        let got = super::read_f32(g, &out).await;
        for (i, (id, _)) in batch.iter().enumerate() {
            let rows = &m.seqs[id].rows[layer];
            let want = if layer == 0 {
                let qi = &q[i * heads * dk..(i + 1) * heads * dk];
                reference::attention_gqa(qi, [1, heads, dk], &rows[0], &rows[1], 2, dk, &opts)
            } else {
                let (ql, qr) = (
                    &q[i * heads * r..(i + 1) * heads * r],
                    &q2[i * heads * rope..(i + 1) * heads * rope],
                );
                reference::attention_mla(ql, qr, [1, heads, r], &rows[0], &rows[1], rope, &opts)
            };
            let part = &got[i * heads * width..(i + 1) * heads * width];
            super::assert_close(
                part,
                &want,
                &format!("{what}: {id} layer {layer} attention"),
            );
        }
        checked += 1;
    }
    checked
}

/// Rows for an append of `n` to `layer`: per slot the f32 values and what the storage keeps.
fn rows_for(
    m: &Model,
    layer: usize,
    n: usize,
    seed: u64,
    dtype: DType,
) -> Vec<(Vec<f32>, Vec<f32>)> {
    (0..2)
        .map(|slot| {
            let w = m.row_elems[layer][slot];
            let v = values(seed * 7 + slot as u64, n * w);
            let kept = reference::round_trip_rows(&v, dtype, w);
            (v, kept)
        })
        .collect()
}

/// The kind of a refusal, to compare with the model's verdict.
fn kind(e: &Error) -> &'static str {
    match e {
        Error::UnknownSequence { .. } => "unknown",
        Error::OutOfPages { .. } => "pages",
        Error::ForkBeyondLength { .. } => "fork",
        Error::TruncateBeyondLength { .. } => "truncate",
        Error::CapacityExceeded { .. } => "capacity",
        Error::UnevenAdvance { .. } => "uneven",
        Error::RowCountMismatch { .. } => "shape",
        Error::PrefixBeyondLength { .. } => "prefix",
        _ => "other",
    }
}

/// The model's verdict on an append of `n` rows to every layer in `layers` of `seq` (one append per
/// layer, in order), and on a bad shape.
fn append_verdict(
    m: &Model,
    seq: SeqId,
    layers: &[usize],
    n: usize,
    bad: bool,
) -> Result<(), &'static str> {
    let Some(s) = m.seqs.get(&seq) else {
        return Err("unknown");
    };
    if bad {
        return Err("shape");
    }
    let top = layers.iter().map(|&l| s.visible(l)).max().unwrap_or(0);
    if top + n > MAX_LEN {
        return Err("capacity");
    }
    let low = layers.iter().map(|&l| s.visible(l)).min().unwrap_or(0);
    if m.pages_needed(seq, low, top + n) > PAGES - m.used() {
        return Err("pages");
    }
    Ok(())
}

/// A pseudo-random run of `n_ops` operations on a pool of `dtype`, against the model.
pub async fn paged_run_matches_the_model(g: &Gpu, dtype: DType, seed: u64, n_ops: usize) {
    let spec = spec(dtype);
    let row_elems = widths_of(&spec);
    let trailing = |layer: usize| trailing_of(&spec, layer);
    let mut c = PagedCache::with_kernels(super::kernels_for(g), spec.clone(), PAGE, PAGES).unwrap();
    let mut m = Model {
        seqs: BTreeMap::new(),
        published: BTreeMap::new(),
        next_page: 0,
        row_elems,
        copies: 0,
        matched: 0,
        evicted: 0,
    };
    let mut gone: Vec<SeqId> = Vec::new();
    let mut att = Attention::with_kernels(super::kernels_for(g));
    let mut rng = reference::Xorshift::new(seed);
    let mut refused: BTreeMap<&'static str, usize> = BTreeMap::new();
    let mut attention_checks = 0;
    for op in 0..n_ops {
        let ids: Vec<SeqId> = m.seqs.keys().copied().collect();
        let mut choice = rng.below(12);
        // A nearly full pool mostly frees pages (removes a sequence or evicts published pages), so
        // the runs keep reaching forks and copies.
        if c.free_pages() < 2 && rng.below(2) == 0 {
            choice = [1, 13][rng.below(2)];
        }
        if choice == 11 {
            choice = 11 + rng.below(3);
        }
        let seq = if !gone.is_empty() && rng.below(20) == 0 {
            gone[rng.below(gone.len())]
        } else if ids.is_empty() {
            choice = 0;
            SeqId::FIRST
        } else {
            ids[rng.below(ids.len())]
        };
        // Rows reach their pages run by run or scattered, as the pool would choose or forced: the
        // same bits either way.
        c.set_scatter(
            [
                ScatterChoice::Auto,
                ScatterChoice::Always,
                ScatterChoice::Never,
            ][rng.below(3)],
        );
        let before = c.ledger().clone();
        // Every fourth operation is watched: the whole pool is read before it, and again if it is
        // refused.
        let watched = if rng.below(4) == 0 {
            Some(pool_words(&c).await)
        } else {
            None
        };
        let what = format!("{dtype} seed {seed} op {op}");
        let known = m.seqs.get(&seq).cloned();
        let len = known.as_ref().map_or(0, |s| s.len);
        let unknown = || Err("unknown");
        let (expected, outcome): (Result<(), &'static str>, Result<(), Error>) = match choice {
            0 => (
                Ok(()),
                c.add_sequence().map(|id| {
                    m.seqs.insert(id, m.empty_seq());
                }),
            ),
            1 => (
                known.as_ref().map_or_else(unknown, |_| Ok(())),
                c.remove(seq).map(|()| {
                    m.seqs.remove(&seq);
                    gone.push(seq);
                }),
            ),
            2 | 3 => {
                let at = rng.below(len + 2);
                let expected = match &known {
                    None => Err("unknown"),
                    Some(s) if at > s.len => Err("fork"),
                    Some(_) => Ok(()),
                };
                let outcome = c.fork(seq, at).map(|child| {
                    let pages = m.seqs[&seq].pages[..at.div_ceil(PAGE)].to_vec();
                    let forked = m.new_seq(m.prefix_rows(seq, at), pages);
                    m.seqs.insert(child, forked);
                });
                (expected, outcome)
            }
            4 => {
                let new_len = rng.below(len + 2);
                let expected = match &known {
                    None => Err("unknown"),
                    Some(s) if new_len > s.len => Err("truncate"),
                    Some(_) => Ok(()),
                };
                let outcome = c.truncate(seq, new_len).map(|()| {
                    let s = m.seqs.get_mut(&seq).unwrap();
                    for (l, slots) in s.rows.iter_mut().enumerate() {
                        for (k, r) in slots.iter_mut().enumerate() {
                            r.truncate(new_len * m.row_elems[l][k]);
                        }
                    }
                    s.len = new_len;
                    s.pages.truncate(new_len.div_ceil(PAGE));
                });
                (expected, outcome)
            }
            5 | 6 => {
                // One layer, from the host or from a strided f32 GPU buffer; sometimes a bad shape.
                let layer = SLOTTED[rng.below(2)];
                let n = rng.below(2 * PAGE + 2);
                let bad = rng.below(12) == 0;
                let expected = append_verdict(&m, seq, &[layer], n, bad);
                let rows = rows_for(&m, layer, n, (seed << 20) + op as u64, dtype);
                let trailing = trailing(layer);
                let shapes: Vec<Vec<usize>> = (0..2)
                    .map(|k| [&[n + usize::from(bad && k == 1)][..], &trailing[k]].concat())
                    .collect();
                let outcome = if rng.below(2) == 0 {
                    // Rows of row_elems + 2 elements, from element 3 on: the slab-write kernel.
                    let mut bufs = Vec::new();
                    for (k, (v, _)) in rows.iter().enumerate() {
                        let w = m.row_elems[layer][k];
                        bufs.push(padded_rows(g, v, w, 2, 3).await);
                    }
                    let strides: Vec<Vec<usize>> = (0..2)
                        .map(|k| row_strides(&shapes[k], m.row_elems[layer][k] + 2))
                        .collect();
                    let slabs: Vec<GpuSlab> = (0..2)
                        .map(|k| GpuSlab {
                            buffer: &bufs[k],
                            dtype: DType::F32,
                            offset: 3,
                            shape: &shapes[k],
                            strides: Some(&strides[k]),
                        })
                        .collect();
                    c.append_gpu(seq, layer, &slabs)
                } else {
                    let data: Vec<Vec<f32>> = (0..2)
                        .map(|k| {
                            let mut d = rows[k].0.clone();
                            d.resize(row_count(&shapes[k]), 0.5);
                            d
                        })
                        .collect();
                    let slabs: Vec<HostSlab> = (0..2)
                        .map(|k| HostSlab::f32(&data[k], &shapes[k]))
                        .collect();
                    c.append(seq, layer, &slabs)
                };
                let outcome = outcome.map(|()| {
                    m.append(seq, layer, rows.into_iter().map(|r| r.1).collect());
                });
                (expected, outcome)
            }
            7 | 8 => {
                // A whole step: admission first, then every layer, then advance.
                let n = 1 + rng.below(PAGE);
                let expected = append_verdict(&m, seq, &SLOTTED, n, false);
                let admitted = c.admits(&[(seq, n)]);
                if admitted.is_ok() && expected.is_ok() {
                    for layer in SLOTTED {
                        let rows =
                            rows_for(&m, layer, n, (seed << 20) + (op * 4 + layer) as u64, dtype);
                        let trailing = trailing(layer);
                        let shapes: Vec<Vec<usize>> =
                            (0..2).map(|k| [&[n][..], &trailing[k]].concat()).collect();
                        let slabs: Vec<HostSlab> = (0..2)
                            .map(|k| HostSlab::f32(&rows[k].0, &shapes[k]))
                            .collect();
                        c.append(seq, layer, &slabs)
                            .unwrap_or_else(|e| panic!("{what}: admitted, then refused: {e}"));
                        m.append(seq, layer, rows.into_iter().map(|r| r.1).collect());
                    }
                    let s = &m.seqs[&seq];
                    let pending: Vec<usize> =
                        SLOTTED.iter().map(|&l| s.visible(l) - s.len).collect();
                    let advanced = c.advance(seq, pending[0]);
                    if pending[0] == pending[1] {
                        advanced.unwrap();
                        m.seqs.get_mut(&seq).unwrap().len += pending[0];
                    } else {
                        assert_eq!(advanced.map_err(|e| kind(&e)), Err("uneven"), "{what}");
                    }
                    check_rows(&c, &m, &what).await;
                    continue;
                }
                (expected, admitted)
            }
            10 => {
                // Publish some of a sequence's committed rows (sometimes one row more than it has).
                let n = rng.below(len + 2);
                let expected = match &known {
                    None => Err("unknown"),
                    Some(s) if n > s.len => Err("prefix"),
                    Some(_) => Ok(()),
                };
                let tokens = match &known {
                    Some(_) => m.tokens(seq, n),
                    None => vec![0; n],
                };
                let outcome = c.publish_prefix(seq, &tokens).map(|rows| {
                    assert_eq!(rows, m.publish(seq, &tokens), "{what}: rows published");
                });
                (expected, outcome)
            }
            11 | 12 => {
                // A sequence from the longest published prefix of a published prefix's tokens, a
                // sequence's, or new ones, each with some tokens after it.
                let keys: Vec<Vec<u32>> = m.published.keys().cloned().collect();
                let mut tokens = match rng.below(4) {
                    0 | 1 if !keys.is_empty() => keys[rng.below(keys.len())].clone(),
                    2 if known.is_some() => m.tokens(seq, len),
                    _ => Vec::new(),
                };
                tokens.extend((0..rng.below(2 * PAGE)).map(|k| k as u32));
                let want = m.published_rows(&tokens);
                let outcome = c.add_sequence_with_prefix(&tokens).map(|(id, rows)| {
                    assert_eq!(rows, want, "{what}: rows of a sequence from a prefix");
                    m.matched += usize::from(rows > 0);
                    let started = match rows {
                        0 => m.empty_seq(),
                        _ => {
                            let pages = (1..=rows / PAGE)
                                .map(|k| m.published[&tokens[..k * PAGE]].0)
                                .collect();
                            m.new_seq(m.published[&tokens[..rows]].1.clone(), pages)
                        }
                    };
                    m.seqs.insert(id, started);
                });
                (Ok(()), outcome)
            }
            13 => {
                // Evict published pages no sequence holds; the model learns which from the pool.
                let n = 1 + rng.below(3);
                let evicted = c.evict_prefixes(n);
                let before = m.published.len();
                m.published
                    .retain(|tokens, _| c.published_rows(tokens) == tokens.len());
                assert_eq!(before - m.published.len(), evicted, "{what}: evicted");
                assert!(evicted <= n, "{what}: {evicted} evicted of {n}");
                m.evicted += evicted;
                // A published page went only if no sequence held it and none was published after it.
                if evicted < n {
                    for (tokens, (page, _)) in &m.published {
                        let child = m
                            .published
                            .keys()
                            .any(|k| k.len() == tokens.len() + PAGE && k.starts_with(tokens));
                        assert!(
                            child || m.holders(*page) > 1,
                            "{what}: {tokens:?} could have been evicted"
                        );
                    }
                }
                (Ok(()), Ok(()))
            }
            _ => {
                let expected = match &known {
                    None => Err("unknown"),
                    Some(s)
                        if SLOTTED
                            .iter()
                            .any(|&l| s.visible(l) - s.len != s.visible(0) - s.len) =>
                    {
                        Err("uneven")
                    }
                    Some(_) => Ok(()),
                };
                let pending = known.as_ref().map_or(0, |s| s.visible(0) - s.len);
                let outcome = c.advance(seq, pending).map(|()| {
                    m.seqs.get_mut(&seq).unwrap().len += pending;
                });
                (expected, outcome)
            }
        };
        assert_eq!(
            outcome.as_ref().map(|_| ()).map_err(kind),
            expected,
            "{what}: {seq}: {outcome:?}"
        );
        if let Err(e) = &outcome {
            *refused.entry(kind(e)).or_default() += 1;
            assert_eq!(
                c.ledger(),
                &before,
                "{what}: the refusal changed the ledger: {e}"
            );
            if let Some(words) = watched {
                assert_eq!(
                    pool_words(&c).await,
                    words,
                    "{what}: a refusal moved pool memory: {e}"
                );
            }
        }
        if op % 8 == 7 {
            check_rows(&c, &m, &what).await;
            attention_checks +=
                check_attention(g, &c, &m, &mut att, seed * 1000 + op as u64, &what).await;
        }
    }
    check_rows(&c, &m, "end").await;
    assert!(
        attention_checks > 0,
        "{dtype} seed {seed}: no attention was checked"
    );
    note!(
        "{dtype} seed {seed}: {n_ops} operations, {attention_checks} attention layers checked, {} \
         private page copies, {} sequences from published pages, {} published pages evicted, \
         refusals {refused:?}",
        m.copies,
        m.matched,
        m.evicted
    );
    assert!(
        refused.contains_key("pages") && refused.len() >= 4 && m.copies > 0 && m.matched > 0,
        "{dtype} seed {seed}: the run missed states: {} copies, {} from published pages, refusals \
         {refused:?}",
        m.copies,
        m.matched
    );
    for seq in m.seqs.keys().copied().collect::<Vec<_>>() {
        c.remove(seq).unwrap();
    }
    assert_eq!(c.cached_pages(), m.published.len(), "{dtype} seed {seed}");
    assert_eq!(c.evict_prefixes(usize::MAX), m.published.len());
    assert_eq!(c.free_pages(), PAGES, "{dtype} seed {seed}: pages leaked");
}

/// Elements of a slab shaped `shape`.
fn row_count(shape: &[usize]) -> usize {
    shape.iter().product()
}

/// Every storage type, two seeds each for the element types and one for the quantized ones (one in
/// the browser, where each readback waits for a later task).
pub async fn paged_pool_matches_the_model(g: &Gpu) {
    for dtype in DType::STORAGE {
        let seeds = if cfg!(target_arch = "wasm32") || dtype.is_quantized() {
            1
        } else {
            2
        };
        for seed in 1..=seeds {
            paged_run_matches_the_model(g, dtype, seed, 400).await;
        }
    }
}

/// Rows of one sequence as the test wrote them: per layer, per slot, stored f32 values.
type SeqRows = Vec<Vec<Vec<f32>>>;

/// Appends `n` rows to every layer of `seq` (layer 0 from a strided f32 GPU buffer when `gpu`, the
/// rest from the host), advances, and returns what the storage keeps.
async fn step(g: &Gpu, c: &mut PagedCache, seq: SeqId, n: usize, seed: u64, gpu: bool) -> SeqRows {
    let dtype = c.spec().dtype();
    let mut kept = Vec::new();
    for layer in 0..c.spec().n_layers() {
        let slots: Vec<Vec<usize>> = c.spec().layers()[layer]
            .slots
            .iter()
            .map(|s| s.trailing.clone())
            .collect();
        let vals: Vec<Vec<f32>> = slots
            .iter()
            .enumerate()
            .map(|(k, t)| {
                values(
                    seed * 31 + (layer * 2 + k) as u64,
                    n * t.iter().product::<usize>(),
                )
            })
            .collect();
        let shapes: Vec<Vec<usize>> = slots.iter().map(|t| [&[n][..], t].concat()).collect();
        if gpu && layer == 0 {
            // Every other row of a buffer: the slab-write kernel, across page boundaries.
            let mut bufs = Vec::new();
            for v in &vals {
                let w = v.len() / n;
                bufs.push((padded_rows(g, v, w, w, 0).await, w));
            }
            let strides: Vec<Vec<usize>> = shapes
                .iter()
                .zip(&bufs)
                .map(|(s, (_, w))| row_strides(s, 2 * w))
                .collect();
            let slabs: Vec<GpuSlab> = (0..slots.len())
                .map(|k| GpuSlab {
                    buffer: &bufs[k].0,
                    dtype: DType::F32,
                    offset: 0,
                    shape: &shapes[k],
                    strides: Some(&strides[k]),
                })
                .collect();
            c.append_gpu(seq, layer, &slabs).unwrap();
        } else {
            let slabs: Vec<HostSlab> = (0..slots.len())
                .map(|k| HostSlab::f32(&vals[k], &shapes[k]))
                .collect();
            c.append(seq, layer, &slabs).unwrap();
        }
        kept.push(
            vals.iter()
                .zip(&slots)
                .map(|(v, t)| reference::round_trip_rows(v, dtype, t.iter().product()))
                .collect(),
        );
    }
    c.advance(seq, n).unwrap();
    kept
}

/// `rows` with `more` appended (per layer, per slot).
fn grown(rows: &SeqRows, more: &SeqRows) -> SeqRows {
    rows.iter()
        .zip(more)
        .map(|(l, m)| {
            l.iter()
                .zip(m)
                .map(|(a, b)| [a.clone(), b.clone()].concat())
                .collect()
        })
        .collect()
}

/// The first `n` rows of each slot.
fn prefix(rows: &SeqRows, n: usize, widths: &[Vec<usize>]) -> SeqRows {
    rows.iter()
        .zip(widths)
        .map(|(l, w)| l.iter().zip(w).map(|(r, &w)| r[..n * w].to_vec()).collect())
        .collect()
}

/// KV heads and query heads of [`gqa_mla_spec`]'s attention layers. 8 KV heads of 2 query heads each
/// fill a workgroup of one-invocation teams side by side (`KernelChoice::StreamAlone`); MLA's one
/// KV head makes its teams share a workgroup's chunks instead.
const N_KV: usize = 8;
const HEADS: usize = 16;

/// A GQA layer (`N_KV` heads of `d`) and an MLA layer (latent `r`, rope `rope`) of `dtype`, of widths
/// every kernel takes: whole 16-byte vectors (8 elements of f32 and 16-bit types, 16 of fp8), or
/// whole blocks of 32 for the block-quantized types; with `(d, r, rope)`.
fn gqa_mla_spec(dtype: DType, max_seq_len: usize) -> (CacheSpec, (usize, usize, usize)) {
    let (d, r, rope) = match dtype.block() {
        Some(b) => (b, b, b),
        None if dtype.is_fp8() => (16, 16, 16),
        None => (8, 16, 8),
    };
    let layers = vec![LayerSpec::kv(N_KV, d, d), LayerSpec::mla(r, rope)];
    let spec = CacheSpec::new(layers, dtype, max_seq_len).unwrap();
    (spec, (d, r, rope))
}

/// [`check_batch`]'s calls for several ragged batches recorded into one encoder and submitted at
/// once: each batch's query table must reach the kernels of its own call (the tables are copied in
/// by the encoder, in order, not written ahead of it by the queue).
#[allow(clippy::too_many_arguments)]
async fn check_batches_in_one_encoder(
    g: &Gpu,
    c: &PagedCache,
    att: &mut Attention,
    batches: &[&[(SeqId, usize)]],
    seqs: &[(SeqId, &SeqRows)],
    (d, r, rope): (usize, usize, usize),
    options: &AttentionOptions,
    what: &str,
) {
    let mut encoder = g.device.create_command_encoder(&Default::default());
    let mut calls = Vec::new();
    for (i, &batch) in batches.iter().enumerate() {
        let total: usize = batch.iter().map(|b| b.1).sum();
        let seed = 800 + 10 * i as u64;
        let (q, ql, qr) = (
            values(seed, total * HEADS * d),
            values(seed + 1, total * HEADS * r),
            values(seed + 2, total * HEADS * rope),
        );
        let buffers = [
            super::f32_buffer(&g.device, &q).await,
            super::f32_buffer(&g.device, &ql).await,
            super::f32_buffer(&g.device, &qr).await,
            super::output(&g.device, total * HEADS * d).await,
            super::output(&g.device, total * HEADS * r).await,
        ];
        let [qb, lb, rb_, out, out_mla] = &buffers;
        att.record_gqa(
            &mut encoder,
            Kv::Batch(c, batch),
            0,
            Queries::new(qb, total, HEADS, d),
            out,
            options,
        )
        .unwrap_or_else(|e| panic!("{what}: {e}"));
        let queries = MlaQueries {
            latent: Queries::new(lb, total, HEADS, r),
            rope: Queries::new(rb_, total, HEADS, rope),
        };
        att.record_mla(
            &mut encoder,
            Kv::Batch(c, batch),
            1,
            queries,
            out_mla,
            options,
        )
        .unwrap_or_else(|e| panic!("{what}: {e}"));
        calls.push((batch, [q, ql, qr], buffers));
    }
    g.queue.submit([encoder.finish()]);
    for (i, (batch, q, buffers)) in calls.iter().enumerate() {
        let got = super::read_f32(g, &buffers[3]).await;
        let got_mla = super::read_f32(g, &buffers[4]).await;
        let what = format!("{what}, batch {i} of one encoder");
        let q = (&q[0][..], &q[1][..], &q[2][..]);
        assert_batch_twins(
            (&got, &got_mla),
            q,
            batch,
            seqs,
            (d, r, rope),
            options,
            &what,
        );
    }
}

/// Each segment of a ragged `batch`'s GQA output `got.0` and MLA output `got.1` (queries `q`, in
/// the batch's order) against the twins over its sequence's rows.
#[allow(clippy::too_many_arguments)]
fn assert_batch_twins(
    got: (&[f32], &[f32]),
    q: (&[f32], &[f32], &[f32]),
    batch: &[(SeqId, usize)],
    seqs: &[(SeqId, &SeqRows)],
    (d, r, rope): (usize, usize, usize),
    options: &AttentionOptions,
    what: &str,
) {
    let mut at = 0;
    for &(seq, n_q) in batch {
        let rows = seqs.iter().find(|s| s.0 == seq).unwrap().1;
        let (x, y) = (at * HEADS * d, (at + n_q) * HEADS * d);
        let (xl, yl) = (at * HEADS * r, (at + n_q) * HEADS * r);
        let (xr, yr) = (at * HEADS * rope, (at + n_q) * HEADS * rope);
        assert_twins(
            (&got.0[x..y], &got.1[xl..yl]),
            (&q.0[x..y], &q.1[xl..yl], &q.2[xr..yr]),
            n_q,
            rows,
            (d, r, rope),
            options,
            &format!("{what}: {seq}"),
        );
        at += n_q;
    }
}

/// GQA (layer 0) and MLA (layer 1) attention of a ragged `batch` over a pool of [`gqa_mla_spec`]'s
/// layers, one dispatch pair per layer, each segment against the twins over its sequence's rows.
#[allow(clippy::too_many_arguments)]
async fn check_batch(
    g: &Gpu,
    c: &PagedCache,
    att: &mut Attention,
    batch: &[(SeqId, usize)],
    seqs: &[(SeqId, &SeqRows)],
    (d, r, rope): (usize, usize, usize),
    options: &AttentionOptions,
    what: &str,
) {
    let total: usize = batch.iter().map(|b| b.1).sum();
    let q = values(500, total * HEADS * d);
    let qb = super::f32_buffer(&g.device, &q).await;
    let out = super::output(&g.device, total * HEADS * d).await;
    att.gqa(
        Kv::Batch(c, batch),
        0,
        Queries::new(&qb, total, HEADS, d),
        &out,
        options,
    )
    .unwrap_or_else(|e| panic!("{what}: {e}"));
    let got = super::read_f32(g, &out).await;
    let ql = values(600, total * HEADS * r);
    let qr = values(700, total * HEADS * rope);
    let (lb, rb_) = (
        super::f32_buffer(&g.device, &ql).await,
        super::f32_buffer(&g.device, &qr).await,
    );
    let out_mla = super::output(&g.device, total * HEADS * r).await;
    let queries = MlaQueries {
        latent: Queries::new(&lb, total, HEADS, r),
        rope: Queries::new(&rb_, total, HEADS, rope),
    };
    att.mla(Kv::Batch(c, batch), 1, queries, &out_mla, options)
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    let got_mla = super::read_f32(g, &out_mla).await;
    let q = (&q[..], &ql[..], &qr[..]);
    assert_batch_twins(
        (&got, &got_mla),
        q,
        batch,
        seqs,
        (d, r, rope),
        options,
        what,
    );
}

/// GQA (layer 0) and MLA (layer 1) attention of the last `n_q` rows of `seq` over a pool of
/// [`gqa_mla_spec`]'s layers, through its page table, against the twins over `rows`.
#[allow(clippy::too_many_arguments)]
async fn check_sequence(
    g: &Gpu,
    c: &PagedCache,
    att: &mut Attention,
    (seq, rows): (SeqId, &SeqRows),
    (d, r, rope): (usize, usize, usize),
    n_q: usize,
    options: &AttentionOptions,
    what: &str,
) {
    let visible = c.len(seq).unwrap();
    let qg = values(visible as u64 + 50, n_q * HEADS * d);
    let qb = super::f32_buffer(&g.device, &qg).await;
    let out = super::output(&g.device, n_q * HEADS * d).await;
    att.gqa(
        Kv::Sequence(c, seq),
        0,
        Queries::new(&qb, n_q, HEADS, d),
        &out,
        options,
    )
    .unwrap_or_else(|e| panic!("{what}: {e}"));
    let got = super::read_f32(g, &out).await;
    let ql = values(visible as u64 + 60, n_q * HEADS * r);
    let qr = values(visible as u64 + 70, n_q * HEADS * rope);
    let (lb, rb_) = (
        super::f32_buffer(&g.device, &ql).await,
        super::f32_buffer(&g.device, &qr).await,
    );
    let out = super::output(&g.device, n_q * HEADS * r).await;
    let q = MlaQueries {
        latent: Queries::new(&lb, n_q, HEADS, r),
        rope: Queries::new(&rb_, n_q, HEADS, rope),
    };
    att.mla(Kv::Sequence(c, seq), 1, q, &out, options)
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    let got_mla = super::read_f32(g, &out).await;
    assert_twins(
        (&got, &got_mla),
        (&qg, &ql, &qr),
        n_q,
        rows,
        (d, r, rope),
        options,
        what,
    );
}

/// GQA output `got.0` (layer 0, queries `q.0`) and MLA output `got.1` (layer 1, latent and rope
/// queries `q.1`, `q.2`) of the last `n_q` rows of a sequence holding `rows`, against the twins.
fn assert_twins(
    got: (&[f32], &[f32]),
    q: (&[f32], &[f32], &[f32]),
    n_q: usize,
    rows: &SeqRows,
    (d, r, rope): (usize, usize, usize),
    options: &AttentionOptions,
    what: &str,
) {
    let want = reference::attention_gqa(
        q.0,
        [n_q, HEADS, d],
        &rows[0][0],
        &rows[0][1],
        N_KV,
        d,
        options,
    );
    super::assert_close(got.0, &want, &format!("{what} GQA"));
    let want = reference::attention_mla(
        q.1,
        q.2,
        [n_q, HEADS, r],
        &rows[1][0],
        &rows[1][1],
        rope,
        options,
    );
    super::assert_close(got.1, &want, &format!("{what} MLA"));
}

/// GQA and MLA attention over sequences of a paged pool match the CPU twins for every storage type
/// and every pass-1 kernel of the adapter: sequences whose pages interleave, forks sharing full and
/// partly filled pages, private copies made by both a fork and its parent (from the host and from
/// GPU sources), decode and chunked queries, window and soft-cap. Refused calls name the cause.
pub async fn paged_attention_matches_the_reference(g: &Gpu) {
    // Rows of a forced streaming kernel must be whole 16-byte vectors: fp8 heads of 8 are refused
    // up front, before anything is built (the pools below have whole vectors).
    let odd = CacheSpec::new(vec![LayerSpec::kv(N_KV, 8, 8)], DType::F8E4M3, 16).unwrap();
    let pool = PagedCache::with_kernels(super::kernels_for(g), odd.clone(), 4, 4).unwrap();
    let mut att = Attention::with_kernels(super::kernels_for(g));
    for choice in super::attention_bodies::kernels(g) {
        att.set_kernel(choice);
        let takes = super::attention_bodies::kernel_takes(choice, &odd, 0);
        assert_eq!(takes, choice == KernelChoice::Tiled, "{choice:?}");
        if !takes {
            let e = att.prepare_paged(&pool, HEADS).unwrap_err();
            assert!(matches!(e, Error::AttentionRequest { .. }), "{e}");
        }
    }
    for dtype in DType::STORAGE {
        let (spec, (d, r, rope)) = gqa_mla_spec(dtype, 64);
        let widths = widths_of(&spec);
        let mut c = PagedCache::with_kernels(super::kernels_for(g), spec.clone(), 5, 40).unwrap();
        let a = c.add_sequence().unwrap();
        let b = c.add_sequence().unwrap();
        // a and b take pages in turn, so neither's pages are contiguous.
        let mut ra = step(g, &mut c, a, 9, 1, false).await;
        let mut rb = step(g, &mut c, b, 7, 2, true).await;
        ra = grown(&ra, &step(g, &mut c, a, 14, 3, false).await);
        // c1 shares a's pages 0-3 (row 17 is inside page 3); c2 shares pages 0-4 (page 4 partly).
        let c1 = c.fork(a, 17).unwrap();
        let c2 = c.fork(a, 22).unwrap();
        let mut rc1 = grown(
            &prefix(&ra, 17, &widths),
            &step(g, &mut c, c1, 6, 4, true).await,
        );
        // a writes row 23 into page 4, shared with c2: a copies it; then c2 writes in place.
        ra = grown(&ra, &step(g, &mut c, a, 3, 5, false).await);
        let rc2 = grown(
            &prefix(&ra, 22, &widths),
            &step(g, &mut c, c2, 4, 6, false).await,
        );
        rb = grown(&rb, &step(g, &mut c, b, 2, 7, false).await);
        rc1 = grown(&rc1, &step(g, &mut c, c1, 1, 8, true).await);
        let seqs = [(a, &ra), (b, &rb), (c1, &rc1), (c2, &rc2)];
        note!(
            "{dtype}: pages in use {} of {}",
            c.pages_in_use(),
            c.n_pages()
        );
        let mut att = Attention::with_kernels(super::kernels_for(g));
        for choice in super::attention_bodies::kernels(g) {
            att.set_kernel(choice);
            let takes = |l| super::attention_bodies::kernel_takes(choice, &spec, l);
            assert!(takes(0) && takes(1), "{choice:?} {dtype}: whole vectors");
            // The paged pipelines, ahead of the calls: once, for every attention layer.
            let e = att.prepare_paged(&c, 3).unwrap_err();
            assert!(matches!(e, Error::HeadGroups { layer: 0, .. }), "{e}");
            att.prepare_paged(&c, HEADS).unwrap();
            assert_eq!(
                att.prepare_paged(&c, HEADS).unwrap(),
                0,
                "{dtype} {choice:?}"
            );
            for &(seq, rows) in &seqs {
                let visible = c.len(seq).unwrap();
                for (n_q, window, soft_cap) in [(1, None, None), (3, Some(6), Some(4.0))] {
                    let options = AttentionOptions {
                        window,
                        soft_cap,
                        scale: None,
                    };
                    let what = format!("{dtype} {choice:?} {seq} ({visible} rows) n_q {n_q}");
                    check_sequence(
                        g,
                        &c,
                        &mut att,
                        (seq, rows),
                        (d, r, rope),
                        n_q,
                        &options,
                        &what,
                    )
                    .await;
                }
            }
        }
        // The same sequences as one ragged batch (decode and chunk rows mixed), one dispatch pair
        // per layer, each segment against the twin of its own sequence.
        let batch: Vec<(SeqId, usize)> = vec![(a, 1), (b, 3), (c1, 1), (c2, 2), (a, 2)];
        let total: usize = batch.iter().map(|b| b.1).sum();
        for choice in super::attention_bodies::kernels(g) {
            att.set_kernel(choice);
            let takes = |l| super::attention_bodies::kernel_takes(choice, &spec, l);
            assert!(takes(0) && takes(1), "{choice:?} {dtype}: whole vectors");
            // And with a shorter batch recorded after it into the same encoder.
            let what = format!("{dtype} {choice:?}");
            let batches: [&[(SeqId, usize)]; 2] = [&batch, &[(b, 1), (c1, 1)]];
            let dflt = AttentionOptions::default();
            check_batches_in_one_encoder(
                g,
                &c,
                &mut att,
                &batches,
                &seqs,
                (d, r, rope),
                &dflt,
                &what,
            )
            .await;
            for (window, soft_cap) in [(None, None), (Some(6), Some(4.0))] {
                let options = AttentionOptions {
                    window,
                    soft_cap,
                    scale: None,
                };
                let what = format!("{dtype} {choice:?} batch {batch:?} window {window:?}");
                check_batch(
                    g,
                    &c,
                    &mut att,
                    &batch,
                    &seqs,
                    (d, r, rope),
                    &options,
                    &what,
                )
                .await;
            }
        }
        // A batch whose counts do not add up to the queries, or with too many queries for a
        // sequence, is refused and writes nothing.
        let q = super::f32_buffer(&g.device, &values(1, 64 * HEADS * d)).await;
        let out = super::output(&g.device, 64 * HEADS * d).await;
        let dflt = AttentionOptions::default();
        let mut refused = |batch: &[(SeqId, usize)], n_q: usize| {
            att.gqa(
                Kv::Batch(&c, batch),
                0,
                Queries::new(&q, n_q, HEADS, d),
                &out,
                &dflt,
            )
            .unwrap_err()
        };
        let request = |e: &Error| match e {
            Error::AttentionRequest { problem, .. } => Some(problem.clone()),
            _ => None,
        };
        let e = refused(&batch, total + 1);
        assert!(
            matches!(request(&e), Some(AttentionProblem::BatchRows { .. })),
            "{dtype}: {e}"
        );
        // (b, 2) with 3 queries given: a batch of one entry is counted as well.
        let e = refused(&[(b, 2)], 3);
        assert_eq!(
            request(&e),
            Some(AttentionProblem::BatchRows {
                batch: 2,
                queries: 3
            }),
            "{dtype}: {e}"
        );
        let e = refused(&[], 1);
        assert_eq!(
            request(&e),
            Some(AttentionProblem::EmptyBatch),
            "{dtype}: {e}"
        );
        let too_many = [(a, 1), (b, c.len(b).unwrap() + 1)];
        let e = refused(&too_many, 2 + c.len(b).unwrap());
        // The entry whose count is wrong is named.
        let visible_b = c.len(b).unwrap();
        let want_b = |n_q| Error::QueryRows {
            seq: Some(b),
            layer: 0,
            n_q,
            visible: visible_b,
        };
        assert_eq!(e, want_b(c.len(b).unwrap() + 1), "{dtype}");
        assert!(
            super::read_f32(g, &out).await.iter().all(|&x| x == -7.0),
            "{dtype}: written"
        );
        // Refusals: a removed sequence, more queries than rows.
        c.remove(c2).unwrap();
        let e = att
            .gqa(
                Kv::Sequence(&c, c2),
                0,
                Queries::new(&q, 1, HEADS, d),
                &out,
                &dflt,
            )
            .unwrap_err();
        assert_eq!(e, Error::UnknownSequence { seq: c2 }, "{dtype}");
        let n = c.len(b).unwrap() + 1;
        let e = att
            .gqa(
                Kv::Sequence(&c, b),
                0,
                Queries::new(&q, n, HEADS, d),
                &out,
                &dflt,
            )
            .unwrap_err();
        assert_eq!(e, want_b(n), "{dtype}");
        assert!(
            super::read_f32(g, &out).await.iter().all(|&x| x == -7.0),
            "{dtype}: written"
        );
    }
}

/// Sequences of hundreds of rows in pages of 5 (so that the rows a one-invocation team takes in
/// turn cross pages, and each team takes several of them), through their page tables and as ragged
/// batches, with windows that start inside a page, match the CPU twins on every pass-1 kernel of
/// the adapter, for f32 and f16 storage.
pub async fn long_paged_sequences_match_the_reference(g: &Gpu) {
    for dtype in [DType::F32, DType::F16] {
        let (spec, dims) = gqa_mla_spec(dtype, 400);
        let widths = widths_of(&spec);
        let mut c = PagedCache::with_kernels(super::kernels_for(g), spec.clone(), 5, 200).unwrap();
        let a = c.add_sequence().unwrap();
        let b = c.add_sequence().unwrap();
        // a and b take pages in turn; c shares a's first 233 rows, inside a page.
        let mut ra = step(g, &mut c, a, 151, 11, false).await;
        let mut rb = step(g, &mut c, b, 97, 12, true).await;
        ra = grown(&ra, &step(g, &mut c, a, 149, 13, false).await);
        rb = grown(&rb, &step(g, &mut c, b, 73, 14, false).await);
        let fork = c.fork(a, 233).unwrap();
        let rc = grown(
            &prefix(&ra, 233, &widths),
            &step(g, &mut c, fork, 40, 15, false).await,
        );
        let seqs = [(a, &ra), (b, &rb), (fork, &rc)];
        let batch: Vec<(SeqId, usize)> = vec![(a, 1), (b, 2), (fork, 1)];
        let mut att = Attention::with_kernels(super::kernels_for(g));
        for choice in super::attention_bodies::kernels(g) {
            let takes = |l| super::attention_bodies::kernel_takes(choice, &spec, l);
            assert!(takes(0) && takes(1), "{choice:?} {dtype}: whole vectors");
            att.set_kernel(choice);
            for (window, soft_cap) in [(None, None), (Some(37), Some(4.0))] {
                let options = AttentionOptions {
                    window,
                    soft_cap,
                    scale: None,
                };
                for &(seq, rows) in &seqs {
                    let n = c.len(seq).unwrap();
                    let what = format!("{dtype} {choice:?} {seq} ({n} rows) window {window:?}");
                    check_sequence(g, &c, &mut att, (seq, rows), dims, 2, &options, &what).await;
                }
                let what = format!("{dtype} {choice:?} batch {batch:?} window {window:?}");
                check_batch(g, &c, &mut att, &batch, &seqs, dims, &options, &what).await;
            }
        }
    }
}

/// Ragged batches in the cases the other paged tests leave out, each segment against the twin of
/// its own sequence, on every pass-1 kernel of the adapter, for f32 and f16 storage:
/// - a window longer than the shortest sequence and shorter than the others (12 rows, over
///   sequences of 7, 18 and 100);
/// - queries read through strided views of a fused buffer, and the output written through a
///   strided view into a buffer of sentinels (elements outside the view stay as they were);
/// - GQA, MHA (one KV head per query head) and MLA layers;
/// - natively, batches split over several dispatch pairs. The device has 16 KiB bindings; at the
///   highest workgroup target the 100 rows make at least 2 chunks on every kernel (pieces of 64
///   rows for teams of one invocation, of 16 for the others), and the 65 queries' partial results
///   take 8,320 bytes per chunk for GQA (4 heads of 8) and MLA (2 heads of 16), with 520 bytes of
///   query table beside them. So each pair takes a part of the batch and reads its own part of the
///   query table. The same holds for the last 70 rows of the longest sequence as queries of
///   `Kv::Sequence` (no query table: each pair counts its queries from its first). And every
///   row of the three as GQA queries at the adapter's own target: one chunk, whose streaming
///   kernels write a contiguous output themselves, in two pairs. A browser's device has WebGPU's
///   128 MiB bindings at least: there each call is one pair.
pub async fn ragged_batches_read_strided_views_windows_and_split_pairs(g: &Gpu) {
    // The features of `g`'s device: subgroups where it has them, for every kernel.
    let small = super::gpu_with(
        g,
        wgpu::Limits {
            max_storage_buffer_binding_size: 16 << 10,
            ..wgpu::Limits::default()
        },
        g.device.features(),
    )
    .await;
    // (KV heads, query heads) of the GQA and MHA layers; MLA's query heads.
    let (gqa, mha, mla_heads) = ((2, 4), (2, 2), 2);
    let (d, r, rope) = (8, 16, 8);
    for dtype in [DType::F32, DType::F16] {
        let layers = vec![
            LayerSpec::kv(gqa.0, d, d),
            LayerSpec::kv(mha.0, d, d),
            LayerSpec::mla(r, rope),
        ];
        let spec = CacheSpec::new(layers, dtype, 100).unwrap();
        let mut c =
            PagedCache::with_kernels(super::kernels_for(&small), spec.clone(), 5, 28).unwrap();
        let (a, b, s) = (
            c.add_sequence().unwrap(),
            c.add_sequence().unwrap(),
            c.add_sequence().unwrap(),
        );
        // The three take pages in turn.
        let mut ra = step(&small, &mut c, a, 10, 21, false).await;
        let rb = step(&small, &mut c, b, 7, 22, true).await;
        let mut rs = step(&small, &mut c, s, 60, 23, false).await;
        ra = grown(&ra, &step(&small, &mut c, a, 8, 24, true).await);
        rs = grown(&rs, &step(&small, &mut c, s, 40, 25, false).await);
        let seqs = [(a, &ra), (b, &rb), (s, &rs)];
        // Every row of a and b a query, and s's last 40 (a chunked prefill of all three).
        let batch: Vec<(SeqId, usize)> = vec![(b, 7), (a, 18), (s, 40)];
        let mut att = Attention::with_kernels(super::kernels_for(&small));
        att.set_target_workgroups(std::num::NonZeroUsize::new(1 << 24));
        for choice in super::attention_bodies::kernels(&small) {
            att.set_kernel(choice);
            let takes = |l| super::attention_bodies::kernel_takes(choice, &spec, l);
            assert!(
                takes(0) && takes(1) && takes(2),
                "{choice:?} {dtype}: whole vectors"
            );
            for (window, soft_cap) in [(None, None), (Some(12), Some(4.0))] {
                let options = AttentionOptions {
                    window,
                    soft_cap,
                    scale: None,
                };
                for (layer, heads) in [(0, gqa.1), (1, mha.1), (2, mla_heads)] {
                    let what = format!("{dtype} {choice:?} layer {layer} window {window:?}");
                    check_strided_batch(
                        &small,
                        &c,
                        &mut att,
                        (&batch, false, false),
                        &seqs,
                        (layer, heads),
                        (d, r, rope),
                        &options,
                        &what,
                    )
                    .await;
                    // s's last 70 rows as queries of one sequence (no query table): two chunks
                    // of their partial results (8,960 bytes each for GQA) do not fit one 16 KiB
                    // binding, so pairs after the first count their queries from a later one.
                    check_strided_batch(
                        &small,
                        &c,
                        &mut att,
                        (&[(s, 70)], true, false),
                        &seqs,
                        (layer, heads),
                        (d, r, rope),
                        &options,
                        &format!("{what}, sequence s"),
                    )
                    .await;
                }
            }
        }
        // Every row of the three as a GQA query, at the adapter's own workgroup target (one
        // chunk), contiguous queries and output: pass 1 of a streaming kernel writes the output
        // itself, in two pairs natively (the 125 queries' outputs, 16,000 bytes, and the query
        // table do not fit one binding), each at its own queries.
        att.set_target_workgroups(None);
        let everything = [(b, 7), (a, 18), (s, 100)];
        for choice in super::attention_bodies::kernels(&small) {
            att.set_kernel(choice);
            let what = format!("{dtype} {choice:?}, every row, one chunk");
            check_strided_batch(
                &small,
                &c,
                &mut att,
                (&everything, false, true),
                &seqs,
                (0, gqa.1),
                (d, r, rope),
                &AttentionOptions::default(),
                &what,
            )
            .await;
        }
    }
}

/// One call of `layer` (GQA or MHA of heads of `d`, or MLA of latent `r` and rope `rope`) over a
/// ragged `batch` (or, `as_sequence`, over its one sequence as `Kv::Sequence`), its queries in a
/// fused buffer (per query a row of each head's `[q]` or `[latent | rope]`, then 5 more elements,
/// after 3), its output through a strided view (or, `contiguous`, queries and output row-major
/// from element 0); each segment against the twin of its own sequence.
#[allow(clippy::too_many_arguments)]
async fn check_strided_batch(
    g: &Gpu,
    c: &PagedCache,
    att: &mut Attention,
    (batch, as_sequence, contiguous): (&[(SeqId, usize)], bool, bool),
    seqs: &[(SeqId, &SeqRows)],
    (layer, heads): (usize, usize),
    (d, r, rope): (usize, usize, usize),
    options: &AttentionOptions,
    what: &str,
) {
    use super::attention_bodies::{OutView, assert_view_close, gather};
    let kv = match (batch, as_sequence) {
        ([(seq, _)], true) => Kv::Sequence(c, *seq),
        _ => Kv::Batch(c, batch),
    };
    let total: usize = batch.iter().map(|x| x.1).sum();
    let mla = layer == 2;
    let (head, width) = if mla { (r + rope, r) } else { (d, d) };
    let (pad, row) = match contiguous {
        true => (0, heads * head),
        false => (3, heads * head + 5),
    };
    let fused = values(40 + layer as u64, pad + total * row);
    let q = super::f32_buffer(&g.device, &fused).await;
    let strides = [row, head, 1];
    let view = match contiguous {
        true => OutView {
            offset: 0,
            strides: [heads * width, width, 1],
        },
        false => OutView {
            offset: 2,
            strides: [heads * width + 3, width, 1],
        },
    };
    let shape = [total, heads, width];
    let out = super::output(&g.device, view.len(shape)).await;
    let output = Output::new(&out).at(view.offset).with_strides(view.strides);
    let queries = |at: usize, dim: usize| {
        Queries::new(&q, total, heads, dim)
            .at(at)
            .with_strides(strides)
    };
    let result = if mla {
        let mla_q = MlaQueries {
            latent: queries(pad, r),
            rope: queries(pad + r, rope),
        };
        att.mla(kv, layer, mla_q, output, options)
    } else {
        att.gqa(kv, layer, queries(pad, d), output, options)
    };
    result.unwrap_or_else(|e| panic!("{what}: {e}"));
    let mut want = Vec::with_capacity(total * heads * width);
    let mut at = pad;
    for &(seq, n) in batch {
        let rows = &seqs.iter().find(|x| x.0 == seq).unwrap().1[layer];
        let segment = if mla {
            let latent = gather(&fused, at, [n, heads, r], strides);
            let rope_q = gather(&fused, at + r, [n, heads, rope], strides);
            reference::attention_mla(
                &latent,
                &rope_q,
                [n, heads, r],
                &rows[0],
                &rows[1],
                rope,
                options,
            )
        } else {
            let n_kv = rows[0].len() / (c.len(seq).unwrap() * d);
            let qs = gather(&fused, at, [n, heads, d], strides);
            reference::attention_gqa(&qs, [n, heads, d], &rows[0], &rows[1], n_kv, d, options)
        };
        want.extend(segment);
        at += n * row;
    }
    let got = super::read_f32(g, &out).await;
    assert_view_close(&got, view, shape, &want, what);
}

/// A pool is sized before anything is allocated: no page or an empty page is `EmptyPool`; a pool of a
/// slot larger than one storage binding (or whose row count overflows) is `PoolTooLarge`, naming the
/// most pages that fit, which is exactly the largest count under the limit.
pub async fn paged_pool_sizes_are_checked(g: &Gpu) {
    let limit = g.limits().max_slot_bytes();
    let spec = CacheSpec::new(vec![LayerSpec::kv(2, 64, 32)], DType::F16, 100).unwrap();
    let new = |page_size: usize, n_pages: usize| {
        PagedCache::with_kernels(super::kernels_for(g), spec.clone(), page_size, n_pages)
    };
    for (page_size, n_pages) in [(0, 4), (16, 0), (0, 0)] {
        assert_eq!(
            new(page_size, n_pages).unwrap_err(),
            Error::EmptyPool { page_size, n_pages }
        );
    }
    // K is the widest slot: 2 x 64 f16 = 256 bytes per row.
    let row_bytes = 256u64;
    let fit = (limit / (16 * row_bytes)) as usize;
    for n_pages in [fit + 1, usize::MAX] {
        match new(16, n_pages).unwrap_err() {
            Error::PoolTooLarge {
                layer: 0,
                slot: 0,
                max_pages,
                row_bytes: r,
                ..
            } => assert_eq!((max_pages, r), (fit, row_bytes), "{n_pages} pages"),
            e => panic!("{n_pages} pages: {e}"),
        }
    }
    let pool = new(16, 8).unwrap();
    assert_eq!(
        (pool.n_pages(), pool.free_pages(), pool.page_size()),
        (8, 8, 16)
    );
    // Page tables within one binding of `limit` bytes: a pool of `limit / 16` one-row pages has
    // table rows of as many entries (a sequence may hold every page; `max_seq_len` is larger), so
    // the table holds four sequences. A fifth is refused and changes nothing; a removed one's row is
    // taken again. Natively on a device of 16 KiB bindings; a browser gives every device WebGPU's
    // default limits at least (128 MiB).
    let small = super::gpu_with_limits(
        g,
        wgpu::Limits {
            max_storage_buffer_binding_size: 16 << 10,
            ..wgpu::Limits::default()
        },
    )
    .await;
    let n_pages = (small.limits().max_slot_bytes() / 16) as usize;
    let spec = CacheSpec::new(vec![LayerSpec::kv(1, 1, 1)], DType::F32, 2 * n_pages).unwrap();
    let mut pool = PagedCache::new(&small.device, &small.queue, spec, 1, n_pages).unwrap();
    let seqs: Vec<SeqId> = (0..4).map(|_| pool.add_sequence().unwrap()).collect();
    let before = pool.ledger().clone();
    assert_eq!(
        pool.add_sequence().unwrap_err(),
        Error::TooManySequences { most: 4 }
    );
    let forked = pool.fork(seqs[0], 0).unwrap_err();
    assert_eq!(forked, Error::TooManySequences { most: 4 });
    // An import is refused before it stages anything, whole or streamed: a stream at its header,
    // before any row arrives, and every later call repeats the refusal.
    let bytes = pool.snapshot_sequence_async(seqs[0]).await.unwrap();
    let imported = pool.import_sequence(&bytes).unwrap_err();
    assert_eq!(imported, Error::TooManySequences { most: 4 });
    let header = SnapshotHeader::parse(&bytes).unwrap();
    let header_bytes = (header.total_bytes() - header.rows_bytes() - 4) as usize;
    let mut streamed = pool.import_sequence_stream();
    assert_eq!(
        streamed.push(&bytes[..header_bytes]).unwrap_err(),
        Error::TooManySequences { most: 4 }
    );
    assert_eq!(
        streamed.push(&bytes[header_bytes..]).unwrap_err(),
        Error::TooManySequences { most: 4 }
    );
    assert_eq!(
        streamed.finish().unwrap_err(),
        Error::TooManySequences { most: 4 }
    );
    assert_eq!(pool.ledger(), &before);
    pool.remove(seqs[1]).unwrap();
    pool.add_sequence().unwrap();
    // With an attention recorded over a sequence of 2 rows (2 pages) and not yet run: its truncation
    // to 1 row needs a fresh table row, and is refused, changing nothing; its removal keeps its row
    // for the encoder, so a new sequence is refused until the encoder goes.
    let ones = [1.0f32, 2.0];
    let slabs = [
        HostSlab::f32(&ones, &[2, 1, 1]),
        HostSlab::f32(&ones, &[2, 1, 1]),
    ];
    pool.append(seqs[0], 0, &slabs).unwrap();
    pool.advance(seqs[0], 2).unwrap();
    let mut att = Attention::new(&small.device, &small.queue).unwrap();
    let q = super::f32_buffer(&small.device, &[1.0]).await;
    let out = super::output(&small.device, 1).await;
    let mut encoder = small.device.create_command_encoder(&Default::default());
    let opts = AttentionOptions::default();
    let kv = Kv::Sequence(&pool, seqs[0]);
    att.record_gqa(&mut encoder, kv, 0, Queries::new(&q, 1, 1, 1), &out, &opts)
        .unwrap();
    let before = pool.ledger().clone();
    assert_eq!(
        pool.truncate(seqs[0], 1).unwrap_err(),
        Error::TooManySequences { most: 4 }
    );
    assert_eq!(pool.ledger(), &before);
    pool.remove(seqs[0]).unwrap();
    assert_eq!(
        pool.add_sequence().unwrap_err(),
        Error::TooManySequences { most: 4 }
    );
    drop(encoder);
    pool.add_sequence().unwrap();
    // Scattered appends within one binding: 40 rows of two 256-byte slots and their map (20.6 KB)
    // would not fit one 16 KiB binding, so the rows move run by run; 4 rows are scattered. Both
    // land (in the browser every append fits, and is scattered).
    let spec = CacheSpec::new(vec![LayerSpec::kv(1, 64, 64)], DType::F32, 64).unwrap();
    let mut pool = PagedCache::new(&small.device, &small.queue, spec, 8, 8).unwrap();
    pool.set_scatter(ScatterChoice::Always);
    let s = pool.add_sequence().unwrap();
    let mut want = [Vec::new(), Vec::new()];
    for (n, seed) in [(40, 1), (4, 3)] {
        let data = [values(seed, n * 64), values(seed + 1, n * 64)];
        let shape = [n, 1, 64];
        let slabs = [
            HostSlab::f32(&data[0], &shape),
            HostSlab::f32(&data[1], &shape),
        ];
        pool.append(s, 0, &slabs).unwrap();
        pool.advance(s, n).unwrap();
        for k in 0..2 {
            want[k].extend_from_slice(&data[k]);
        }
    }
    for (k, want) in want.iter().enumerate() {
        assert_eq!(
            &pool.read_f32_async(s, 0, k).await.unwrap(),
            want,
            "slot {k}"
        );
    }
}

/// A GPU source of another device is refused by a pool's append as by a cache's (natively the call
/// checks it; in a browser it was never verified for this device), before anything is recorded: the
/// ledger, the free pages and the pool's memory stay as they were, and a source of its own device
/// is taken.
pub async fn paged_sources_of_another_device_are_refused(g: &Gpu) {
    let other = super::default_limits_gpu(g).await;
    let spec = CacheSpec::new(vec![LayerSpec::kv(1, 4, 4)], DType::F16, 32).unwrap();
    let mut c = PagedCache::with_kernels(super::kernels_for(g), spec, 4, 8).unwrap();
    let s = c.add_sequence().unwrap();
    let words: Vec<u32> = values(1, 6 * 4).iter().map(|x| x.to_bits()).collect();
    let foreign = buffer_with(&other.device, &words, super::USAGE).await;
    let own = buffer_with(&g.device, &words, super::USAGE).await;
    let shape = [6, 1, 4];
    let slab = |buffer| GpuSlab {
        buffer,
        dtype: DType::F32,
        offset: 0,
        shape: &shape,
        strides: None,
    };
    let (ledger, pool) = (
        c.ledger().clone(),
        [
            c.read_pool_words_async(0, 0).await.unwrap(),
            c.read_pool_words_async(0, 1).await.unwrap(),
        ],
    );
    let e = c
        .append_gpu(s, 0, &[slab(&foreign), slab(&foreign)])
        .unwrap_err();
    let refused = match &e {
        Error::ForeignDevice { layer: 0, .. } => !cfg!(target_arch = "wasm32"),
        Error::UnverifiedBuffer { layer: 0, .. } => cfg!(target_arch = "wasm32"),
        _ => false,
    };
    assert!(refused, "{e}");
    assert_eq!(c.ledger(), &ledger, "the refusal changed the ledger");
    assert_eq!(c.free_pages(), 8);
    for (slot, words) in pool.iter().enumerate() {
        assert_eq!(&c.read_pool_words_async(0, slot).await.unwrap(), words);
    }
    c.append_gpu(s, 0, &[slab(&own), slab(&own)]).unwrap();
    c.advance(s, 6).unwrap();
    let want: Vec<f32> = values(1, 24)
        .iter()
        .map(|&x| reference::round_trip(x, DType::F16))
        .collect();
    assert_eq!(c.read_f32_async(s, 0, 0).await.unwrap(), want);
    assert_eq!(c.free_pages(), 6);
}

/// A whole step of many sequences appended from one slab per slot (`append_batch` from the host,
/// `append_gpu_batch` from a strided f32 GPU buffer) leaves the pool, word for word, and the ledger
/// exactly as the same appends one sequence at a time: a fork and its parent writing into the page
/// they share, a sequence named twice, parts crossing pages. A batch whose counts do not add up, that
/// names an unknown sequence, or that runs out of pages part way is refused whole, changing nothing.
pub async fn batched_appends_match_one_by_one(g: &Gpu) {
    for dtype in DType::STORAGE {
        let layers = match dtype.block() {
            Some(b) => vec![LayerSpec::kv(1, b, b), LayerSpec::mla(b, b)],
            None => vec![LayerSpec::kv(2, 4, 4), LayerSpec::mla(5, 2)],
        };
        let spec = CacheSpec::new(layers, dtype, 40).unwrap();
        let widths = widths_of(&spec);
        let trailing = |layer: usize| trailing_of(&spec, layer);
        let make = || PagedCache::with_kernels(super::kernels_for(g), spec.clone(), 3, 14).unwrap();
        let (mut one, mut all) = (make(), make());
        // One by one as the pool chooses, the batch always scattered.
        all.set_scatter(ScatterChoice::Always);
        // The same history in both: s0 with 7 rows, s1 forked from it at 5, s2 empty. Each pool's
        // ids are its own (`[s0, s1, s2, gone]`).
        let mut ids: Vec<[SeqId; 4]> = Vec::new();
        for c in [&mut one, &mut all] {
            let s0 = c.add_sequence().unwrap();
            for (layer, w) in widths.iter().enumerate() {
                let data: Vec<Vec<f32>> = w.iter().map(|&w| values(layer as u64, 7 * w)).collect();
                let shapes: Vec<Vec<usize>> = trailing(layer)
                    .iter()
                    .map(|t| [&[7][..], t].concat())
                    .collect();
                let slabs: Vec<HostSlab> = (0..2)
                    .map(|k| HostSlab::f32(&data[k], &shapes[k]))
                    .collect();
                c.append(s0, layer, &slabs).unwrap();
            }
            c.advance(s0, 7).unwrap();
            let s1 = c.fork(s0, 5).unwrap();
            let s2 = c.add_sequence().unwrap();
            let gone = c.add_sequence().unwrap();
            c.remove(gone).unwrap();
            ids.push([s0, s1, s2, gone]);
        }
        let step = |[s0, s1, s2, _]: [SeqId; 4]| [(s0, 2), (s1, 4), (s2, 5), (s0, 1)];
        let batch_one = step(ids[0]);
        let [s0, s1, s2, gone] = ids[1];
        let batch = step(ids[1]);
        let total = 12;
        // Layer 0 from the host, layer 1 from GPU buffers (rows of row_elems + 3 f32).
        for layer in 0..2 {
            let data: Vec<Vec<f32>> = widths[layer]
                .iter()
                .map(|&w| values(100 + layer as u64, total * w))
                .collect();
            let shape_of = |n: usize| -> Vec<Vec<usize>> {
                trailing(layer)
                    .iter()
                    .map(|t| [&[n][..], t].concat())
                    .collect()
            };
            let mut bufs = Vec::new();
            for (k, d) in data.iter().enumerate() {
                bufs.push(padded_rows(g, d, widths[layer][k], 3, 0).await);
            }
            let strides: Vec<Vec<usize>> = (0..2)
                .map(|k| row_strides(&shape_of(total)[k], widths[layer][k] + 3))
                .collect();
            let mut first = 0;
            for &(seq, n) in &batch_one {
                let shapes = shape_of(n);
                if layer == 0 {
                    let parts: Vec<&[f32]> = (0..2)
                        .map(|k| &data[k][first * widths[layer][k]..(first + n) * widths[layer][k]])
                        .collect();
                    let slabs: Vec<HostSlab> = (0..2)
                        .map(|k| HostSlab::f32(parts[k], &shapes[k]))
                        .collect();
                    one.append(seq, layer, &slabs).unwrap();
                } else {
                    let slabs: Vec<GpuSlab> = (0..2)
                        .map(|k| GpuSlab {
                            buffer: &bufs[k],
                            dtype: DType::F32,
                            offset: (first * (widths[layer][k] + 3)) as u64,
                            shape: &shapes[k],
                            strides: Some(&strides[k]),
                        })
                        .collect();
                    one.append_gpu(seq, layer, &slabs).unwrap();
                }
                first += n;
            }
            let shapes = shape_of(total);
            if layer == 0 {
                let slabs: Vec<HostSlab> = (0..2)
                    .map(|k| HostSlab::f32(&data[k], &shapes[k]))
                    .collect();
                // Counts that do not add up, an unknown sequence: refused, nothing changed.
                let (before, words) = (all.ledger().clone(), pool_words(&all).await);
                let short = [(s0, 2), (s1, 4), (s2, 5)];
                assert!(matches!(
                    all.append_batch(layer, &short, &slabs).unwrap_err(),
                    Error::BatchRows {
                        batch: 11,
                        rows: 12,
                        ..
                    }
                ));
                let mut unknown = batch.to_vec();
                unknown[2] = (gone, 5);
                assert_eq!(
                    all.append_batch(layer, &unknown, &slabs).unwrap_err(),
                    Error::UnknownSequence { seq: gone }
                );
                assert_eq!(all.ledger(), &before);
                assert_eq!(
                    pool_words(&all).await,
                    words,
                    "{dtype}: a refused batch wrote"
                );
                all.append_batch(layer, &batch, &slabs).unwrap();
            } else {
                let slabs: Vec<GpuSlab> = (0..2)
                    .map(|k| GpuSlab {
                        buffer: &bufs[k],
                        dtype: DType::F32,
                        offset: 0,
                        shape: &shapes[k],
                        strides: Some(&strides[k]),
                    })
                    .collect();
                all.append_gpu_batch(layer, &batch, &slabs).unwrap();
            }
        }
        let [o0, o1, o2, _] = ids[0];
        for (seq, n) in [(o0, 3), (o1, 4), (o2, 5)] {
            one.advance(seq, n).unwrap();
        }
        // The batched pool commits its step at once.
        let [a0, a1, a2, _] = ids[1];
        all.advance_batch(&[(a0, 3), (a1, 4), (a2, 5)]).unwrap();
        same_ledgers((one.ledger(), &ids[0]), (all.ledger(), &ids[1]), dtype);
        for layer in 0..2 {
            for slot in 0..2 {
                assert_eq!(
                    one.read_pool_words_async(layer, slot).await.unwrap(),
                    all.read_pool_words_async(layer, slot).await.unwrap(),
                    "{dtype}: layer {layer} slot {slot}"
                );
            }
        }
        // A batch that runs out of pages after its first part: refused whole.
        let free = all.free_pages();
        let big: Vec<f32> = values(9, 3 * (free + 1) * widths[0][0]);
        let big_v: Vec<f32> = values(10, 3 * (free + 1) * widths[0][1]);
        let n_big = 3 * (free + 1);
        let shapes: Vec<Vec<usize>> = trailing(0)
            .iter()
            .map(|t| [&[n_big + 1][..], t].concat())
            .collect();
        let mut big_k = big.clone();
        big_k.extend(values(11, widths[0][0]));
        let mut big_vv = big_v.clone();
        big_vv.extend(values(12, widths[0][1]));
        let slabs = [
            HostSlab::f32(&big_k, &shapes[0]),
            HostSlab::f32(&big_vv, &shapes[1]),
        ];
        let (ledger, words) = (all.ledger().clone(), pool_words(&all).await);
        let e = all
            .append_batch(0, &[(s2, 1), (s1, n_big)], &slabs)
            .unwrap_err();
        assert!(
            matches!(e, Error::OutOfPages { needed, free: f } if f == free && needed > free),
            "{e}"
        );
        assert_eq!(
            all.ledger(),
            &ledger,
            "{dtype}: a refused batch changed the ledger"
        );
        assert_eq!(
            pool_words(&all).await,
            words,
            "{dtype}: a refused batch wrote"
        );
        // A batch whose second sequence would pass the pool's 40 rows: the error names it.
        let n_long = 40 - all.len(s1).unwrap() + 1;
        let shapes: Vec<Vec<usize>> = trailing(0)
            .iter()
            .map(|t| [&[1 + n_long][..], t].concat())
            .collect();
        let long: Vec<Vec<f32>> = (0..2)
            .map(|k| values(13 + k as u64, (1 + n_long) * widths[0][k]))
            .collect();
        let slabs = [
            HostSlab::f32(&long[0], &shapes[0]),
            HostSlab::f32(&long[1], &shapes[1]),
        ];
        let e = all
            .append_batch(0, &[(s2, 1), (s1, n_long)], &slabs)
            .unwrap_err();
        assert_eq!(
            e,
            Error::CapacityExceeded {
                seq: Some(s1),
                layer: 0,
                position: 40 - n_long + 1,
                n_new: n_long,
                capacity: 40,
                remaining: n_long - 1,
            },
            "{dtype}"
        );
        assert!(
            e.to_string().starts_with(&format!("{s1}, layer 0: ")),
            "{e}"
        );
        assert_eq!(all.ledger(), &ledger, "{dtype}: {e}");
    }
}

/// Steps of 16 sequences, every row of a step in a page of its own sequence (16 to 48 runs per
/// slot, of one row or more, some after a fork's private copy), land the same bits whichever way they
/// move: one by one (`write_buffer` per run), and as batches the pool moves as it chooses (on a CPU
/// adapter: one upload and a copy per run; on a GPU: scattered), scattered, or run by run.
pub async fn many_runs_of_host_rows_land_alike_whichever_way_they_move(g: &Gpu) {
    for dtype in DType::STORAGE {
        let layers = match dtype.block() {
            Some(b) => vec![LayerSpec::kv(1, b, b), LayerSpec::mla(b, b)],
            None => vec![LayerSpec::kv(2, 4, 4), LayerSpec::mla(5, 2)],
        };
        let spec = CacheSpec::new(layers, dtype, 12).unwrap();
        let widths = widths_of(&spec);
        let shapes = |layer: usize, n: usize| -> Vec<Vec<usize>> {
            trailing_of(&spec, layer)
                .iter()
                .map(|t| [&[n][..], t].concat())
                .collect()
        };
        let n_seqs = 16;
        let choices = [
            ScatterChoice::Never,
            ScatterChoice::Auto,
            ScatterChoice::Always,
            ScatterChoice::Never,
        ];
        let mut pools = Vec::new();
        for (p, &choice) in choices.iter().enumerate() {
            let mut c =
                PagedCache::with_kernels(super::kernels_for(g), spec.clone(), 2, 6 * n_seqs)
                    .unwrap();
            // Sequence i starts with i % 3 rows; every fourth is a fork of the whole sequence
            // before it, sharing its pages.
            let mut ids = Vec::new();
            for i in 0..n_seqs {
                let seq = if i % 4 == 3 {
                    c.fork(ids[i - 1], (i - 1) % 3).unwrap()
                } else {
                    c.add_sequence().unwrap()
                };
                let n = i % 3 * usize::from(i % 4 != 3);
                for (layer, widths) in widths.iter().enumerate() {
                    let data: Vec<Vec<f32>> = widths
                        .iter()
                        .map(|&w| values((i * 2 + layer) as u64, n * w))
                        .collect();
                    let shapes = shapes(layer, n);
                    let slabs: Vec<HostSlab> = (0..2)
                        .map(|k| HostSlab::f32(&data[k], &shapes[k]))
                        .collect();
                    c.append(seq, layer, &slabs).unwrap();
                }
                c.advance(seq, n).unwrap();
                ids.push(seq);
            }
            c.set_scatter(choice);
            // Pool 0 takes the steps one sequence at a time, the others as batches.
            for (step, per_seq) in [1, 3].into_iter().enumerate() {
                let total = n_seqs * per_seq;
                for (layer, widths) in widths.iter().enumerate() {
                    let data: Vec<Vec<f32>> = widths
                        .iter()
                        .map(|&w| values((100 + step * 2 + layer) as u64, total * w))
                        .collect();
                    if p == 0 {
                        for (i, &seq) in ids.iter().enumerate() {
                            let shapes = shapes(layer, per_seq);
                            let slabs: Vec<HostSlab> = (0..2)
                                .map(|k| {
                                    let w = widths[k];
                                    let part = &data[k][i * per_seq * w..(i + 1) * per_seq * w];
                                    HostSlab::f32(part, &shapes[k])
                                })
                                .collect();
                            c.append(seq, layer, &slabs).unwrap();
                        }
                    } else {
                        let batch: Vec<(SeqId, usize)> =
                            ids.iter().map(|&seq| (seq, per_seq)).collect();
                        let shapes = shapes(layer, total);
                        let slabs: Vec<HostSlab> = (0..2)
                            .map(|k| HostSlab::f32(&data[k], &shapes[k]))
                            .collect();
                        c.append_batch(layer, &batch, &slabs).unwrap();
                    }
                }
                for &seq in &ids {
                    c.advance(seq, per_seq).unwrap();
                }
            }
            pools.push((c, ids));
        }
        let (reference, ref_ids) = &pools[0];
        for ((c, ids), choice) in pools.iter().zip(choices).skip(1) {
            same_ledgers((reference.ledger(), ref_ids), (c.ledger(), ids), dtype);
            for layer in 0..2 {
                for slot in 0..2 {
                    assert_eq!(
                        c.read_pool_words_async(layer, slot).await.unwrap(),
                        reference.read_pool_words_async(layer, slot).await.unwrap(),
                        "{dtype} {choice:?}: layer {layer} slot {slot}"
                    );
                }
            }
        }
    }
}

/// Asserts that two pools' ledgers hold the same state, sequence `a.1[i]` of the first as `b.1[i]` of
/// the second (ids carry their pool, so the ledgers themselves never compare equal): the same live
/// sequences with the same lengths, pages and pending rows, and the same free pages and page holders.
fn same_ledgers(a: (&PageLedger, &[SeqId]), b: (&PageLedger, &[SeqId]), dtype: DType) {
    let ((la, ia), (lb, ib)) = (a, b);
    let live = |l: &PageLedger, ids: &[SeqId]| -> Vec<usize> {
        let seqs: Vec<SeqId> = l.sequences().collect();
        ids.iter()
            .enumerate()
            .filter(|(_, id)| seqs.contains(id))
            .map(|(i, _)| i)
            .collect()
    };
    assert_eq!(live(la, ia), live(lb, ib), "{dtype}: live sequences");
    assert_eq!(la.sequences().count(), lb.sequences().count(), "{dtype}");
    for i in live(la, ia) {
        let (x, y) = (ia[i], ib[i]);
        assert_eq!(la.len(x), lb.len(y), "{dtype}: sequence {i} length");
        assert_eq!(la.pages(x), lb.pages(y), "{dtype}: sequence {i} pages");
        for layer in 0..la.n_layers() {
            assert_eq!(la.pending(x, layer), lb.pending(y, layer), "{dtype}: {i}");
        }
    }
    assert_eq!(la.free_pages(), lb.free_pages(), "{dtype}: free pages");
    for page in 0..la.n_pages() as u32 {
        assert_eq!(
            la.page_refs(page),
            lb.page_refs(page),
            "{dtype}: page {page}"
        );
    }
}

/// More sequences than the page table first holds (8 rows): the table grows (twice here) while
/// every earlier sequence keeps its entries, removed sequences' rows are reused, and one batch of
/// attention over all of them matches the twins.
pub async fn many_sequences_grow_the_page_table(g: &Gpu) {
    let spec = CacheSpec::new(vec![LayerSpec::kv(1, 4, 4)], DType::F32, 8).unwrap();
    let mut c = PagedCache::with_kernels(super::kernels_for(g), spec, 2, 96).unwrap();
    let mut att = Attention::with_kernels(super::kernels_for(g));
    let mut rows: BTreeMap<SeqId, [Vec<f32>; 2]> = BTreeMap::new();
    let add = |c: &mut PagedCache, rows: &mut BTreeMap<SeqId, [Vec<f32>; 2]>, seed: u64| {
        let s = c.add_sequence().unwrap();
        let (k, v) = (values(seed, 3 * 4), values(seed + 1000, 3 * 4));
        c.append(
            s,
            0,
            &[HostSlab::f32(&k, &[3, 1, 4]), HostSlab::f32(&v, &[3, 1, 4])],
        )
        .unwrap();
        c.advance(s, 3).unwrap();
        rows.insert(s, [k, v]);
    };
    // The rows the table holds, as the pool's `Debug` gives them.
    let table_rows = |c: &PagedCache| {
        let debug = format!("{c:?}");
        let at = debug
            .find("table_capacity: ")
            .expect("table_capacity in the Debug output")
            + 16;
        debug[at..]
            .split(|ch: char| !ch.is_ascii_digit())
            .next()
            .and_then(|n| n.parse::<usize>().ok())
            .expect("a row count")
    };
    assert_eq!(table_rows(&c), 8);
    for i in 0..20 {
        add(&mut c, &mut rows, i);
    }
    assert_eq!(table_rows(&c), 32, "8 rows grown twice");
    for round in 0..2 {
        let batch: Vec<(SeqId, usize)> = rows.keys().map(|&s| (s, 1)).collect();
        let n = batch.len();
        let q = values(77 + round, n * 2 * 4);
        let qb = super::f32_buffer(&g.device, &q).await;
        let out = super::output(&g.device, n * 2 * 4).await;
        let opts = AttentionOptions::default();
        att.gqa(
            Kv::Batch(&c, &batch),
            0,
            Queries::new(&qb, n, 2, 4),
            &out,
            &opts,
        )
        .unwrap();
        let got = super::read_f32(g, &out).await;
        for (i, (s, [k, v])) in rows.iter().enumerate() {
            let want =
                reference::attention_gqa(&q[i * 8..(i + 1) * 8], [1, 2, 4], k, v, 1, 4, &opts);
            super::assert_close(
                &got[i * 8..(i + 1) * 8],
                &want,
                &format!("round {round}: {s}"),
            );
        }
        // Half go; ten new ones take their table rows (and grow the table no further).
        let gone: Vec<SeqId> = rows.keys().copied().step_by(2).collect();
        for s in gone {
            c.remove(s).unwrap();
            rows.remove(&s);
        }
        for i in 0..10 {
            add(&mut c, &mut rows, 100 + 10 * round + i);
        }
        assert_eq!(table_rows(&c), 32, "round {round}: freed rows reused");
    }
    assert_eq!(
        c.pages_in_use(),
        20 * 2,
        "20 sequences of 3 rows in 2-row pages"
    );
}

/// A step of many sequences lands scattered (one dispatch per slot), run by run, or as the pool
/// chooses, from every kind of source: host rows of the storage type and of f32, GPU rows of the storage type (bound, or
/// copy-only, which moves run by run instead) and converted f32 rows, then host f32 rows again after
/// the GPU appends' uploads. Each sequence's rows, read
/// through its page table, equal the values rounded to the storage type.
pub async fn scattered_appends_take_every_source(g: &Gpu) {
    let choices = [
        ScatterChoice::Always,
        ScatterChoice::Never,
        ScatterChoice::Auto,
    ];
    for (dtype, choice) in DType::STORAGE
        .into_iter()
        .flat_map(|d| choices.map(|c| (d, c)))
    {
        // Even widths, so 16-bit rows of the storage type can also be plain copies; whole blocks for
        // the block-quantized types.
        let layers = match dtype.block() {
            Some(b) => vec![LayerSpec::kv(1, b, b), LayerSpec::mla(2 * b, b)],
            None => vec![LayerSpec::kv(1, 2, 4), LayerSpec::mla(6, 2)],
        };
        let spec = CacheSpec::new(layers, dtype, 24).unwrap();
        let widths = widths_of(&spec);
        let mut c = PagedCache::with_kernels(super::kernels_for(g), spec.clone(), 2, 40).unwrap();
        c.set_scatter(choice);
        let seqs: Vec<SeqId> = (0..4).map(|_| c.add_sequence().unwrap()).collect();
        let batch = [(seqs[0], 3), (seqs[1], 1), (seqs[2], 4), (seqs[3], 2)];
        let total = 10;
        // What each (sequence, layer, slot) should hold, as stored values.
        let mut want: BTreeMap<(SeqId, usize, usize), Vec<f32>> = BTreeMap::new();
        let kinds = [
            "host storage",
            "host f32",
            "gpu storage",
            "gpu copy-only",
            "gpu f32",
            // Again after GPU appends, whose row maps and table entries (multiples of 4 bytes) went
            // into the upload ring before these rows: rows of whole 16-byte vectors (f32 V) are
            // scattered from an offset that must still be a whole vector.
            "host f32 after gpu",
        ];
        for (round, kind) in kinds.iter().enumerate() {
            // GPU sources hold elements: quantized storage takes its "storage" rows as f16 (converted
            // and quantized by the kernel), and has no copy-only source (every row needs the kernel).
            let f16_source = dtype.is_quantized() && *kind == "gpu storage";
            if dtype.is_quantized() && *kind == "gpu copy-only" {
                continue;
            }
            for (layer, widths) in widths.iter().enumerate() {
                let shapes: Vec<Vec<usize>> = trailing_of(&spec, layer)
                    .iter()
                    .map(|t| [&[total][..], t].concat())
                    .collect();
                let data: Vec<Vec<f32>> = widths
                    .iter()
                    .enumerate()
                    .map(|(k, &w)| {
                        let v = values(
                            1000 * round as u64 + 10 * layer as u64 + k as u64,
                            total * w,
                        );
                        if f16_source {
                            v.iter()
                                .map(|&x| reference::round_trip(x, DType::F16))
                                .collect()
                        } else {
                            v
                        }
                    })
                    .collect();
                let bits: Vec<Vec<u32>> = data
                    .iter()
                    .map(|d| {
                        d.iter()
                            .map(|&x| reference::f32_to_bits(x, dtype))
                            .collect()
                    })
                    .collect();
                let as_f16: Vec<Vec<half::f16>> = bits
                    .iter()
                    .map(|b| b.iter().map(|&x| half::f16::from_bits(x as u16)).collect())
                    .collect();
                let as_bf16: Vec<Vec<half::bf16>> = bits
                    .iter()
                    .map(|b| b.iter().map(|&x| half::bf16::from_bits(x as u16)).collect())
                    .collect();
                let host = |k: usize| match (*kind, dtype) {
                    ("host storage", DType::F16) => HostSlab::f16(&as_f16[k], &shapes[k]),
                    ("host storage", DType::BF16) => HostSlab::bf16(&as_bf16[k], &shapes[k]),
                    _ => HostSlab::f32(&data[k], &shapes[k]),
                };
                if kind.starts_with("host") {
                    let slabs: Vec<HostSlab> = (0..2).map(host).collect();
                    c.append_batch(layer, &batch, &slabs).unwrap();
                } else {
                    let (src_dtype, usage) = match *kind {
                        "gpu storage" if f16_source => (DType::F16, super::USAGE),
                        "gpu storage" => (dtype, super::USAGE),
                        "gpu copy-only" => (dtype, wgpu::BufferUsages::COPY_SRC),
                        _ => (DType::F32, super::USAGE),
                    };
                    let mut bufs = Vec::new();
                    for (k, &w) in widths.iter().enumerate() {
                        let words = match src_dtype {
                            DType::F32 => data[k].iter().map(|x| x.to_bits()).collect(),
                            DType::F16 if f16_source => {
                                let h: Vec<u32> = data[k]
                                    .iter()
                                    .map(|&x| reference::f32_to_bits(x, DType::F16))
                                    .collect();
                                reference::pack_rows(&h, DType::F16, w)
                            }
                            _ => reference::pack_rows(&bits[k], dtype, w),
                        };
                        bufs.push(buffer_with(&g.device, &words, usage).await);
                    }
                    let slabs: Vec<GpuSlab> = (0..2)
                        .map(|k| GpuSlab::contiguous(&bufs[k], src_dtype, &shapes[k]))
                        .collect();
                    c.append_gpu_batch(layer, &batch, &slabs).unwrap();
                }
                let mut first = 0;
                for &(seq, n) in &batch {
                    for (k, &w) in widths.iter().enumerate() {
                        want.entry((seq, layer, k)).or_default().extend(
                            reference::round_trip_rows(
                                &data[k][first * w..(first + n) * w],
                                dtype,
                                w,
                            ),
                        );
                    }
                    first += n;
                }
            }
            for &(seq, n) in &batch {
                c.advance(seq, n).unwrap();
            }
            for ((seq, layer, slot), rows) in &want {
                let got = c.read_f32_async(*seq, *layer, *slot).await.unwrap();
                let same = got.len() == rows.len()
                    && got
                        .iter()
                        .zip(rows)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(
                    same,
                    "{dtype} {choice:?}, {kind}: {seq} layer {layer} slot {slot}"
                );
            }
        }
        // Six steps of 3, 1, 4, 2 rows (five for quantized storage, without copy-only sources).
        let rounds = if dtype.is_quantized() { 5 } else { 6 };
        let pages: usize = [3usize, 1, 4, 2]
            .iter()
            .map(|r| (r * rounds).div_ceil(2))
            .sum();
        assert_eq!(c.pages_in_use(), pages, "{dtype}: {rounds} steps");
    }
}

/// Published prefixes, for every storage type: a sequence's whole pages published under its tokens
/// outlive it; sequences started from the longest published prefix of their tokens read its rows
/// (bit for bit, and through GQA and MLA attention as one ragged batch against the twins), grow from
/// there, and copy a published page before writing into it, which leaves the published rows as they
/// were. Publishing more tokens than rows is refused and changes nothing; evicting every page no
/// sequence holds gives the pool back whole.
pub async fn published_prefixes_start_sequences_from_their_pages(g: &Gpu) {
    const PAGE_ROWS: usize = 5;
    for dtype in DType::STORAGE {
        let (spec, dims) = gqa_mla_spec(dtype, 32);
        let widths = widths_of(&spec);
        let mut c =
            PagedCache::with_kernels(super::kernels_for(g), spec.clone(), PAGE_ROWS, 24).unwrap();
        let a = c.add_sequence().unwrap();
        let ra = step(g, &mut c, a, 12, 1, false).await;
        let tokens: Vec<u32> = (100..112).collect();
        // Two whole pages; the third holds two rows and stays unpublished.
        assert_eq!(c.publish_prefix(a, &tokens).unwrap(), 10, "{dtype}");
        c.remove(a).unwrap();
        assert_eq!((c.cached_pages(), c.free_pages()), (2, 22), "{dtype}");

        let with = |head: &[u32], tail: &[u32]| [head, tail].concat();
        // b: both pages, then its own rows; e: the first page; f: nothing published.
        let (b, len) = c
            .add_sequence_with_prefix(&with(&tokens[..10], &[7, 7]))
            .unwrap();
        assert_eq!(len, 10, "{dtype}");
        let rb = grown(
            &prefix(&ra, 10, &widths),
            &step(g, &mut c, b, 3, 2, true).await,
        );
        let (e, len) = c.add_sequence_with_prefix(&tokens[..7]).unwrap();
        assert_eq!(len, 5, "{dtype}");
        let re = grown(
            &prefix(&ra, 5, &widths),
            &step(g, &mut c, e, 4, 3, false).await,
        );
        let (f, len) = c.add_sequence_with_prefix(&[1, 2, 3, 4, 5, 6]).unwrap();
        assert_eq!(len, 0, "{dtype}");
        let rf = step(g, &mut c, f, 6, 4, false).await;
        // h: both pages, cut back into the second and written there: a private copy first.
        let (h, _) = c.add_sequence_with_prefix(&tokens).unwrap();
        c.truncate(h, 7).unwrap();
        let rh = grown(
            &prefix(&ra, 7, &widths),
            &step(g, &mut c, h, 2, 5, true).await,
        );
        // The published rows are as a's were.
        let (k, len) = c.add_sequence_with_prefix(&tokens).unwrap();
        assert_eq!(len, 10, "{dtype}");
        let rk = prefix(&ra, 10, &widths);
        let seqs = [(b, &rb), (e, &re), (f, &rf), (h, &rh), (k, &rk)];
        for &(seq, rows) in &seqs {
            for (layer, rows) in rows.iter().enumerate() {
                for (slot, want) in rows.iter().enumerate() {
                    let got = c.read_f32_async(seq, layer, slot).await.unwrap();
                    let same = got.len() == want.len()
                        && got
                            .iter()
                            .zip(want)
                            .all(|(x, y)| x.to_bits() == y.to_bits());
                    assert!(same, "{dtype}: {seq} layer {layer} slot {slot}");
                }
            }
        }

        // Attention: the newest row of each sequence, one ragged batch per layer.
        let batch: Vec<(SeqId, usize)> = seqs.iter().map(|&(s, _)| (s, 1)).collect();
        let mut att = Attention::with_kernels(super::kernels_for(g));
        let opts = AttentionOptions::default();
        let what = format!("{dtype} sequences from published pages");
        check_batch(g, &c, &mut att, &batch, &seqs, dims, &opts, &what).await;

        // More tokens than rows: refused, nothing changed.
        let mut words = Vec::new();
        for (layer, slot) in [(0, 0), (0, 1), (1, 0), (1, 1)] {
            words.push(c.read_pool_words_async(layer, slot).await.unwrap());
        }
        let ledger = c.ledger().clone();
        let refused = c
            .publish_prefix(e, &with(&tokens[..5], &[0; 5]))
            .unwrap_err();
        assert_eq!(
            refused,
            Error::PrefixBeyondLength {
                seq: e,
                tokens: 10,
                len: 9
            },
            "{dtype}"
        );
        assert_eq!(c.ledger(), &ledger, "{dtype}: ledger");
        for (i, (layer, slot)) in [(0, 0), (0, 1), (1, 0), (1, 1)].into_iter().enumerate() {
            let now = c.read_pool_words_async(layer, slot).await.unwrap();
            assert_eq!(
                now, words[i],
                "{dtype}: pool words of layer {layer} slot {slot}"
            );
        }

        // Every sequence gone, the published pages stay until evicted.
        for &(seq, _) in &seqs {
            c.remove(seq).unwrap();
        }
        assert_eq!(c.cached_pages(), 2, "{dtype}");
        assert_eq!(c.evict_prefixes(usize::MAX), 2, "{dtype}");
        assert_eq!(c.free_pages(), c.n_pages(), "{dtype}: pages leaked");
        assert_eq!(c.add_sequence_with_prefix(&tokens).unwrap().1, 0);
    }
}

/// A sequence id names a sequence of the pool that handed it out only: given to another pool, where
/// a sequence of the same number lives, every call that takes an id refuses it with
/// `ForeignSequence` and changes nothing, and the other pool's own sequence is untouched.
pub async fn sequences_of_another_pool_are_refused(g: &Gpu) {
    let spec = CacheSpec::new(vec![LayerSpec::kv(1, 4, 4)], DType::F32, 32).unwrap();
    let pool = || PagedCache::with_kernels(super::kernels_for(g), spec.clone(), 4, 8).unwrap();
    let (mut a, mut b) = (pool(), pool());
    let shape = [2, 1, 4];
    let rows = values(3, 8);
    let slabs = [HostSlab::f32(&rows, &shape), HostSlab::f32(&rows, &shape)];
    let theirs = a.add_sequence().unwrap();
    a.append(theirs, 0, &slabs).unwrap();
    a.advance(theirs, 2).unwrap();
    let ours = b.add_sequence().unwrap();
    b.append(ours, 0, &slabs).unwrap();
    b.advance(ours, 2).unwrap();
    // Both are their pool's first sequence: the same number, told apart by their pools (in their
    // names too).
    let (t, o) = (format!("{theirs}"), format!("{ours}"));
    assert!(t.starts_with("sequence 0 of pool ") && o.starts_with("sequence 0 of pool "));
    assert_ne!(t, o);
    assert_ne!(theirs, ours);

    let ledger = b.ledger().clone();
    let words = [
        b.read_pool_words_async(0, 0).await.unwrap(),
        b.read_pool_words_async(0, 1).await.unwrap(),
    ];
    let refused = |e: Error, what: &str| {
        assert_eq!(e, Error::ForeignSequence { seq: theirs }, "{what}");
        assert!(e.to_string().contains("another pool"), "{what}: {e}");
    };
    refused(b.len(theirs).unwrap_err(), "len");
    refused(b.visible(theirs, 0).unwrap_err(), "visible");
    refused(b.append(theirs, 0, &slabs).unwrap_err(), "append");
    refused(
        b.append_batch(0, &[(ours, 1), (theirs, 1)], &slabs)
            .unwrap_err(),
        "append_batch",
    );
    refused(b.advance(theirs, 1).unwrap_err(), "advance");
    refused(b.truncate(theirs, 0).unwrap_err(), "truncate");
    refused(b.fork(theirs, 1).unwrap_err(), "fork");
    refused(
        b.publish_prefix(theirs, &[1, 2]).unwrap_err(),
        "publish_prefix",
    );
    refused(b.admits(&[(ours, 1), (theirs, 1)]).unwrap_err(), "admits");
    refused(
        b.snapshot_sequence_async(theirs).await.unwrap_err(),
        "snapshot",
    );
    refused(
        b.read_f32_async(theirs, 0, 0).await.unwrap_err(),
        "read_f32",
    );
    let gpu_rows = super::f32_buffer(&g.device, &rows).await;
    let gpu_slab = || GpuSlab::contiguous(&gpu_rows, DType::F32, &shape);
    refused(
        b.append_gpu(theirs, 0, &[gpu_slab(), gpu_slab()])
            .unwrap_err(),
        "append_gpu",
    );
    let e = b
        .append_gpu_batch(0, &[(theirs, 2)], &[gpu_slab(), gpu_slab()])
        .unwrap_err();
    refused(e, "append_gpu_batch");
    refused(b.remove(theirs).unwrap_err(), "remove");
    let mut att = Attention::with_kernels(super::kernels_for(g));
    let q = super::f32_buffer(&g.device, &values(4, 2 * 4)).await;
    let out = super::output(&g.device, 2 * 4).await;
    let dflt = AttentionOptions::default();
    let e = att
        .gqa(
            Kv::Sequence(&b, theirs),
            0,
            Queries::new(&q, 1, 1, 4),
            &out,
            &dflt,
        )
        .unwrap_err();
    refused(e, "attention over one sequence");
    let batch = [(ours, 1), (theirs, 1)];
    let e = att
        .gqa(
            Kv::Batch(&b, &batch),
            0,
            Queries::new(&q, 2, 1, 4),
            &out,
            &dflt,
        )
        .unwrap_err();
    refused(e, "attention over a batch");
    assert!(
        super::read_f32(g, &out).await.iter().all(|&x| x == -7.0),
        "a refused attention wrote"
    );

    assert_eq!(b.ledger(), &ledger, "a refusal changed the ledger");
    for (slot, words) in words.iter().enumerate() {
        assert_eq!(&b.read_pool_words_async(0, slot).await.unwrap(), words);
    }
    // Each pool still has its own sequence, whole.
    let kept: Vec<f32> = rows.clone();
    assert_eq!(b.read_f32_async(ours, 0, 0).await.unwrap(), kept);
    assert_eq!(a.read_f32_async(theirs, 0, 1).await.unwrap(), kept);
    b.remove(ours).unwrap();
    assert_eq!(a.len(theirs), Ok(2));
}

/// An attention recorded over a sequence before the page table grows reads, once submitted, the
/// table entries written after the growth, as without one. Here a fork shares its parent's first
/// page; the table grows; the parent's append takes a private copy of that page (its entry
/// changes), a host append or a GPU append in a submission of its own (one recorded into the app's
/// encoder would keep the shared page until that encoder is done); and the
/// fork's host append then writes its own rows into the page, now the fork's alone. The recorded
/// attention must read the parent's copy: the entry once went into the grown table only, and the
/// attention read the fork's rows as the parent's.
pub async fn attention_recorded_before_the_table_grows_sees_later_entries(g: &Gpu) {
    let spec = CacheSpec::new(vec![LayerSpec::kv(1, 4, 4)], DType::F32, 16).unwrap();
    let opts = AttentionOptions::default();
    let (k, v) = (values(21, 3 * 4), values(22, 3 * 4));
    let (k3, v3) = (values(24, 4), values(25, 4));
    let (kf, vf) = (values(26, 2 * 4), values(27, 2 * 4));
    let row3 = [
        super::f32_buffer(&g.device, &k3).await,
        super::f32_buffer(&g.device, &v3).await,
    ];
    let q = values(23, 2 * 4);
    let qb = super::f32_buffer(&g.device, &q).await;
    for gpu_append in [false, true] {
        let mut c = PagedCache::with_kernels(super::kernels_for(g), spec.clone(), 4, 64).unwrap();
        let mut att = Attention::with_kernels(super::kernels_for(g));
        let shape = [3, 1, 4];
        let parent = c.add_sequence().unwrap();
        c.append(
            parent,
            0,
            &[HostSlab::f32(&k, &shape), HostSlab::f32(&v, &shape)],
        )
        .unwrap();
        c.advance(parent, 3).unwrap();
        let fork = c.fork(parent, 1).unwrap();
        let first = c.ledger().pages(parent).unwrap()[0];
        assert_eq!(c.ledger().pages(fork).unwrap(), [first]);
        // Every row of the first table (8) taken.
        for _ in 0..6 {
            c.add_sequence().unwrap();
        }
        let out = super::output(&g.device, 8).await;
        let mut encoder = g.device.create_command_encoder(&Default::default());
        att.record_gqa(
            &mut encoder,
            Kv::Sequence(&c, parent),
            0,
            Queries::new(&qb, 1, 2, 4),
            &out,
            &opts,
        )
        .unwrap();
        assert!(format!("{c:?}").contains("table_capacity: 8"), "{c:?}");
        c.add_sequence().unwrap();
        assert!(format!("{c:?}").contains("table_capacity: 16"), "{c:?}");
        // The parent's row 3 goes into a private copy of the shared page; the fork's rows 1 and 2
        // then into the first page, the fork's alone.
        if gpu_append {
            let slabs = row3.each_ref().map(|buffer| GpuSlab {
                buffer,
                dtype: DType::F32,
                offset: 0,
                shape: &[1, 1, 4],
                strides: None,
            });
            c.append_gpu(parent, 0, &slabs).unwrap();
        } else {
            let slabs = [
                HostSlab::f32(&k3, &[1, 1, 4]),
                HostSlab::f32(&v3, &[1, 1, 4]),
            ];
            c.append(parent, 0, &slabs).unwrap();
        }
        assert_ne!(
            c.ledger().pages(parent).unwrap()[0],
            first,
            "a private copy"
        );
        c.append(
            fork,
            0,
            &[
                HostSlab::f32(&kf, &[2, 1, 4]),
                HostSlab::f32(&vf, &[2, 1, 4]),
            ],
        )
        .unwrap();
        assert_eq!(c.ledger().pages(fork).unwrap(), [first]);
        g.queue.submit([encoder.finish()]);
        let want = reference::attention_gqa(&q, [1, 2, 4], &k, &v, 1, 4, &opts);
        let got = super::read_f32(g, &out).await;
        let what = format!("attention recorded before the table grew, GPU append {gpu_append}");
        super::assert_close(&got, &want, &what);
        // The pool holds what each sequence was given.
        c.advance(parent, 1).unwrap();
        c.advance(fork, 2).unwrap();
        let parent_k = [&k[..], &k3[..]].concat();
        assert_eq!(c.read_f32_async(parent, 0, 0).await.unwrap(), parent_k);
        let fork_k = [&k[..4], &kf[..]].concat();
        assert_eq!(c.read_f32_async(fork, 0, 0).await.unwrap(), fork_k);
    }
}

/// A recorded GPU append changes page-table entries where it stands among the encoder's commands:
/// an attention recorded before it reads the table it was recorded against, one recorded after it
/// the new one. Here the append writes into a page a fork shares, so its table entry moves to a
/// private copy that the append fills; read through the new entry too early, the earlier attention
/// would see that page empty. Then an append recorded before the page table grows: the grown table
/// holds its entries when the encoder runs, after the growth. Last, two batches recorded into one
/// encoder, each read by an attention recorded after it.
pub async fn recorded_appends_change_the_table_in_encoder_order(g: &Gpu) {
    let spec = CacheSpec::new(vec![LayerSpec::kv(1, 4, 4)], DType::F32, 16).unwrap();
    let mut c = PagedCache::with_kernels(super::kernels_for(g), spec, 2, 64).unwrap();
    let mut att = Attention::with_kernels(super::kernels_for(g));
    let opts = AttentionOptions::default();
    let (k, v) = (values(11, 4 * 4), values(12, 4 * 4));
    let host = |n: usize| {
        let shape = [n, 1, 4];
        (k[..n * 4].to_vec(), v[..n * 4].to_vec(), shape)
    };
    // The reference over the first `n` rows for one query of 2 heads.
    let want = |q: &[f32], n: usize| {
        reference::attention_gqa(q, [1, 2, 4], &k[..n * 4], &v[..n * 4], 1, 4, &opts)
    };
    let (k4, v4) = (
        super::f32_buffer(&g.device, &k[12..16]).await,
        super::f32_buffer(&g.device, &v[12..16]).await,
    );
    let gpu_row = [
        GpuSlab {
            buffer: &k4,
            dtype: DType::F32,
            offset: 0,
            shape: &[1, 1, 4],
            strides: None,
        },
        GpuSlab {
            buffer: &v4,
            dtype: DType::F32,
            offset: 0,
            shape: &[1, 1, 4],
            strides: None,
        },
    ];
    let (q1, q2) = (values(13, 8), values(14, 8));
    let (qb1, qb2) = (
        super::f32_buffer(&g.device, &q1).await,
        super::f32_buffer(&g.device, &q2).await,
    );

    // A parent of 3 rows in pages of 2; its fork shares both pages, the second partly filled.
    let parent = c.add_sequence().unwrap();
    let (pk, pv, shape) = host(3);
    c.append(
        parent,
        0,
        &[HostSlab::f32(&pk, &shape), HostSlab::f32(&pv, &shape)],
    )
    .unwrap();
    c.advance(parent, 3).unwrap();
    let child = c.fork(parent, 3).unwrap();
    let shared = c.ledger().pages(child).unwrap().to_vec();
    assert_eq!(shared, c.ledger().pages(parent).unwrap());

    let (before, after) = (
        super::output(&g.device, 8).await,
        super::output(&g.device, 8).await,
    );
    let mut encoder = g.device.create_command_encoder(&Default::default());
    att.record_gqa(
        &mut encoder,
        Kv::Sequence(&c, child),
        0,
        Queries::new(&qb1, 1, 2, 4),
        &before,
        &opts,
    )
    .unwrap();
    c.record_append_gpu(&mut encoder, child, 0, &gpu_row)
        .unwrap();
    let copied = c.ledger().pages(child).unwrap().to_vec();
    assert_eq!(copied[0], shared[0], "the full page stays shared");
    assert_ne!(copied[1], shared[1], "the append takes a private copy");
    att.record_gqa(
        &mut encoder,
        Kv::Sequence(&c, child),
        0,
        Queries::new(&qb2, 1, 2, 4),
        &after,
        &opts,
    )
    .unwrap();
    g.queue.submit([encoder.finish()]);
    let got = super::read_f32(g, &before).await;
    super::assert_close(&got, &want(&q1, 3), "attention recorded before the append");
    let got = super::read_f32(g, &after).await;
    super::assert_close(&got, &want(&q2, 4), "attention recorded after the append");
    c.advance(child, 1).unwrap();
    assert_eq!(c.read_f32_async(child, 0, 0).await.unwrap(), k[..16]);
    assert_eq!(c.read_f32_async(parent, 0, 0).await.unwrap(), k[..12]);

    // A sequence of one full page; an append recorded into the first table gives it a new page,
    // then the table grows (8 rows at first) before the encoder is submitted. The attention
    // recorded after both reads the grown table, which must hold the new entry.
    let s = c.add_sequence().unwrap();
    let (sk, sv, shape) = host(2);
    c.append(
        s,
        0,
        &[HostSlab::f32(&sk, &shape), HostSlab::f32(&sv, &shape)],
    )
    .unwrap();
    c.advance(s, 2).unwrap();
    let (k3, v3) = (
        super::f32_buffer(&g.device, &k[8..12]).await,
        super::f32_buffer(&g.device, &v[8..12]).await,
    );
    let third = [
        GpuSlab {
            buffer: &k3,
            ..gpu_row[0]
        },
        GpuSlab {
            buffer: &v3,
            ..gpu_row[1]
        },
    ];
    let mut encoder = g.device.create_command_encoder(&Default::default());
    c.record_append_gpu(&mut encoder, s, 0, &third).unwrap();
    assert_eq!(c.ledger().pages(s).unwrap().len(), 2, "a new page");
    let mut others = Vec::new();
    while others.len() < 8 {
        others.push(c.add_sequence().unwrap());
    }
    let grown = super::output(&g.device, 8).await;
    att.record_gqa(
        &mut encoder,
        Kv::Sequence(&c, s),
        0,
        Queries::new(&qb2, 1, 2, 4),
        &grown,
        &opts,
    )
    .unwrap();
    g.queue.submit([encoder.finish()]);
    let got = super::read_f32(g, &grown).await;
    super::assert_close(&got, &want(&q2, 3), "attention over the grown table");
    // And in a submission of its own, through the grown table.
    c.advance(s, 1).unwrap();
    let later = super::output(&g.device, 8).await;
    att.gqa(
        Kv::Sequence(&c, s),
        0,
        Queries::new(&qb1, 1, 2, 4),
        &later,
        &opts,
    )
    .unwrap();
    let got = super::read_f32(g, &later).await;
    super::assert_close(
        &got,
        &want(&q1, 3),
        "a later attention over the grown table",
    );

    // Two batches recorded into one encoder, an attention between them and after: a second fork
    // of the parent shares its half-filled page, and both append into it (a private copy each),
    // then both again into fresh pages. Each batch's rows are two runs, so each is scattered by
    // its own row map; the maps, tables and copies of the first must not be overwritten by the
    // second's before the encoder runs.
    let fork = c.fork(parent, 3).unwrap();
    let rows = values(15, 4 * 4);
    let rows_v = values(16, 4 * 4);
    let (kb, vb) = (
        super::f32_buffer(&g.device, &rows).await,
        super::f32_buffer(&g.device, &rows_v).await,
    );
    let two = |first: usize| {
        [&kb, &vb].map(|buffer| GpuSlab {
            buffer,
            dtype: DType::F32,
            offset: (first * 4) as u64,
            shape: &[2, 1, 4],
            strides: None,
        })
    };
    // The rows each sequence should hold: the parent's three, then its row of each batch.
    let seen = |extra: &[usize]| {
        let mut kk = k[..12].to_vec();
        let mut vv = v[..12].to_vec();
        for &r in extra {
            kk.extend_from_slice(&rows[r * 4..r * 4 + 4]);
            vv.extend_from_slice(&rows_v[r * 4..r * 4 + 4]);
        }
        (kk, vv)
    };
    let want_over = |q: &[f32], (kk, vv): (Vec<f32>, Vec<f32>)| {
        reference::attention_gqa(q, [1, 2, 4], &kk, &vv, 1, 4, &opts)
    };
    let outs = [
        super::output(&g.device, 8).await,
        super::output(&g.device, 8).await,
        super::output(&g.device, 8).await,
    ];
    let mut encoder = g.device.create_command_encoder(&Default::default());
    c.record_append_gpu_batch(&mut encoder, 0, &[(parent, 1), (fork, 1)], &two(0))
        .unwrap();
    att.record_gqa(
        &mut encoder,
        Kv::Sequence(&c, fork),
        0,
        Queries::new(&qb1, 1, 2, 4),
        &outs[0],
        &opts,
    )
    .unwrap();
    c.record_append_gpu_batch(&mut encoder, 0, &[(fork, 1), (parent, 1)], &two(2))
        .unwrap();
    for (seq, out) in [(fork, &outs[1]), (parent, &outs[2])] {
        att.record_gqa(
            &mut encoder,
            Kv::Sequence(&c, seq),
            0,
            Queries::new(&qb2, 1, 2, 4),
            out,
            &opts,
        )
        .unwrap();
    }
    g.queue.submit([encoder.finish()]);
    let checks = [
        (
            &outs[0],
            want_over(&q1, seen(&[1])),
            "the fork between the batches",
        ),
        (
            &outs[1],
            want_over(&q2, seen(&[1, 2])),
            "the fork after both",
        ),
        (
            &outs[2],
            want_over(&q2, seen(&[0, 3])),
            "the parent after both",
        ),
    ];
    for (out, want, what) in checks {
        super::assert_close(&super::read_f32(g, out).await, &want, what);
    }
    for (seq, extra) in [(parent, [0, 3]), (fork, [1, 2])] {
        c.advance(seq, 2).unwrap();
        let (kk, vv) = seen(&extra);
        assert_eq!(c.read_f32_async(seq, 0, 0).await.unwrap(), kk);
        assert_eq!(c.read_f32_async(seq, 0, 1).await.unwrap(), vv);
    }
}

/// One step of a batch `[(x, 1), (y, 1)]` where `y` was forked from `x` one row short of `x`'s
/// length, inside `x`'s last page: `x`'s row lands in that shared page, so `x` copies it first,
/// and `y`'s row then lands in the page in place (it is `y`'s alone by then), over the row of `x`
/// that `y` does not see. The copy must be made before that write. Pages of 3, `x` of 5 rows, `y`
/// of 4; host rows and GPU rows, every way of moving rows, f32 and f16: both sequences read back
/// as appended.
pub async fn a_batch_copies_a_shared_page_before_writing_into_it(g: &Gpu) {
    for dtype in [DType::F32, DType::F16] {
        for scatter in [
            ScatterChoice::Auto,
            ScatterChoice::Always,
            ScatterChoice::Never,
        ] {
            for from_gpu in [false, true] {
                let what = format!("{dtype}, {scatter:?}, GPU rows {from_gpu}");
                let spec = CacheSpec::new(vec![LayerSpec::kv(1, 4, 4)], dtype, 16).unwrap();
                let mut p = PagedCache::with_kernels(super::kernels_for(g), spec, 3, 8).unwrap();
                p.set_scatter(scatter);
                let x = p.add_sequence().unwrap();
                let rows = values(60, 5 * 4);
                let slab = HostSlab::f32(&rows, &[5, 1, 4]);
                p.append(x, 0, &[slab, slab]).unwrap();
                p.advance(x, 5).unwrap();
                let y = p.fork(x, 4).unwrap();
                let step = values(61, 2 * 4);
                let batch = [(x, 1), (y, 1)];
                if from_gpu {
                    let buffer = super::f32_buffer(&g.device, &step).await;
                    let shape = [2, 1, 4];
                    let slab = GpuSlab::contiguous(&buffer, DType::F32, &shape);
                    p.append_gpu_batch(0, &batch, &[slab, slab]).unwrap();
                } else {
                    let slab = HostSlab::f32(&step, &[2, 1, 4]);
                    p.append_batch(0, &batch, &[slab, slab]).unwrap();
                }
                p.advance(x, 1).unwrap();
                p.advance(y, 1).unwrap();
                let stored = |v: &[f32]| reference::round_trip_rows(v, dtype, 4);
                for (seq, want) in [
                    (x, [&rows[..], &step[..4]].concat()),
                    (y, [&rows[..16], &step[4..]].concat()),
                ] {
                    for slot in 0..2 {
                        let got = p.read_f32_async(seq, 0, slot).await.unwrap();
                        assert_eq!(got, stored(&want), "{what}: {seq:?} slot {slot}");
                    }
                }
            }
        }
    }
}

/// One GPU buffer appended twice to a sequence of a pool of f16 pages of 4: as one run of rows
/// (rows 0 and 1), then, after a host row, across a page boundary (rows 3 and 4), which the pool may
/// scatter through a map of destination rows. The second append's source is the same buffer and
/// range as the first's, but it binds a row map: a bind group cached for the first must not serve
/// it. Every way of moving rows.
pub async fn a_source_appended_again_across_a_page_binds_its_own_row_map(g: &Gpu) {
    for scatter in [
        ScatterChoice::Auto,
        ScatterChoice::Always,
        ScatterChoice::Never,
    ] {
        let spec = CacheSpec::new(vec![LayerSpec::kv(1, 8, 8)], DType::F16, 16).unwrap();
        let mut p = PagedCache::with_kernels(super::kernels_for(g), spec, 4, 4).unwrap();
        p.set_scatter(scatter);
        let s = p.add_sequence().unwrap();
        let two = values(62, 2 * 8);
        let buffer = super::f32_buffer(&g.device, &two).await;
        let shape = [2, 1, 8];
        let slab = GpuSlab::contiguous(&buffer, DType::F32, &shape);
        p.append_gpu(s, 0, &[slab, slab]).unwrap();
        p.advance(s, 2).unwrap();
        let one = values(63, 8);
        let host = HostSlab::f32(&one, &[1, 1, 8]);
        p.append(s, 0, &[host, host]).unwrap();
        p.advance(s, 1).unwrap();
        p.append_gpu(s, 0, &[slab, slab]).unwrap();
        p.advance(s, 2).unwrap();
        let want =
            reference::round_trip_rows(&[&two[..], &one[..], &two[..]].concat(), DType::F16, 8);
        for slot in 0..2 {
            let got = p.read_f32_async(s, 0, slot).await.unwrap();
            assert_eq!(got, want, "{scatter:?} slot {slot}");
        }
    }
}

/// `Attention::prepare_paged` builds every pipeline the calls over a pool's sequences then use, one
/// sequence at a time and in batches, under the adapter's plans and a GPU's: on a registry of its
/// own, the calls that follow (a decode query and chunks of 3 and 8, with a window, over several
/// chunks of rows; on CPU adapters 8 queries take teams of several) build none. Against the twins.
pub async fn prepare_paged_builds_what_the_calls_use(g: &Gpu) {
    let (spec, dims) = gqa_mla_spec(DType::F32, 64);
    let mut c = PagedCache::with_kernels(super::kernels_for(g), spec, PAGE, 30).unwrap();
    let (a, b) = (c.add_sequence().unwrap(), c.add_sequence().unwrap());
    // Rows enough for several chunks under either plans, so that the calls merge them.
    let ra = step(g, &mut c, a, 40, 31, false).await;
    let rb = step(g, &mut c, b, 37, 32, true).await;
    let seqs = [(a, &ra), (b, &rb)];
    let options = AttentionOptions {
        window: Some(30),
        ..AttentionOptions::default()
    };
    for gpu_plan in [false, true] {
        let registry = Kernels::new(&g.device, &g.queue).unwrap();
        let mut att = Attention::with_kernels(registry.clone());
        att.plan_as_for_a_gpu(gpu_plan);
        let built = att.prepare_paged(&c, HEADS).unwrap();
        let held = registry.attention_pipelines();
        assert!(built > 0 && held >= built, "{built} built, {held} held");
        let what = format!("GPU plans {gpu_plan}");
        for &(seq, rows) in &seqs {
            for n_q in [1, 3, 8] {
                let what = format!("{what}, {seq:?} n_q {n_q}");
                check_sequence(g, &c, &mut att, (seq, rows), dims, n_q, &options, &what).await;
            }
        }
        let batch = [(a, 1), (b, 3)];
        check_batch(g, &c, &mut att, &batch, &seqs, dims, &options, &what).await;
        assert_eq!(
            registry.attention_pipelines(),
            held,
            "{what}: the calls built pipelines prepare_paged did not"
        );
    }
}

/// `truncate_and_scrub` and `remove_and_scrub` zero the rows they leave with no holder, and only
/// those: on f16 pages of 4 (rows of 4 words), with every layer and slot, a page only the truncated
/// sequence held is zeroed whole, the rows past the new end of its last page kept are zeroed where
/// it alone holds that page, and a page shared with a fork keeps every row (the fork still reads
/// them). Once every sequence is removed so, the pool is zeros but for a page published as a prefix,
/// which keeps its rows until `evict_prefixes_and_scrub` zeroes it too. A refused call (past the
/// length, a removed sequence) zeroes nothing and changes nothing.
pub async fn scrubbing_zeroes_the_rows_no_one_holds(g: &Gpu) {
    const PAGE: usize = 4;
    let spec = CacheSpec::new(vec![LayerSpec::kv(1, 8, 8); 2], DType::F16, 32).unwrap();
    let mut p = PagedCache::with_kernels(super::kernels_for(g), spec, PAGE, 8).unwrap();
    let row_words = 4;
    // Pool row `r`'s words in every layer and slot.
    let rows_of = |all: &[Vec<u32>], r: usize| -> Vec<u32> {
        all.iter()
            .flat_map(|w| w[r * row_words..(r + 1) * row_words].to_vec())
            .collect()
    };
    let a = p.add_sequence().unwrap();
    let ra = step(g, &mut p, a, 10, 41, false).await;
    let b = p.fork(a, 6).unwrap();
    let c = p.add_sequence().unwrap();
    let rc = step(g, &mut p, c, 7, 42, false).await;
    let pages_a = p.ledger().pages(a).unwrap().to_vec();
    let pages_c = p.ledger().pages(c).unwrap().to_vec();
    let gone = p.add_sequence().unwrap();
    p.remove(gone).unwrap();
    let before = pool_words(&p).await;
    let ledger = p.ledger().clone();
    // Refused: past a's length, and a sequence the pool does not hold.
    assert!(matches!(
        p.truncate_and_scrub(a, 11),
        Err(Error::TruncateBeyondLength { .. })
    ));
    assert!(p.remove_and_scrub(gone).is_err());
    assert!(p.truncate_and_scrub(gone, 0).is_err());
    assert_eq!(p.ledger(), &ledger);
    assert_eq!(pool_words(&p).await, before, "a refused scrub wrote");

    // a to 5 rows: its third page (rows 8-9) is its alone: zeroed whole; its second, shared with b
    // (forked at 6), keeps rows 4-7.
    p.truncate_and_scrub(a, 5).unwrap();
    // c to 5 rows: rows 5-7 of its second page (its alone) zeroed, row 4 kept.
    p.truncate_and_scrub(c, 5).unwrap();
    let after = pool_words(&p).await;
    for r in 0..8 * PAGE {
        let (page, in_page) = (r / PAGE, r % PAGE);
        let zeroed = page == pages_a[2] as usize || (page == pages_c[1] as usize && in_page >= 1);
        let want = if zeroed {
            vec![0; 4 * row_words]
        } else {
            rows_of(&before, r)
        };
        assert_eq!(rows_of(&after, r), want, "pool row {r} (page {page})");
    }
    assert!(
        rows_of(&before, pages_a[2] as usize * PAGE)
            .iter()
            .any(|&w| w != 0),
        "the zeroed page held rows"
    );
    let widths = widths_of(p.spec());
    for (seq, r, n) in [(a, &ra, 5), (b, &ra, 6), (c, &rc, 5)] {
        for (layer, slots) in prefix(r, n, &widths).iter().enumerate() {
            for (slot, want) in slots.iter().enumerate() {
                let got = p.read_f32_async(seq, layer, slot).await.unwrap();
                assert_eq!(&got, want, "{seq:?} layer {layer} slot {slot}");
            }
        }
    }
    // b alone holds nothing (its pages are a's too): nothing zeroed. Then a, whose first page is
    // published (kept with its rows), and c: every other page.
    p.remove_and_scrub(b).unwrap();
    assert_eq!(pool_words(&p).await, after, "b's pages are a's too");
    assert_eq!(p.publish_prefix(a, &[1, 2, 3, 4]).unwrap(), PAGE);
    p.remove_and_scrub(a).unwrap();
    p.remove_and_scrub(c).unwrap();
    assert_eq!((p.pages_in_use(), p.cached_pages()), (1, 1));
    let cached = pool_words(&p).await;
    for r in 0..8 * PAGE {
        let want = match r / PAGE == pages_a[0] as usize {
            true => rows_of(&after, r),
            false => vec![0; 4 * row_words],
        };
        assert_eq!(
            rows_of(&cached, r),
            want,
            "pool row {r}, the prefix's page kept"
        );
    }
    assert!(
        cached.iter().flatten().any(|&w| w != 0),
        "the prefix's rows"
    );
    // Evicted with a scrub: the pool is zeros again.
    assert_eq!(p.evict_prefixes_and_scrub(usize::MAX).unwrap(), 1);
    assert_eq!((p.pages_in_use(), p.cached_pages()), (0, 0));
    for words in pool_words(&p).await {
        assert!(words.iter().all(|&w| w == 0), "the pool is zeros again");
    }
}

/// A recorded GPU append's private copy reads the shared page when the encoder runs, and the pool
/// keeps that page until then. Before the encoder is submitted, the parent is removed with a
/// scrub and a new sequence takes every free page for rows of its own; the copy still takes the
/// parent's rows. Once the encoder's work is done the page returns to the pool at the next call,
/// zeroed, since its last sequence left through a scrub. A recorded encoder dropped unsubmitted
/// lets its page go too. A holder that writes past the rows the copy reads writes into the page
/// itself: a recorded two-layer step of a parent and its fork takes the one page admission counted.
pub async fn a_recorded_copy_keeps_its_page_until_the_encoder_is_done(g: &Gpu) {
    let spec = CacheSpec::new(vec![LayerSpec::kv(1, 4, 4)], DType::F32, 16).unwrap();
    let mut c = PagedCache::with_kernels(super::kernels_for(g), spec, 2, 6).unwrap();
    let (k, v) = (values(21, 4 * 4), values(22, 4 * 4));
    let (ok, ov) = (values(23, 6 * 4), values(24, 6 * 4));
    let gpu_k = super::f32_buffer(&g.device, &k[12..16]).await;
    let gpu_v = super::f32_buffer(&g.device, &v[12..16]).await;
    // `rows` rows of one head of 4 from `buffer`.
    let slab = |buffer, rows: &'static [usize; 3]| GpuSlab {
        buffer,
        dtype: DType::F32,
        offset: 0,
        shape: rows,
        strides: None,
    };
    let gpu_row = [slab(&gpu_k, &[1, 1, 4]), slab(&gpu_v, &[1, 1, 4])];

    // A parent of 3 rows in pages of 2, the second partly filled; its fork shares both.
    let parent = c.add_sequence().unwrap();
    let shape = [3, 1, 4];
    let slabs = [
        HostSlab::f32(&k[..12], &shape),
        HostSlab::f32(&v[..12], &shape),
    ];
    c.append(parent, 0, &slabs).unwrap();
    c.advance(parent, 3).unwrap();
    let child = c.fork(parent, 3).unwrap();
    let shared = c.ledger().pages(parent).unwrap()[1];
    let mut encoder = g.device.create_command_encoder(&Default::default());
    c.record_append_gpu(&mut encoder, child, 0, &gpu_row)
        .unwrap();
    let copy = c.ledger().pages(child).unwrap()[1];
    assert_ne!(copy, shared, "the append takes a private copy");

    // Before the encoder runs: the parent leaves through a scrub, and a new sequence takes every
    // free page. The shared page is the copy's alone now, and not among them.
    let free = c.free_pages();
    c.remove_and_scrub(parent).unwrap();
    assert_eq!(
        c.ledger().page_refs(shared),
        Some(1),
        "the copy holds its page"
    );
    assert_eq!(c.free_pages(), free, "the parent's pages are held");
    let other = c.add_sequence().unwrap();
    let shape = [6, 1, 4];
    let slabs = [HostSlab::f32(&ok, &shape), HostSlab::f32(&ov, &shape)];
    c.append(other, 0, &slabs).unwrap();
    c.advance(other, 6).unwrap();
    assert_eq!(c.free_pages(), 0);
    assert!(!c.ledger().pages(other).unwrap().contains(&shared));
    g.queue.submit([encoder.finish()]);
    c.advance(child, 1).unwrap();
    assert_eq!(c.read_f32_async(child, 0, 0).await.unwrap(), k);
    assert_eq!(c.read_f32_async(child, 0, 1).await.unwrap(), v);
    assert_eq!(c.read_f32_async(other, 0, 0).await.unwrap(), ok);

    // The encoder's work is done (its rows were read): the next call lets the page go, zeroed.
    let pool_row = |words: &[u32], r: usize| words[r * 4..(r + 1) * 4].to_vec();
    let before = c.read_pool_words_async(0, 0).await.unwrap();
    assert_ne!(
        pool_row(&before, shared as usize * 2),
        [0; 4],
        "the page held rows"
    );
    for _ in 0..100 {
        c.truncate(child, 4).unwrap();
        if c.free_pages() == 1 {
            break;
        }
        // In the browser the encoder's callback comes from the event loop.
        c.read_pool_words_async(0, 0).await.unwrap();
    }
    assert_eq!(c.ledger().page_refs(shared), Some(0), "the page is let go");
    assert_eq!(c.free_pages(), 1);
    for slot in 0..2 {
        let words = c.read_pool_words_async(0, slot).await.unwrap();
        for r in [shared as usize * 2, shared as usize * 2 + 1] {
            assert_eq!(
                pool_row(&words, r),
                [0; 4],
                "slot {slot}: pool row {r} zeroed"
            );
        }
    }

    // Recorded into an encoder that is dropped unsubmitted: the page its copy reads is let go with
    // the encoder (its sequence is removed, as the docs say for a dropped encoder).
    let fork = c.fork(child, 3).unwrap();
    let mut encoder = g.device.create_command_encoder(&Default::default());
    c.record_append_gpu(&mut encoder, fork, 0, &gpu_row)
        .unwrap();
    c.remove(child).unwrap();
    assert_eq!(
        c.ledger().page_refs(copy),
        Some(1),
        "the dropped copy holds its page"
    );
    drop(encoder);
    c.remove(fork).unwrap();
    assert_eq!(c.ledger().page_refs(copy), Some(0));
    assert_eq!(
        c.free_pages(),
        3,
        "other's three pages are the only ones held"
    );

    // A step of a parent and its fork over two layers, recorded into one encoder, in a pool with one
    // free page: admission counts one private copy of the page they share, and the step takes no
    // more. The fork's append copies the page; the parent's rows then go into the page itself, past
    // the rows the copy reads.
    let spec = CacheSpec::new(vec![LayerSpec::kv(1, 4, 4); 2], DType::F32, 16).unwrap();
    let mut c = PagedCache::with_kernels(super::kernels_for(g), spec, 2, 3).unwrap();
    let parent = c.add_sequence().unwrap();
    let shape = [3, 1, 4];
    for layer in 0..2 {
        let slabs = [
            HostSlab::f32(&k[..12], &shape),
            HostSlab::f32(&v[..12], &shape),
        ];
        c.append(parent, layer, &slabs).unwrap();
    }
    c.advance(parent, 3).unwrap();
    let fork = c.fork(parent, 3).unwrap();
    let step = [(fork, 1), (parent, 1)];
    assert_eq!(c.free_pages(), 1);
    c.admits(&step).unwrap();
    // Row 3 of the fork, then of the parent: their own rows, from GPU buffers.
    let (sk, sv) = (&ok[..8], &ov[..8]);
    let step_k = super::f32_buffer(&g.device, sk).await;
    let step_v = super::f32_buffer(&g.device, sv).await;
    let mut encoder = g.device.create_command_encoder(&Default::default());
    for layer in 0..2 {
        c.record_append_gpu_batch(
            &mut encoder,
            layer,
            &step,
            &[slab(&step_k, &[2, 1, 4]), slab(&step_v, &[2, 1, 4])],
        )
        .unwrap();
    }
    c.advance_batch(&step).unwrap();
    assert_eq!(c.free_pages(), 0);
    g.queue.submit([encoder.finish()]);
    for layer in 0..2 {
        for (seq, at) in [(fork, 0), (parent, 4)] {
            let want_k = [&k[..12], &sk[at..at + 4]].concat();
            let want_v = [&v[..12], &sv[at..at + 4]].concat();
            assert_eq!(
                c.read_f32_async(seq, layer, 0).await.unwrap(),
                want_k,
                "layer {layer}"
            );
            assert_eq!(
                c.read_f32_async(seq, layer, 1).await.unwrap(),
                want_v,
                "layer {layer}"
            );
        }
    }
}

/// Encoders recorded over a sequence read and write the pages and the table row they were recorded
/// against, also where the sequence is removed or truncated before they run: the pool keeps what the
/// call takes from the sequence until the encoder's work is done, and no other sequence gets it
/// meanwhile. An attention recorded over a sequence that is then removed (with a scrub or without),
/// while a new sequence takes every free page and a table row for rows of its own, reads the
/// removed sequence's rows; once the encoder is done the pages return (zeroed where the removal
/// scrubbed). One recorded over a sequence truncated to a page boundary and grown again reads the
/// rows it was recorded over, not the new ones (the sequence writes its new entries into a fresh
/// table row). One recorded over a sequence truncated (twice, or within its last page) and then
/// removed reads its rows too, while a fork writes into a page they share (into a private copy,
/// since the encoder reads that row). A GPU append recorded into a sequence removed before the encoder runs leaves the next
/// sequence's rows and table entries alone. An encoder dropped unsubmitted keeps nothing.
pub async fn encoders_keep_what_a_removal_or_truncation_takes(g: &Gpu) {
    let spec = CacheSpec::new(vec![LayerSpec::kv(1, 4, 4)], DType::F32, 16).unwrap();
    let opts = AttentionOptions::default();
    let (k, v) = (values(31, 4 * 4), values(32, 4 * 4));
    let (ok, ov) = (values(33, 8 * 4), values(34, 8 * 4));
    let q = values(35, 2 * 4);
    let qb = super::f32_buffer(&g.device, &q).await;
    // The first `n` rows of (`k`, `v`) appended to `seq` and committed.
    let fill = |c: &mut PagedCache, seq, k: &[f32], v: &[f32], n: usize| {
        let shape = [n, 1, 4];
        let slabs = [
            HostSlab::f32(&k[..n * 4], &shape),
            HostSlab::f32(&v[..n * 4], &shape),
        ];
        c.append(seq, 0, &slabs).unwrap();
        c.advance(seq, n).unwrap();
    };
    // Attention of one query (2 heads) over `seq`, recorded into `encoder`.
    fn record(
        att: &mut Attention,
        c: &PagedCache,
        encoder: &mut wgpu::CommandEncoder,
        seq: SeqId,
        (q, out): (&wgpu::Buffer, &wgpu::Buffer),
    ) {
        let (kv, q) = (Kv::Sequence(c, seq), Queries::new(q, 1, 2, 4));
        att.record_gqa(encoder, kv, 0, q, out, &AttentionOptions::default())
            .unwrap();
    }
    // Calls `reclaim` until `free` pages are free (in the browser the encoder's callback comes
    // from the event loop, which a read lets run).
    let reclaim_to = async |c: &mut PagedCache, free: usize| {
        for _ in 0..100 {
            c.reclaim();
            if c.free_pages() == free {
                break;
            }
            c.read_pool_words_async(0, 0).await.unwrap();
        }
        assert_eq!(c.free_pages(), free, "the encoder's pages returned");
    };
    let pool_rows = async |c: &PagedCache, page: u32| {
        let words = c.read_pool_words_async(0, 0).await.unwrap();
        let at = page as usize * 2 * 4;
        words[at..at + 2 * 4].to_vec()
    };
    let bits = |x: &[f32]| x.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    // Attention over `seq` in a submission of its own, against the twin over `(k, v)`.
    let attend = async |att: &mut Attention,
                        c: &PagedCache,
                        seq,
                        out: &wgpu::Buffer,
                        (k, v): (&[f32], &[f32]),
                        what: &str| {
        let mut encoder = g.device.create_command_encoder(&Default::default());
        record(att, c, &mut encoder, seq, (&qb, out));
        g.queue.submit([encoder.finish()]);
        let want = reference::attention_gqa(&q, [1, 2, 4], k, v, 1, 4, &opts);
        super::assert_close(&super::read_f32(g, out).await, &want, what);
    };
    let want = reference::attention_gqa(&q, [1, 2, 4], &k, &v, 1, 4, &opts);

    for scrub in [false, true] {
        // Pages of 2 rows, 6 of them: `a` takes 2.
        let mut c = PagedCache::with_kernels(super::kernels_for(g), spec.clone(), 2, 6).unwrap();
        let mut att = Attention::with_kernels(super::kernels_for(g));
        let a = c.add_sequence().unwrap();
        fill(&mut c, a, &k, &v, 4);
        let pages_a = c.ledger().pages(a).unwrap().to_vec();
        let out = super::output(&g.device, 8).await;
        let mut encoder = g.device.create_command_encoder(&Default::default());
        record(&mut att, &c, &mut encoder, a, (&qb, &out));
        match scrub {
            true => c.remove_and_scrub(a).unwrap(),
            false => c.remove(a).unwrap(),
        }
        assert_eq!(c.free_pages(), 4, "scrub {scrub}: a's pages are kept");
        let b = c.add_sequence().unwrap();
        fill(&mut c, b, &ok, &ov, 8);
        assert_eq!(c.free_pages(), 0);
        g.queue.submit([encoder.finish()]);
        let what = format!("attention over a sequence removed before it ran, scrub {scrub}");
        super::assert_close(&super::read_f32(g, &out).await, &want, &what);
        reclaim_to(&mut c, 2).await;
        for (i, &page) in pages_a.iter().enumerate() {
            let rows = match scrub {
                true => vec![0; 8],
                false => bits(&k[i * 8..(i + 1) * 8]),
            };
            assert_eq!(
                pool_rows(&c, page).await,
                rows,
                "scrub {scrub}: page {page}"
            );
        }
        assert_eq!(c.read_f32_async(b, 0, 0).await.unwrap(), ok);

        // Truncated to its first page and grown again by 2 rows, with every other page taken.
        let a = c.add_sequence().unwrap();
        fill(&mut c, a, &k, &v, 4);
        assert_eq!(c.free_pages(), 0);
        c.truncate(b, 6).unwrap();
        let mut encoder = g.device.create_command_encoder(&Default::default());
        record(&mut att, &c, &mut encoder, a, (&qb, &out));
        let second = c.ledger().pages(a).unwrap()[1];
        match scrub {
            true => c.truncate_and_scrub(a, 2).unwrap(),
            false => c.truncate(a, 2).unwrap(),
        }
        assert_eq!(c.free_pages(), 1, "scrub {scrub}: a's second page is kept");
        fill(&mut c, a, &ok, &ov, 2);
        assert_ne!(c.ledger().pages(a).unwrap()[1], second);
        g.queue.submit([encoder.finish()]);
        let what = format!("attention over a sequence truncated before it ran, scrub {scrub}");
        super::assert_close(&super::read_f32(g, &out).await, &want, &what);
        reclaim_to(&mut c, 1).await;
        let rows = match scrub {
            true => vec![0; 8],
            false => bits(&k[8..16]),
        };
        assert_eq!(
            pool_rows(&c, second).await,
            rows,
            "scrub {scrub}: a's second page"
        );
        let grown = [&k[..8], &ok[..8]].concat();
        assert_eq!(c.read_f32_async(a, 0, 0).await.unwrap(), grown);
        // Attention over the grown sequence reads its new table row.
        let va = [&v[..8], &ov[..8]].concat();
        attend(&mut att, &c, a, &out, (&grown, &va), "the grown sequence").await;

        // Recorded, then dropped unsubmitted: a removal keeps nothing.
        let mut encoder = g.device.create_command_encoder(&Default::default());
        record(&mut att, &c, &mut encoder, a, (&qb, &out));
        drop(encoder);
        c.remove(a).unwrap();
        assert_eq!(
            c.free_pages(),
            3,
            "scrub {scrub}: nothing kept for a dropped encoder"
        );
    }

    // Truncated (twice: the second call through a fresh table row; or within its last page), then
    // removed, before the encoder runs: the encoder reads the rows it was recorded against. A fork
    // made before sharing a page then writes into a row of it that the encoder reads (through a
    // private copy), and a new sequence takes every free page.
    for scrub in [false, true] {
        for (lens, at) in [(&[2, 0][..], 1), (&[1, 0], 1), (&[3], 3)] {
            let mut c =
                PagedCache::with_kernels(super::kernels_for(g), spec.clone(), 2, 6).unwrap();
            let mut att = Attention::with_kernels(super::kernels_for(g));
            let a = c.add_sequence().unwrap();
            fill(&mut c, a, &k, &v, 4);
            let out = super::output(&g.device, 8).await;
            let mut encoder = g.device.create_command_encoder(&Default::default());
            record(&mut att, &c, &mut encoder, a, (&qb, &out));
            let fork = c.fork(a, at).unwrap();
            for &new_len in lens {
                match scrub {
                    true => c.truncate_and_scrub(a, new_len).unwrap(),
                    false => c.truncate(a, new_len).unwrap(),
                }
            }
            match scrub {
                true => c.remove_and_scrub(a).unwrap(),
                false => c.remove(a).unwrap(),
            }
            let what = format!("scrub {scrub}, truncated to {lens:?}, a fork of {at} rows");
            assert_eq!(c.free_pages(), 4, "{what}: a's pages are kept");
            fill(&mut c, fork, &ok[4..], &ov[4..], 1);
            let b = c.add_sequence().unwrap();
            fill(&mut c, b, &ok, &ov, 6);
            assert_eq!(c.free_pages(), 0, "{what}: the fork's row went into a copy");
            g.queue.submit([encoder.finish()]);
            super::assert_close(&super::read_f32(g, &out).await, &want, &what);
            let fork_pages = c.ledger().pages(fork).unwrap().len();
            reclaim_to(&mut c, 6 - 3 - fork_pages).await;
            let fork_k = [&k[..4 * at], &ok[4..8]].concat();
            assert_eq!(c.read_f32_async(fork, 0, 0).await.unwrap(), fork_k);
        }
    }

    // A GPU append recorded into `a` (its third row, on a page of its own), then `a` removed and a
    // new sequence given every free page before the encoder runs: the append's row and table entry
    // go where they were recorded, not into the new sequence's.
    let mut c = PagedCache::with_kernels(super::kernels_for(g), spec, 2, 6).unwrap();
    let mut att = Attention::with_kernels(super::kernels_for(g));
    let a = c.add_sequence().unwrap();
    fill(&mut c, a, &k, &v, 2);
    let row = [
        super::f32_buffer(&g.device, &k[8..12]).await,
        super::f32_buffer(&g.device, &v[8..12]).await,
    ];
    let slabs = row
        .each_ref()
        .map(|buffer| GpuSlab::contiguous(buffer, DType::F32, &[1, 1, 4]));
    let mut encoder = g.device.create_command_encoder(&Default::default());
    c.record_append_gpu(&mut encoder, a, 0, &slabs).unwrap();
    c.advance(a, 1).unwrap();
    c.remove(a).unwrap();
    assert_eq!(c.free_pages(), 4, "a's pages are kept for the append");
    let b = c.add_sequence().unwrap();
    fill(&mut c, b, &ok, &ov, 8);
    g.queue.submit([encoder.finish()]);
    assert_eq!(c.read_f32_async(b, 0, 0).await.unwrap(), ok);
    assert_eq!(c.read_f32_async(b, 0, 1).await.unwrap(), ov);
    let out = super::output(&g.device, 8).await;
    attend(&mut att, &c, b, &out, (&ok, &ov), "the next sequence").await;
    reclaim_to(&mut c, 2).await;
}

/// A recorded step of a parent and its fork that write from different rows of the page they share:
/// the first writer's copy pins the page with the rows it read, so the fork's rows in the next
/// layer, below them, go into a copy of their own. Admission counts a copy for each writer: with
/// one free page the step is refused before anything is written, with two it lands whole.
pub async fn a_recorded_step_of_writers_from_different_rows_is_admitted_whole(g: &Gpu) {
    let spec = CacheSpec::new(vec![LayerSpec::kv(1, 4, 4); 2], DType::F32, 16).unwrap();
    let (k, v) = (values(41, 3 * 4), values(42, 3 * 4));
    let (sk, sv) = (values(43, 2 * 4), values(44, 2 * 4));
    let step_k = super::f32_buffer(&g.device, &sk).await;
    let step_v = super::f32_buffer(&g.device, &sv).await;
    let slabs = [
        GpuSlab::contiguous(&step_k, DType::F32, &[2, 1, 4]),
        GpuSlab::contiguous(&step_v, DType::F32, &[2, 1, 4]),
    ];
    for n_pages in [2, 3] {
        // A parent of 3 rows in one page of 4; its fork shares the page at 2 rows.
        let mut c =
            PagedCache::with_kernels(super::kernels_for(g), spec.clone(), 4, n_pages).unwrap();
        let parent = c.add_sequence().unwrap();
        for layer in 0..2 {
            let shape = [3, 1, 4];
            let host = [HostSlab::f32(&k, &shape), HostSlab::f32(&v, &shape)];
            c.append(parent, layer, &host).unwrap();
        }
        c.advance(parent, 3).unwrap();
        let fork = c.fork(parent, 2).unwrap();
        let step = [(parent, 1), (fork, 1)];
        if n_pages == 2 {
            let needed = Error::OutOfPages { needed: 2, free: 1 };
            assert_eq!(c.admits(&step).unwrap_err(), needed);
            continue;
        }
        c.admits(&step).unwrap();
        let mut encoder = g.device.create_command_encoder(&Default::default());
        for layer in 0..2 {
            c.record_append_gpu_batch(&mut encoder, layer, &step, &slabs)
                .unwrap_or_else(|e| panic!("layer {layer} of an admitted step: {e}"));
        }
        c.advance_batch(&step).unwrap();
        g.queue.submit([encoder.finish()]);
        for layer in 0..2 {
            for (seq, n, at) in [(parent, 3, 0), (fork, 2, 4)] {
                let want_k = [&k[..n * 4], &sk[at..at + 4]].concat();
                let want_v = [&v[..n * 4], &sv[at..at + 4]].concat();
                assert_eq!(c.read_f32_async(seq, layer, 0).await.unwrap(), want_k);
                assert_eq!(c.read_f32_async(seq, layer, 1).await.unwrap(), want_v);
            }
        }
    }
}
