//! Plain-Rust twins of the kernels and of the whole cache, used as the reference in tests and tools.
//! Conversions use `half` (round to nearest, ties to even), which the WGSL kernels match bit for bit.
//!
//! Every function here takes any input without panicking: shapes that disagree with their slices give
//! an empty result, elements outside a source read as 0, and writes outside a slot are dropped, as each
//! function's doc says. Sizes that overflow `usize` or cannot be allocated also give an empty result
//! (the conversions of host data, whose results are no larger than their input, allocate as usual).

use crate::codec::{DType, with_room, zeros};
pub use crate::codec::{
    bits_to_f32, convert_bits, decode_rows, decode_scaled_rows, f32_to_bits, host_bits,
    inverse_scale, pack_rows, prescaled, round_trip, round_trip_rows, scaled_host_bits,
    unpack_rows,
};

/// The product of `dims`, or `None` when it overflows `usize`.
fn product(dims: &[usize]) -> Option<usize> {
    dims.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d))
}

/// Whether a slice of `len` elements holds the tensor `dims`.
fn holds(len: usize, dims: &[usize]) -> bool {
    product(dims).is_some_and(|n| n <= len)
}

/// A xorshift generator of indices, for reproducible pseudo-random operation sequences in tests.
#[derive(Clone, Debug)]
pub struct Xorshift(u64);

impl Xorshift {
    /// A generator seeded with `seed`; the same seed gives the same values.
    pub fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    /// The next value in `[0, n)` (0 when `n` is 0).
    pub fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n.max(1) as u64) as usize
    }
}

/// Deterministic pseudo-random values in `[-amplitude, amplitude)`, different per seed (xorshift64): test
/// and demo data that the CPU twins and the GPU see alike. An `n` too large to allocate gives an empty
/// `Vec`; a non-finite `amplitude` gives non-finite values.
pub fn pseudo_random(seed: u64, n: usize, amplitude: f32) -> Vec<f32> {
    let Some(mut out) = with_room(Some(n)) else {
        return Vec::new();
    };
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    out.extend((0..n).map(|_| {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 * amplitude - amplitude
    }));
    out
}

/// Element bits of a strided source read the way the slab-write kernel reads it: element
/// `(r, i1, i2, ...)` of `shape` is source element `offset + r·strides[0] + Σ i_k·strides[k]`.
/// `src` holds element bits one per entry.
///
/// An element whose index lies past the end of `src` (or overflows `usize`) reads as 0. When
/// `strides` has another length than `shape`, or the element count overflows or cannot be
/// allocated, the result is empty (the GPU refuses such a source and writes nothing).
pub fn gather_strided(src: &[u32], offset: usize, shape: &[usize], strides: &[usize]) -> Vec<u32> {
    if strides.len() != shape.len() {
        return Vec::new();
    }
    let total = product(shape);
    let Some(mut out) = with_room(total) else {
        return Vec::new();
    };
    out.extend((0..total.unwrap_or(0)).map(|flat| {
        let (mut rem, mut idx) = (flat, Some(offset));
        // Every extent is non-zero here: a zero extent makes `total` 0.
        for (&n, &stride) in shape.iter().zip(strides).rev() {
            let i = rem % n;
            rem /= n;
            idx = idx.and_then(|x| x.checked_add(i.checked_mul(stride)?));
        }
        idx.and_then(|i| src.get(i)).copied().unwrap_or(0)
    }));
    out
}

/// Twin of `shaders/slab_write.wgsl`: the stored words of a strided source converted to `storage`.
/// Reads like [`gather_strided`] (outside `src` reads as 0; a rank mismatch or an overflowing shape
/// gives an empty result); rank 0 is one element.
pub fn slab_write(
    src_bits: &[u32],
    src_dtype: DType,
    offset: usize,
    shape: &[usize],
    strides: &[usize],
    storage: DType,
) -> Vec<u32> {
    let Some(row_elems) = product(shape.get(1..).unwrap_or(&[])) else {
        return Vec::new();
    };
    let mut bits = gather_strided(src_bits, offset, shape, strides);
    bits.iter_mut()
        .for_each(|b| *b = convert_bits(*b, src_dtype, storage));
    pack_rows(&bits, storage, row_elems)
}

/// Twin of `shaders/zero.wgsl` and `zero_int64.wgsl`: zeroes words `[start, start + n)`, the part inside `words`.
pub fn zero(words: &mut [u32], start: usize, n: usize) {
    let end = start.saturating_add(n).min(words.len());
    words[start.min(end)..end].fill(0);
}

/// A plain-Rust model of a whole cache: the stored words of every slot buffer at full capacity.
///
/// The fields are public, so they may disagree with each other; every method then acts only on the
/// layers and slots present in both `row_elems` and `words`, and on the words a slot has.
#[derive(Clone, Debug, PartialEq)]
pub struct CpuCache {
    /// Storage type, per layer and slot.
    pub dtypes: Vec<Vec<DType>>,
    /// Scale of a scaled fp8 slot's values, per layer and slot ([`crate::SlotSpec::scale`]).
    pub scales: Vec<Vec<Option<f32>>>,
    /// Elements per row, per layer and slot.
    pub row_elems: Vec<Vec<usize>>,
    /// Every word of every slot buffer, per layer and slot.
    pub words: Vec<Vec<Vec<u32>>>,
}

impl CpuCache {
    /// A zeroed model of `spec` at full capacity. A slot whose words overflow `usize` or cannot be
    /// allocated gets none (an empty `Vec`): writes to it are dropped and reads of it return nothing.
    pub fn new(spec: &crate::spec::CacheSpec) -> Self {
        let row_elems: Vec<Vec<usize>> = spec
            .layers()
            .iter()
            .map(|l| l.slots.iter().map(|s| s.row_elems()).collect())
            .collect();
        let dtypes: Vec<Vec<DType>> = spec
            .layers()
            .iter()
            .map(|l| l.slots.iter().map(|s| spec.dtype_of(s)).collect())
            .collect();
        let words = row_elems
            .iter()
            .zip(&dtypes)
            .map(|(l, types)| {
                l.iter()
                    .zip(types)
                    .map(|(&e, &dtype)| {
                        let n = Self::row_words_of(e, dtype)
                            .and_then(|w| w.checked_mul(spec.max_seq_len()));
                        zeros(n)
                    })
                    .collect()
            })
            .collect();
        let scales = spec
            .layers()
            .iter()
            .map(|l| l.slots.iter().map(|s| s.scale).collect())
            .collect();
        Self {
            dtypes,
            scales,
            row_elems,
            words,
        }
    }

    /// Stored words of a row of `row_elems` elements (padded to a word), unless that overflows.
    fn row_words_of(row_elems: usize, dtype: DType) -> Option<usize> {
        dtype
            .row_bytes(row_elems.checked_next_multiple_of(dtype.block().unwrap_or(1))?)
            .and_then(|bytes| usize::try_from(bytes / 4).ok())
    }

    /// Elements per row, stored words per row and storage type of a slot, when `row_elems` and
    /// `dtypes` have it.
    fn row_of(&self, layer: usize, slot: usize) -> Option<(usize, usize, DType)> {
        let e = *self.row_elems.get(layer)?.get(slot)?;
        let dtype = self.dtype(layer, slot)?;
        Some((e, Self::row_words_of(e, dtype)?, dtype))
    }

    /// The storage type of a slot, when `dtypes` has it.
    pub fn dtype(&self, layer: usize, slot: usize) -> Option<DType> {
        self.dtypes.get(layer)?.get(slot).copied()
    }

    /// Stored words per row of a slot; 0 when the layer or slot does not exist or its row size
    /// overflows `usize`.
    pub fn row_words(&self, layer: usize, slot: usize) -> usize {
        self.row_of(layer, slot).map_or(0, |(_, w, _)| w)
    }

    /// Writes element bits (already in the storage type) as rows starting at `row`. Only whole rows of
    /// `bits` are written (a trailing partial row is ignored), and words past the end of the slot are
    /// dropped; a layer or slot that does not exist is left alone.
    pub fn write_rows(&mut self, layer: usize, slot: usize, row: usize, bits: &[u32]) {
        let Some((re, rw, dtype)) = self.row_of(layer, slot) else {
            return;
        };
        let Some(words) = self.words.get_mut(layer).and_then(|l| l.get_mut(slot)) else {
            return;
        };
        let Some(dst) = row.checked_mul(rw).and_then(|at| words.get_mut(at..)) else {
            return;
        };
        let whole = bits.len().checked_div(re).unwrap_or(0) * re;
        let packed = pack_rows(&bits[..whole], dtype, re);
        let n = packed.len().min(dst.len());
        dst[..n].copy_from_slice(&packed[..n]);
    }

    /// Zeroes rows `[start, end)` of every slot of `layer`: the rows the slots have (none when
    /// `end <= start` or the layer does not exist).
    pub fn zero_rows(&mut self, layer: usize, start: usize, end: usize) {
        let row_words: Vec<usize> = (0..self.words.get(layer).map_or(0, Vec::len))
            .map(|slot| self.row_of(layer, slot).map_or(0, |(_, w, _)| w))
            .collect();
        let Some(slots) = self.words.get_mut(layer) else {
            return;
        };
        for (words, rw) in slots.iter_mut().zip(row_words) {
            let n = end.saturating_sub(start).saturating_mul(rw);
            zero(words, start.saturating_mul(rw), n);
        }
    }

    /// Zeroes everything.
    pub fn zero_all(&mut self) {
        self.words.iter_mut().flatten().for_each(|w| w.fill(0));
    }

    /// The first `rows` rows of a slot as f32 (times its scale, when `scales` gives one): at most the
    /// whole rows the slot has (so fewer values when `rows` passes its capacity); empty when the
    /// layer or slot does not exist.
    pub fn read_f32(&self, layer: usize, slot: usize, rows: usize) -> Vec<f32> {
        let Some((re, rw, dtype)) = self.row_of(layer, slot) else {
            return Vec::new();
        };
        let Some(words) = self.words.get(layer).and_then(|l| l.get(slot)) else {
            return Vec::new();
        };
        let have = words.len().checked_div(rw).unwrap_or(0);
        let w = &words[..rows.min(have) * rw];
        let scale = self.scales.get(layer).and_then(|l| l.get(slot)).copied();
        decode_scaled_rows(w, dtype, re, scale.flatten())
    }
}

/// Twin of attention: for each query `qi` and head `h`, softmax over the rows the query sees of
/// `scale · score(qi, h, row)` (soft-capped if asked), times `value(h, row, d)`. Accumulates in f64.
/// The caller has checked `1 <= n_q <= visible` (or `n_q == 0`) and that every index the closures
/// take is inside their slices; an output too large to allocate gives an empty `Vec`.
fn attend(
    [n_q, n_heads, d_v]: [usize; 3],
    visible: usize,
    scale: f32,
    options: &crate::attention::AttentionOptions,
    score: impl Fn(usize, usize, usize) -> f64,
    value: impl Fn(usize, usize, usize) -> f64,
) -> Vec<f32> {
    let mut out: Vec<f32> = zeros(product(&[n_q, n_heads, d_v]));
    if out.is_empty() {
        return out;
    }
    let (Some(mut weights), Some(mut acc)) =
        (with_room(Some(visible)), with_room::<f64>(Some(d_v)))
    else {
        return Vec::new();
    };
    for qi in 0..n_q {
        let last = visible - n_q + qi;
        let first = options.window.map_or(0, |w| (last + 1).saturating_sub(w));
        for h in 0..n_heads {
            weights.clear();
            weights.extend((first..=last).map(|row| {
                let s = score(qi, h, row) * scale as f64;
                match options.soft_cap {
                    Some(cap) => cap as f64 * (s / cap as f64).tanh(),
                    None => s,
                }
            }));
            let max = weights.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            weights.iter_mut().for_each(|w| *w = (*w - max).exp());
            let sum: f64 = weights.iter().sum();
            // Row by row (each output dim still sums its rows in order), so the rows are read once.
            acc.clear();
            acc.resize(d_v, 0.0);
            for (row, w) in (first..=last).zip(&weights) {
                for (d, a) in acc.iter_mut().enumerate() {
                    *a += w * value(h, row, d);
                }
            }
            let o = &mut out[(qi * n_heads + h) * d_v..][..d_v];
            for (o, a) in o.iter_mut().zip(&acc) {
                *o = (a / sum) as f32;
            }
        }
    }
    out
}

/// Twin of GQA / MHA attention: `q [n_q, n_heads, d_k]` (`q_shape`), `k [visible, n_kv_heads, d_k]`
/// and `v [visible, n_kv_heads, d_v]` as stored (read back, or rounded with [`round_trip`]); returns
/// `[n_q, n_heads, d_v]`. The queries are the last `n_q` of the `visible` rows (the whole rows of `k`).
///
/// Returns an empty `Vec` when the shapes disagree: `n_kv_heads` or `d_k` of 0, `n_heads` not a
/// multiple of `n_kv_heads`, more queries than visible rows, `q` or `v` too short for their shapes,
/// or a size that overflows. The options are applied as given, without the checks
/// [`crate::Attention`] makes: a window of 0 sees no row and gives NaN, as does a NaN scale or cap.
pub fn attention_gqa(
    q: &[f32],
    q_shape: [usize; 3],
    k: &[f32],
    v: &[f32],
    n_kv_heads: usize,
    d_v: usize,
    options: &crate::attention::AttentionOptions,
) -> Vec<f32> {
    let [n_q, n_heads, d_k] = q_shape;
    let Some(visible) = n_kv_heads
        .checked_mul(d_k)
        .and_then(|row| k.len().checked_div(row))
    else {
        return Vec::new();
    };
    if n_q > visible
        || !n_heads.is_multiple_of(n_kv_heads)
        || !holds(q.len(), &q_shape)
        || !holds(v.len(), &[visible, n_kv_heads, d_v])
    {
        return Vec::new();
    }
    let group = n_heads / n_kv_heads;
    let scale = options.scale.unwrap_or(1.0 / (d_k as f32).sqrt());
    attend(
        [n_q, n_heads, d_v],
        visible,
        scale,
        options,
        |qi, h, row| {
            let qv = &q[(qi * n_heads + h) * d_k..][..d_k];
            let kv = &k[(row * n_kv_heads + h / group) * d_k..][..d_k];
            qv.iter().zip(kv).map(|(&a, &b)| a as f64 * b as f64).sum()
        },
        |h, row, d| v[(row * n_kv_heads + h / group) * d_v + d] as f64,
    )
}

/// Twin of MLA absorbed attention: `q_latent [n_q, n_heads, r]` (`q_shape`), `q_rope [n_q, n_heads,
/// rope_dim]`, `c_kv [visible, r]` and `k_pe [visible, rope_dim]` as stored; returns `[n_q, n_heads, r]`.
/// `visible` is the whole rows of `c_kv`. The default scale is `1/sqrt(r + rope_dim)`.
///
/// Returns an empty `Vec` when the shapes disagree: `r` of 0, more queries than visible rows, a slice
/// too short for its shape, or a size that overflows. Options are applied as in [`attention_gqa`].
pub fn attention_mla(
    q_latent: &[f32],
    q_rope: &[f32],
    q_shape: [usize; 3],
    c_kv: &[f32],
    k_pe: &[f32],
    rope_dim: usize,
    options: &crate::attention::AttentionOptions,
) -> Vec<f32> {
    let [n_q, n_heads, r] = q_shape;
    let p = rope_dim;
    let Some(visible) = c_kv.len().checked_div(r) else {
        return Vec::new();
    };
    if n_q > visible
        || !holds(q_latent.len(), &q_shape)
        || !holds(q_rope.len(), &[n_q, n_heads, p])
        || !holds(k_pe.len(), &[visible, p])
    {
        return Vec::new();
    }
    let scale = options
        .scale
        .unwrap_or(1.0 / (r.saturating_add(p) as f32).sqrt());
    attend(
        [n_q, n_heads, r],
        visible,
        scale,
        options,
        |qi, h, row| {
            let ql = &q_latent[(qi * n_heads + h) * r..][..r];
            let qr = &q_rope[(qi * n_heads + h) * p..][..p];
            let lat: f64 = ql
                .iter()
                .zip(&c_kv[row * r..][..r])
                .map(|(&a, &b)| a as f64 * b as f64)
                .sum();
            let rope: f64 = qr
                .iter()
                .zip(&k_pe[row * p..][..p])
                .map(|(&a, &b)| a as f64 * b as f64)
                .sum();
            lat + rope
        },
        |_, row, d| c_kv[row * r + d] as f64,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attention::AttentionOptions;
    use crate::spec::{CacheSpec, LayerSpec, SlotSpec};

    #[test]
    fn pack_and_unpack_odd_rows() {
        let bits = [1, 2, 3, 4, 5, 6];
        let packed = pack_rows(&bits, DType::F16, 3);
        assert_eq!(packed, vec![1 | 2 << 16, 3, 4 | 5 << 16, 6]);
        assert_eq!(unpack_rows(&packed, DType::F16, 3), bits);
    }

    #[test]
    fn strided_gather_takes_k_out_of_fused_qkv() {
        // 2 tokens of [q(4) | k(2) | v(2)]: K is offset 4, seq stride 8.
        let src: Vec<u32> = (0..16).collect();
        assert_eq!(
            gather_strided(&src, 4, &[2, 2], &[8, 1]),
            vec![4, 5, 12, 13]
        );
    }

    const BIG: usize = usize::MAX;

    /// `q, q_shape, k, v, n_kv_heads, d_v` of [`attention_gqa`].
    type GqaArgs<'a> = (&'a [f32], [usize; 3], &'a [f32], &'a [f32], usize, usize);
    /// `q_latent, q_rope, q_shape, c_kv, k_pe, rope_dim` of [`attention_mla`].
    type MlaArgs<'a> = (
        &'a [f32],
        &'a [f32],
        [usize; 3],
        &'a [f32],
        &'a [f32],
        usize,
    );

    #[test]
    fn gather_reads_outside_the_source_as_zero_and_refuses_inconsistent_shapes() {
        let src: Vec<u32> = (1..=8).collect();
        // Rank 0 is one element; an offset past the end reads 0.
        assert_eq!(gather_strided(&src, 2, &[], &[]), vec![3]);
        assert_eq!(gather_strided(&src, 8, &[], &[]), vec![0]);
        assert_eq!(gather_strided(&src, BIG, &[2], &[1]), vec![0, 0]);
        // Rows reaching past the end: the part inside is read, the rest is 0.
        assert_eq!(gather_strided(&src, 5, &[2, 2], &[2, 1]), vec![6, 7, 8, 0]);
        // Index arithmetic that overflows usize reads 0 (element 0 of the row is still `offset`).
        assert_eq!(gather_strided(&src, 1, &[1, 3], &[1, BIG]), vec![2, 0, 0]);
        assert_eq!(gather_strided(&src, 0, &[2, 1], &[BIG, 1]), vec![1, 0]);
        // Rank mismatch, overflowing or unallocatable counts: nothing.
        assert_eq!(gather_strided(&src, 0, &[2, 2], &[1]), Vec::<u32>::new());
        assert_eq!(gather_strided(&src, 0, &[2], &[1, 1]), Vec::<u32>::new());
        assert_eq!(
            gather_strided(&src, 0, &[BIG, 2], &[1, 1]),
            Vec::<u32>::new()
        );
        assert_eq!(gather_strided(&src, 0, &[BIG], &[1]), Vec::<u32>::new());
        assert_eq!(
            gather_strided(&src, 0, &[0, BIG], &[1, 1]),
            Vec::<u32>::new()
        );
        assert_eq!(gather_strided(&[], 0, &[3], &[1]), vec![0, 0, 0]);
    }

    #[test]
    fn slab_write_of_hostile_shapes_is_empty_or_zero_filled() {
        let src: Vec<u32> = (0..6).map(|i| f32_to_bits(i as f32, DType::F32)).collect();
        for storage in DType::ALL {
            let one = f32_to_bits(1.0, storage);
            // One row of 3 from element 1 with the last element outside the source.
            let got = slab_write(&src, DType::F32, 4, &[1, 3], &[3, 1], storage);
            let want = pack_rows(
                &[f32_to_bits(4.0, storage), f32_to_bits(5.0, storage), 0],
                storage,
                3,
            );
            assert_eq!(got, want, "{storage}");
            assert_eq!(
                slab_write(&src, DType::F32, 1, &[], &[], storage),
                vec![one]
            );
            for (shape, strides) in [
                (&[2usize, 3][..], &[3usize][..]),
                (&[BIG, 2], &[2, 1]),
                (&[2, BIG, 2], &[1, 1, 1]),
                (&[0, 3], &[3, 1]),
                (&[3, 0], &[1, 1]),
            ] {
                let got = slab_write(&src, DType::F32, 0, shape, strides, storage);
                assert!(got.is_empty(), "{storage} {shape:?} {strides:?}: {got:?}");
            }
            // Huge offsets and strides read zeros rather than panic.
            let got = slab_write(&src, DType::F16, BIG, &[2, 3], &[BIG, BIG], storage);
            assert_eq!(got, pack_rows(&[0; 6], storage, 3), "{storage}");
        }
    }

    #[test]
    fn zero_clears_only_the_words_inside() {
        let mut w = vec![7u32; 6];
        zero(&mut w, 4, BIG);
        assert_eq!(w, [7, 7, 7, 7, 0, 0]);
        zero(&mut w, BIG, BIG);
        zero(&mut w, 9, 1);
        zero(&mut w, 1, 0);
        assert_eq!(w, [7, 7, 7, 7, 0, 0]);
        zero(&mut [], 0, 3);
    }

    fn model(dtype: DType, capacity: usize) -> CpuCache {
        let spec = CacheSpec::new(
            vec![
                LayerSpec::new(vec![SlotSpec::new("x", &[3])]),
                LayerSpec::empty(),
            ],
            dtype,
            capacity,
        )
        .unwrap();
        CpuCache::new(&spec)
    }

    #[test]
    fn the_cache_model_drops_writes_outside_its_slots() {
        for dtype in DType::ALL {
            let mut m = model(dtype, 2);
            let rw = m.row_words(0, 0);
            assert_eq!(rw, if dtype == DType::F32 { 3 } else { 2 });
            for (layer, slot) in [(0, 1), (1, 0), (BIG, 0), (0, BIG)] {
                assert_eq!(m.row_words(layer, slot), 0);
                m.write_rows(layer, slot, 0, &[1, 2, 3]);
                m.zero_rows(layer, 0, BIG);
                assert_eq!(m.read_f32(layer, slot, 1), Vec::<f32>::new());
            }
            // Row 1 is the last one: of two rows written there, only the first lands.
            let bits: Vec<u32> = (1..=6).map(|x| f32_to_bits(x as f32, dtype)).collect();
            m.write_rows(0, 0, 1, &bits);
            m.write_rows(0, 0, 2, &bits);
            m.write_rows(0, 0, BIG, &bits);
            // A partial row is not written.
            m.write_rows(0, 0, 0, &bits[..2]);
            assert_eq!(m.read_f32(0, 0, BIG), vec![0.0, 0.0, 0.0, 1.0, 2.0, 3.0]);
            assert_eq!(m.read_f32(0, 0, 1), vec![0.0; 3]);
            m.zero_rows(0, 2, 1);
            m.zero_rows(0, BIG, BIG);
            assert_eq!(m.read_f32(0, 0, 2)[3..], [1.0, 2.0, 3.0]);
            m.zero_rows(0, 1, BIG);
            assert_eq!(m.read_f32(0, 0, 2), vec![0.0; 6]);
        }
    }

    #[test]
    fn a_model_whose_public_fields_disagree_does_not_panic() {
        for dtype in DType::ALL {
            let mut m = model(dtype, 2);
            m.row_elems[0][0] = BIG;
            assert_eq!(m.row_words(0, 0), 0);
            m.write_rows(0, 0, 0, &[1; 8]);
            m.zero_rows(0, 0, 2);
            assert_eq!(m.read_f32(0, 0, 2), Vec::<f32>::new());
            m.row_elems[0][0] = 0;
            m.write_rows(0, 0, 0, &[1; 8]);
            assert_eq!(m.read_f32(0, 0, 2), Vec::<f32>::new());
            // Rows of 5 elements over words made for rows of 3: whole rows of the words only.
            m.row_elems[0][0] = 5;
            m.write_rows(0, 0, 0, &[f32_to_bits(2.0, dtype); 10]);
            assert_eq!(m.read_f32(0, 0, 9), vec![2.0; 5]);
            m.words[0].clear();
            m.write_rows(0, 0, 0, &[1; 5]);
            m.zero_rows(0, 0, 2);
            assert_eq!(m.read_f32(0, 0, 1), Vec::<f32>::new());
            m.words.clear();
            m.zero_rows(0, 0, 2);
            m.zero_all();
        }
    }

    #[test]
    fn sizes_too_large_to_allocate_give_empty_results() {
        assert!(pseudo_random(1, BIG, 1.0).is_empty());
        assert!(pseudo_random(1, BIG / 4, 1.0).is_empty());
        assert_eq!(pseudo_random(1, 3, 1.0).len(), 3);
        assert!(pseudo_random(1, 3, f32::NAN).iter().all(|x| x.is_nan()));
    }

    #[test]
    #[cfg(target_pointer_width = "64")]
    fn a_model_too_large_to_allocate_has_no_words() {
        // 2^58 rows of two one-f32 slots: a valid spec (2^61 bytes), far beyond any address space.
        let spec = CacheSpec::new(vec![LayerSpec::kv(1, 1, 1)], DType::F32, 1 << 58).unwrap();
        let mut m = CpuCache::new(&spec);
        assert_eq!(m.words[0].len(), 2);
        assert!(m.words[0].iter().all(Vec::is_empty));
        assert_eq!(m.row_words(0, 0), 1);
        m.write_rows(0, 0, 5, &[1]);
        m.zero_rows(0, 0, BIG);
        assert_eq!(m.read_f32(0, 0, 6), Vec::<f32>::new());
    }

    #[test]
    fn attention_twins_return_nothing_for_inconsistent_shapes() {
        let o = AttentionOptions::default();
        let x = pseudo_random(3, 64, 1.0);
        // Valid: 2 queries of 2 heads x 2 over 4 rows of 1 KV head.
        let (q, k, v) = (&x[..8], &x[8..16], &x[16..28]);
        let good = attention_gqa(q, [2, 2, 2], k, v, 1, 3, &o);
        assert_eq!(good.len(), 12);
        assert!(good.iter().all(|y| y.is_finite()));
        let cases: [GqaArgs; 11] = [
            (q, [2, 2, 2], k, v, 0, 3),        // no KV heads
            (q, [2, 2, 0], k, v, 1, 3),        // d_k 0
            (q, [2, 3, 2], k, v, 2, 3),        // 3 heads over 2 KV heads
            (q, [2, 1, 2], k, v, 2, 3),        // fewer heads than KV heads
            (q, [5, 1, 2], k, v, 1, 3),        // 5 queries, 4 rows
            (&q[..7], [2, 2, 2], k, v, 1, 3),  // q short
            (q, [2, 2, 2], k, &v[..11], 1, 3), // v short
            (q, [BIG, 2, 2], k, v, 1, 3),
            (q, [2, BIG, 2], k, v, 1, 3),
            (q, [2, 2, 2], k, v, 1, BIG),
            (q, [2, 2, BIG], k, v, BIG, 3),
        ];
        for (i, (q, shape, k, v, n_kv, d_v)) in cases.into_iter().enumerate() {
            assert!(
                attention_gqa(q, shape, k, v, n_kv, d_v, &o).is_empty(),
                "case {i}"
            );
        }
        assert!(attention_gqa(q, [0, 2, 2], k, v, 1, 3, &o).is_empty());
        // Options the GPU refuses are computed as given: NaN, never a panic.
        for o in [
            AttentionOptions {
                window: Some(0),
                ..o
            },
            AttentionOptions {
                scale: Some(f32::NAN),
                ..o
            },
            AttentionOptions {
                soft_cap: Some(f32::NAN),
                ..o
            },
        ] {
            let y = attention_gqa(q, [2, 2, 2], k, v, 1, 3, &o);
            assert!(
                y.len() == 12 && y.iter().all(|y| y.is_nan()),
                "{o:?}: {y:?}"
            );
        }
        for o in [
            AttentionOptions {
                window: Some(BIG),
                ..o
            },
            AttentionOptions {
                scale: Some(0.0),
                ..o
            },
            AttentionOptions {
                soft_cap: Some(-1.0),
                ..o
            },
            AttentionOptions {
                soft_cap: Some(0.0),
                ..o
            },
            AttentionOptions {
                scale: Some(f32::INFINITY),
                ..o
            },
        ] {
            assert_eq!(
                attention_gqa(q, [2, 2, 2], k, v, 1, 3, &o).len(),
                12,
                "{o:?}"
            );
        }
        assert_eq!(
            attention_gqa(
                q,
                [2, 2, 2],
                k,
                v,
                1,
                3,
                &AttentionOptions {
                    window: Some(BIG),
                    ..o
                }
            ),
            good
        );
    }

    #[test]
    fn mla_twin_returns_nothing_for_inconsistent_shapes() {
        let o = AttentionOptions::default();
        let x = pseudo_random(4, 64, 1.0);
        // 1 query of 2 heads, r = 3, p = 2, over 3 rows.
        let (ql, qr, c, kp) = (&x[..6], &x[6..10], &x[10..19], &x[19..25]);
        assert_eq!(attention_mla(ql, qr, [1, 2, 3], c, kp, 2, &o).len(), 6);
        // No rope part is plain latent attention.
        assert_eq!(attention_mla(ql, &[], [1, 2, 3], c, &[], 0, &o).len(), 6);
        let cases: [MlaArgs; 9] = [
            (ql, qr, [1, 2, 0], c, kp, 2),
            (ql, qr, [4, 2, 3], c, kp, 2),
            (&ql[..5], qr, [1, 2, 3], c, kp, 2),
            (ql, &qr[..3], [1, 2, 3], c, kp, 2),
            (ql, qr, [1, 2, 3], c, &kp[..5], 2),
            (ql, qr, [1, 2, 3], c, kp, BIG),
            (ql, qr, [BIG, 2, 3], c, kp, 2),
            (ql, qr, [1, BIG, 3], c, kp, 2),
            (ql, qr, [1, 2, BIG], c, kp, 2),
        ];
        for (i, (ql, qr, shape, c, kp, p)) in cases.into_iter().enumerate() {
            assert!(
                attention_mla(ql, qr, shape, c, kp, p, &o).is_empty(),
                "case {i}"
            );
        }
    }
}
