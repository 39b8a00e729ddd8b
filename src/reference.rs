//! Plain-Rust twins of the kernels and of the whole cache, used as the reference in tests and tools.
//! Conversions use `half` (round to nearest, ties to even), which the WGSL kernels match bit for bit.

use crate::codec::DType;
pub use crate::codec::{
    bits_to_f32, convert_bits, decode_rows, f32_to_bits, host_bits, pack_rows, round_trip,
    unpack_rows,
};

/// Deterministic pseudo-random values in `[-amplitude, amplitude)`, different per seed (xorshift64): test
/// and demo data that the CPU twins and the GPU see alike.
pub fn pseudo_random(seed: u64, n: usize, amplitude: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 * amplitude - amplitude
        })
        .collect()
}

/// Element bits of a strided source read the way the slab-write kernel reads it: element
/// `(r, i1, i2, ...)` of `shape` is source element `offset + r·strides[0] + Σ i_k·strides[k]`.
/// `src` holds element bits one per entry.
pub fn gather_strided(src: &[u32], offset: usize, shape: &[usize], strides: &[usize]) -> Vec<u32> {
    let total: usize = shape.iter().product();
    (0..total)
        .map(|flat| {
            let (mut rem, mut idx) = (flat, offset);
            for k in (0..shape.len()).rev() {
                idx += (rem % shape[k]) * strides[k];
                rem /= shape[k];
            }
            src[idx]
        })
        .collect()
}

/// Twin of `shaders/slab_write.wgsl`: the stored words of a strided source converted to `storage`.
pub fn slab_write(
    src_bits: &[u32],
    src_dtype: DType,
    offset: usize,
    shape: &[usize],
    strides: &[usize],
    storage: DType,
) -> Vec<u32> {
    let row_elems: usize = shape.iter().skip(1).product();
    let bits: Vec<u32> = gather_strided(src_bits, offset, shape, strides)
        .into_iter()
        .map(|b| convert_bits(b, src_dtype, storage))
        .collect();
    pack_rows(&bits, storage, row_elems)
}

/// Twin of `shaders/zero.wgsl`.
pub fn zero(words: &mut [u32], start: usize, n: usize) {
    let end = (start + n).min(words.len());
    words[start.min(end)..end].fill(0);
}

/// A plain-Rust model of a whole cache: the stored words of every slot buffer at full capacity.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CpuCache {
    pub dtype: DType,
    /// Elements per row, per layer and slot.
    pub row_elems: Vec<Vec<usize>>,
    /// Every word of every slot buffer, per layer and slot.
    pub words: Vec<Vec<Vec<u32>>>,
}

impl CpuCache {
    pub fn new(spec: &crate::spec::CacheSpec) -> Self {
        let row_elems: Vec<Vec<usize>> = spec
            .layers()
            .iter()
            .map(|l| l.slots.iter().map(|s| s.row_elems()).collect())
            .collect();
        let words = row_elems
            .iter()
            .map(|l| {
                l.iter()
                    .map(|&e| vec![0; Self::row_words_of(e, spec.dtype()) * spec.max_seq_len()])
                    .collect()
            })
            .collect();
        Self {
            dtype: spec.dtype(),
            row_elems,
            words,
        }
    }

    fn row_words_of(row_elems: usize, dtype: DType) -> usize {
        crate::codec::padded_row_bytes(row_elems, dtype) as usize / 4
    }

    pub fn row_words(&self, layer: usize, slot: usize) -> usize {
        Self::row_words_of(self.row_elems[layer][slot], self.dtype)
    }

    /// Writes element bits (already in the storage type) as rows starting at `row`.
    pub fn write_rows(&mut self, layer: usize, slot: usize, row: usize, bits: &[u32]) {
        let packed = pack_rows(bits, self.dtype, self.row_elems[layer][slot]);
        let at = row * self.row_words(layer, slot);
        self.words[layer][slot][at..at + packed.len()].copy_from_slice(&packed);
    }

    /// Zeroes rows `[start, end)` of every slot of `layer`.
    pub fn zero_rows(&mut self, layer: usize, start: usize, end: usize) {
        for slot in 0..self.words[layer].len() {
            let rw = self.row_words(layer, slot);
            zero(&mut self.words[layer][slot], start * rw, (end - start) * rw);
        }
    }

    /// Zeroes everything.
    pub fn zero_all(&mut self) {
        self.words.iter_mut().flatten().for_each(|w| w.fill(0));
    }

    /// The first `rows` rows of a slot as f32.
    pub fn read_f32(&self, layer: usize, slot: usize, rows: usize) -> Vec<f32> {
        let w = &self.words[layer][slot][..rows * self.row_words(layer, slot)];
        decode_rows(w, self.dtype, self.row_elems[layer][slot])
    }
}

/// Twin of attention: for each query `qi` and head `h`, softmax over the rows the query sees of
/// `scale · score(qi, h, row)` (soft-capped if asked), times `value(h, row, d)`. Accumulates in f64.
fn attend(
    [n_q, n_heads, d_v]: [usize; 3],
    visible: usize,
    scale: f32,
    options: &crate::attention::AttentionOptions,
    score: impl Fn(usize, usize, usize) -> f64,
    value: impl Fn(usize, usize, usize) -> f64,
) -> Vec<f32> {
    let mut out = vec![0f32; n_q * n_heads * d_v];
    let mut weights = Vec::with_capacity(visible);
    let mut acc: Vec<f64> = Vec::with_capacity(d_v);
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
/// `[n_q, n_heads, d_v]`. The queries are the last `n_q` of the `visible` rows. Panics on slices too
/// short for their shapes.
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
    let visible = k.len() / (n_kv_heads * d_k);
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
/// The default scale is `1/sqrt(r + rope_dim)`. Panics on slices too short for their shapes.
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
    let visible = c_kv.len() / r;
    let scale = options.scale.unwrap_or(1.0 / ((r + p) as f32).sqrt());
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
}
