//! Element types and their stored encodings: the one place that knows how a value becomes stored bits,
//! how rows are packed into 32-bit words and padded, and how they come back. The cache, the CPU twins
//! and the errors speak through it; callers ask for a row's stored bytes, never for an element's.
//! Quantized storage is described on [`DType`].

use std::fmt;

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

/// Element type of the stored cache. 16-bit types are packed two to a `u32` word.
///
/// # Quantized storage
/// Four storage types hold fewer bytes than f16 (see [`DType::Q8_0`], [`DType::Q4_0`],
/// [`DType::F8E4M3`], [`DType::F8E5M2`]). Apps still hand in and read back f32, f16 or bf16; the cache quantizes on every
/// append path and attention and readback dequantize. A row of a block type is laid out as
/// `[values][scales]`: first every element's value (q8_0: one signed byte each, element `i` at byte
/// `i`; q4_0: one 4-bit value each, element `i` in bits `4 * (i % 8)` of word `i / 8`, stored as
/// `q + 8`), then one f16 scale per block of 32 elements, two to a word, low half first, the row
/// padded to a whole word. Element `i` is `q_i * scale[i / 32]` (q4_0: `(stored_i - 8) * scale`),
/// exact in f32. fp8 rows hold one byte per element, element `i` at byte `i`; a scaled fp8 slot
/// ([`crate::SlotSpec::scale`]) stores `fp8(x * (1 / scale))` and its element `i` is that number
/// times the scale. Each slot of a cache has one storage type, the cache's or its own
/// ([`crate::CacheSpec::with_slot_dtype`]): keys and values may differ.
///
/// Quantization is defined so that every adapter computes the same bits (no division, whose WGSL
/// precision is loose, decides a value): q8_0 takes `d = f16(max|x| * (1/127))` and `q = round(x / d)`
/// (half away from zero) decided by exact products; q4_0 takes `d = f16(m / -8)` (llama.cpp's scale)
/// where `m` is the block's first element of largest magnitude and `q = clamp(floor(x / d + 8.5), 0,
/// 15)`. Both divide by the stored f16 scale (llama.cpp divides by the unrounded one, so near a half
/// step its code may differ by one), and the rows are kvgpu's layout, not GGUF's.
/// A scale that would overflow f16 saturates to 65504. NaN inputs quantize as 0 and infinities as
/// `±f32::MAX` in the block types; fp8 e4m3 ("fn": no infinities) rounds to nearest even, saturates
/// at `±448` (infinities included) and keeps NaN as NaN (`0x7f` with the sign); fp8 e5m2 (the top byte
/// of an f16: wider range, one mantissa bit less) rounds to nearest even, saturates at `±57344`
/// (infinities included, though e5m2 has them) and keeps NaN as NaN (`0x7f` with the sign).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// 32-bit IEEE float.
    F32,
    /// 16-bit IEEE float (half precision); stored two to a word.
    F16,
    /// bfloat16, the top 16 bits of an f32; stored two to a word.
    BF16,
    /// Blocks of 32 elements: one f16 scale and 32 signed bytes (1.0625 bytes per element).
    Q8_0,
    /// Blocks of 32 elements: one f16 scale and 32 4-bit values (0.5625 bytes per element).
    Q4_0,
    /// 8-bit float, 4 exponent and 3 mantissa bits, no infinities (max 448).
    F8E4M3,
    /// 8-bit float, 5 exponent and 2 mantissa bits (max 57344): the top byte of an f16.
    F8E5M2,
}

/// Elements per block of the block-quantized types (q8_0, q4_0).
pub const QUANT_BLOCK: usize = 32;

impl DType {
    /// The element types: what apps hand in and read back, and what a storage type may be.
    pub const ALL: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

    /// The quantized storage types.
    pub const QUANTIZED: [DType; 4] = [DType::Q8_0, DType::Q4_0, DType::F8E4M3, DType::F8E5M2];

    /// Every storage type: the element types, then the quantized ones.
    pub const STORAGE: [DType; 7] = [
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::Q8_0,
        DType::Q4_0,
        DType::F8E4M3,
        DType::F8E5M2,
    ];

    /// Bytes per element of an element type or fp8. The block types pack values below a byte and add
    /// scales, so a row's size comes from [`DType::row_bytes`]; for them this is 1, one value rounded
    /// up to a byte.
    pub const fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::Q8_0 | DType::Q4_0 | DType::F8E4M3 | DType::F8E5M2 => 1,
        }
    }

    /// Whether apps can hand data in (and attention queries are) of this type: f32, f16, bf16.
    pub const fn is_element(self) -> bool {
        matches!(self, DType::F32 | DType::F16 | DType::BF16)
    }

    /// Whether this is an 8-bit float type (e4m3 or e5m2): one byte per element, any width, and an
    /// optional scale per slot.
    pub const fn is_fp8(self) -> bool {
        matches!(self, DType::F8E4M3 | DType::F8E5M2)
    }

    /// Whether this is a quantized storage type.
    pub const fn is_quantized(self) -> bool {
        !self.is_element()
    }

    /// Elements per scale block (q8_0 and q4_0), `None` for types stored element by element.
    pub const fn block(self) -> Option<usize> {
        match self {
            DType::Q8_0 | DType::Q4_0 => Some(QUANT_BLOCK),
            _ => None,
        }
    }

    /// Bytes of one stored row of `elems` elements, padded up to a whole 4-byte word; `None` when a
    /// block type's row is not whole blocks or the size overflows.
    pub fn row_bytes(self, elems: usize) -> Option<u64> {
        self.used_bytes(elems)?.checked_add(3).map(|b| b / 4 * 4)
    }

    /// Bytes of one stored row of `elems` elements before its padding (values, then the block
    /// types' scales); `None` as for [`DType::row_bytes`].
    fn used_bytes(self, elems: usize) -> Option<u64> {
        let e = elems as u64;
        match self {
            DType::Q8_0 | DType::Q4_0 => {
                if !elems.is_multiple_of(QUANT_BLOCK) {
                    return None;
                }
                let values = if self == DType::Q8_0 { e } else { e / 2 };
                values.checked_add(2 * (e / QUANT_BLOCK as u64))
            }
            _ => e.checked_mul(self.size() as u64),
        }
    }

    /// The code the WGSL kernels and snapshots use for this type (`0` f32, `1` f16, `2` bf16, `3`
    /// q8_0, `4` q4_0, `5` fp8 e4m3, `6` fp8 e5m2).
    pub(crate) const fn code(self) -> u32 {
        match self {
            DType::F32 => 0,
            DType::F16 => 1,
            DType::BF16 => 2,
            DType::Q8_0 => 3,
            DType::Q4_0 => 4,
            DType::F8E4M3 => 5,
            DType::F8E5M2 => 6,
        }
    }

    /// Parses `f32`, `f16`, `bf16`, `q8_0`, `q4_0`, `fp8` (also `f8e4m3`, `fp8_e4m3`, `e4m3`) or
    /// `fp8_e5m2` (also `f8e5m2`, `e5m2`), in any case.
    pub fn parse(s: &str) -> Option<DType> {
        match s.to_ascii_lowercase().as_str() {
            "f32" => Some(DType::F32),
            "f16" => Some(DType::F16),
            "bf16" => Some(DType::BF16),
            "q8_0" => Some(DType::Q8_0),
            "q4_0" => Some(DType::Q4_0),
            "fp8" | "f8e4m3" | "fp8_e4m3" | "e4m3" => Some(DType::F8E4M3),
            "f8e5m2" | "fp8_e5m2" | "e5m2" => Some(DType::F8E5M2),
            _ => None,
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::Q8_0 => "q8_0",
            DType::Q4_0 => "q4_0",
            DType::F8E4M3 => "fp8_e4m3",
            DType::F8E5M2 => "fp8_e5m2",
        })
    }
}

/// Elements in one row of the given trailing shape (rank 0 is one element).
pub(crate) fn row_elems(trailing: &[usize]) -> Option<usize> {
    trailing
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
}

/// Bytes of one stored row, padded up to a 4-byte word ([`DType::row_bytes`]; saturating, for rows
/// the spec has already checked).
pub(crate) fn padded_row_bytes(elems: usize, dtype: DType) -> u64 {
    dtype.row_bytes(elems).unwrap_or(u64::MAX / 4 * 4)
}

/// Bytes of one stored row before its padding: the first byte a snapshot may find non-zero padding.
/// Saturating, for rows the spec has already checked, as [`padded_row_bytes`].
pub(crate) fn used_row_bytes(elems: usize, dtype: DType) -> u64 {
    dtype.used_bytes(elems).unwrap_or(u64::MAX / 4 * 4)
}

/// Host data for one slab: f32 (converted to the storage type) or data already in the storage type;
/// a quantized slot (q8_0, q4_0, fp8) takes any of the three and converts it.
#[derive(Clone, Copy, Debug)]
pub enum HostData<'a> {
    /// f32 elements.
    F32(&'a [f32]),
    /// f16 elements.
    F16(&'a [f16]),
    /// bf16 elements.
    BF16(&'a [bf16]),
}

impl HostData<'_> {
    /// The element type of the data.
    pub fn dtype(&self) -> DType {
        match self {
            HostData::F32(_) => DType::F32,
            HostData::F16(_) => DType::F16,
            HostData::BF16(_) => DType::BF16,
        }
    }

    /// Elements in the data.
    pub fn len(&self) -> usize {
        match self {
            HostData::F32(d) => d.len(),
            HostData::F16(d) => d.len(),
            HostData::BF16(d) => d.len(),
        }
    }

    /// The data holds no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Elements `range` of the data.
    fn part(&self, range: std::ops::Range<usize>) -> Self {
        match self {
            HostData::F32(d) => HostData::F32(&d[range]),
            HostData::F16(d) => HostData::F16(&d[range]),
            HostData::BF16(d) => HostData::BF16(&d[range]),
        }
    }
}

/// Bits of `x` stored as `dtype` (low 16 bits for 16-bit types, the byte for fp8). The block types
/// quantize whole blocks of a row, not single elements: their element bits are the f32 bits, and
/// [`pack_rows`] quantizes them.
pub fn f32_to_bits(x: f32, dtype: DType) -> u32 {
    match dtype {
        DType::F32 | DType::Q8_0 | DType::Q4_0 => x.to_bits(),
        DType::F16 => f16::from_f32(x).to_bits() as u32,
        DType::BF16 => bf16::from_f32(x).to_bits() as u32,
        DType::F8E4M3 => f32_to_e4m3(x),
        DType::F8E5M2 => f32_to_e5m2(x),
    }
}

/// The f32 value of bits stored as `dtype` (f32 bits for the block types; see [`f32_to_bits`]).
pub fn bits_to_f32(bits: u32, dtype: DType) -> f32 {
    match dtype {
        DType::F32 | DType::Q8_0 | DType::Q4_0 => f32::from_bits(bits),
        DType::F16 => f16::from_bits(bits as u16).to_f32(),
        DType::BF16 => bf16::from_bits(bits as u16).to_f32(),
        DType::F8E4M3 => e4m3_to_f32(bits),
        DType::F8E5M2 => e5m2_to_f32(bits),
    }
}

/// Bits of an element of type `from` converted to type `to`, as the slab-write kernel converts it.
pub fn convert_bits(bits: u32, from: DType, to: DType) -> u32 {
    if from == to {
        bits
    } else {
        f32_to_bits(bits_to_f32(bits, from), to)
    }
}

/// `x` rounded through the storage type, as a read of the cache returns it. The block types round a
/// value according to its whole block: for them this returns `x`; use [`round_trip_rows`].
pub fn round_trip(x: f32, dtype: DType) -> f32 {
    bits_to_f32(f32_to_bits(x, dtype), dtype)
}

/// Rows of `row_elems` values rounded through the storage type, blocks included: what a read of the
/// cache returns after they were appended.
pub fn round_trip_rows(values: &[f32], dtype: DType, row_elems: usize) -> Vec<f32> {
    let bits: Vec<u32> = values.iter().map(|&x| f32_to_bits(x, dtype)).collect();
    decode_rows(&pack_rows(&bits, dtype, row_elems), dtype, row_elems)
}

/// Where an 8-bit float's fields lie against f32's, for [`f32_to_fp8`].
struct Fp8Format {
    /// f32 bits of the smallest normal.
    min_normal: u32,
    /// `127 - bias`: the rebias of a normal exponent.
    rebias: u32,
    /// Mantissa bits f32 has beyond the format's.
    drop: u32,
    /// The largest finite code.
    max: u32,
    /// `150 - bias - mantissa bits + 1`: a subnormal's shift is this minus the f32 exponent.
    sub: i32,
}

/// e4m3 ("fn": no infinities, max 448) and e5m2 (max 57344).
const E4M3: Fp8Format = Fp8Format {
    min_normal: 0x3c80_0000,
    rebias: 120,
    drop: 20,
    max: 0x7e,
    sub: 141,
};
const E5M2: Fp8Format = Fp8Format {
    min_normal: 0x3880_0000,
    rebias: 112,
    drop: 21,
    max: 0x7b,
    sub: 134,
};

/// fp8 of `x`: round to nearest even, saturating at the largest finite code (infinities included,
/// and everything that rounds past it), NaN kept (`0x7f` with the sign). Integer arithmetic on the
/// bits, as the kernel does (`shaders/slab_write.wgsl`).
fn f32_to_fp8(x: f32, f: &Fp8Format) -> u32 {
    let b = x.to_bits();
    let sign = (b >> 24) & 0x80;
    let a = b & 0x7fff_ffff;
    if a > 0x7f80_0000 {
        return sign | 0x7f;
    }
    if a >= f.min_normal {
        // Normal: rebias the exponent, round to nearest even on the last bit kept.
        let n = a - (f.rebias << 23);
        let half = (1 << (f.drop - 1)) - 1;
        return sign | ((n + half + ((n >> f.drop) & 1)) >> f.drop).min(f.max);
    }
    // Subnormal: |x| in units of the smallest subnormal, rounded to nearest even; a carry into the
    // exponent is the smallest normal.
    let shift = (f.sub - (a >> 23) as i32).clamp(1, 31) as u32;
    let full = (a & 0x007f_ffff) | 0x0080_0000;
    let round_bit = 1u32 << (shift - 1);
    let up = (full & round_bit) != 0 && (full & (3 * round_bit - 1)) != 0;
    sign | ((full >> shift) + up as u32)
}

/// fp8 e4m3 of `x`: saturating at +-448.
fn f32_to_e4m3(x: f32) -> u32 {
    f32_to_fp8(x, &E4M3)
}

/// The f32 value of an fp8 e4m3 byte (exact).
fn e4m3_to_f32(b: u32) -> f32 {
    let sign = (b & 0x80) << 24;
    let (e, m) = ((b >> 3) & 0xf, b & 7);
    if e == 0xf && m == 7 {
        return f32::from_bits(sign | 0x7fc0_0000);
    }
    if e == 0 {
        let v = m as f32 * (1.0 / 512.0);
        return if sign != 0 { -v } else { v };
    }
    f32::from_bits(sign | ((e + 120) << 23) | (m << 20))
}

/// fp8 e5m2 of `x`: saturating at +-57344.
fn f32_to_e5m2(x: f32) -> u32 {
    f32_to_fp8(x, &E5M2)
}

/// The f32 value of an fp8 e5m2 byte (exact: the byte is the top half of an f16).
fn e5m2_to_f32(b: u32) -> f32 {
    f16::from_bits(((b & 0xff) << 8) as u16).to_f32()
}

/// 1/127 in f32: q8_0's scale is `max|x|` times it (a product rounds alike on every adapter, a WGSL
/// division need not). The kernel spells the same bits.
pub(crate) const INV_127: f32 = 1.0 / 127.0;

/// A block value as the block types see it: NaN as 0, infinities as +-f32::MAX.
fn finite(x: f32) -> f32 {
    if x.is_nan() {
        0.0
    } else {
        x.clamp(-f32::MAX, f32::MAX)
    }
}

/// f16 bits of a block scale, saturating at +-65504 instead of becoming infinite; a zero scale is +0
/// whatever its sign (an adapter that flushes subnormal inputs may see the sign of a different one).
fn scale_bits(d: f32) -> u32 {
    let h = f16::from_f32(d).to_bits() as u32;
    match h & 0x7fff {
        0 => 0,
        0x7c00 => h - 1,
        _ => h,
    }
}

/// `floor(a / d + 0.5)` for `0 < d` and a quotient of magnitude below 2^20, decided by exact products
/// (`(q +- 0.5) * d` has at most 21 significant bits) around an estimate from the reciprocal. The
/// estimate only needs to be within one of the result, so it truncates instead of taking the floor
/// (which, without SSE4.1, is a call into libm per element): for `a >= 0` (q8_0) truncation is the
/// floor, and for a negative quotient (q4_0) it is the floor or one more, since `a * (1 / d)` never
/// rounds past the half step `r + 0.5` the true result `r` lies below (`(r + 0.5) * d` is exact).
fn round_div(a: f32, d: f32) -> i32 {
    let mut q = (a * (1.0 / d) + 0.5) as i32;
    if a >= (q as f32 + 0.5) * d {
        q += 1;
    } else if a < (q as f32 - 0.5) * d {
        q -= 1;
    }
    q
}

/// One q8_0 block: the scale's f16 bits and the 32 signed values.
fn quantize_q8(x: &[f32; QUANT_BLOCK]) -> (u32, [i8; QUANT_BLOCK]) {
    // Loops, not `[T; N]::map`, which the compiler left as calls (half the time of an encode).
    let mut x = *x;
    x.iter_mut().for_each(|v| *v = finite(*v));
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let d_bits = scale_bits(amax * INV_127);
    let d = f16::from_bits(d_bits as u16).to_f32();
    let mut q = [0i8; QUANT_BLOCK];
    for (q, &v) in q.iter_mut().zip(&x) {
        let a = v.abs();
        let m = if d == 0.0 {
            0
        } else if a >= 126.5 * d {
            127
        } else {
            round_div(a, d).clamp(0, 127)
        };
        *q = (if v < 0.0 { -m } else { m }) as i8;
    }
    (d_bits, q)
}

/// One q4_0 block: the scale's f16 bits and the 32 stored values `q + 8` in 0..=15.
fn quantize_q4(x: &[f32; QUANT_BLOCK]) -> (u32, [u8; QUANT_BLOCK]) {
    let mut x = *x;
    x.iter_mut().for_each(|v| *v = finite(*v));
    let (mut amax, mut m) = (0.0f32, 0.0f32);
    for &v in &x {
        if v.abs() > amax {
            amax = v.abs();
            m = v;
        }
    }
    let d_bits = scale_bits(m * -0.125);
    let d = f16::from_bits(d_bits as u16).to_f32();
    let ad = d.abs();
    let mut q = [8u8; QUANT_BLOCK];
    if d == 0.0 {
        return (d_bits, q);
    }
    for (q, &v) in q.iter_mut().zip(&x) {
        let y = if d > 0.0 { v } else { -v };
        let j = if y >= 6.5 * ad {
            7
        } else if y < -7.5 * ad {
            -8
        } else {
            round_div(y, ad)
        };
        *q = (j.clamp(-8, 7) + 8) as u8;
    }
    (d_bits, q)
}

/// Words of one stored row of a block type: whole blocks (a width that is not is padded with zero
/// elements here; specs refuse it).
fn block_row_words(dtype: DType, row_elems: usize) -> usize {
    // A width past the last whole block is a row no buffer holds.
    row_elems
        .checked_next_multiple_of(QUANT_BLOCK)
        .map_or(usize::MAX, |e| (padded_row_bytes(e, dtype) / 4) as usize)
}

/// Words of one stored row as [`pack_rows`] writes it.
pub(crate) fn packed_row_words(dtype: DType, row_elems: usize) -> usize {
    match dtype {
        DType::F32 => row_elems,
        DType::F16 | DType::BF16 => row_elems.div_ceil(2),
        DType::F8E4M3 | DType::F8E5M2 => row_elems.div_ceil(4),
        DType::Q8_0 | DType::Q4_0 => block_row_words(dtype, row_elems),
    }
}

/// Quantizes one row of f32 element bits into `out` (a row of [`block_row_words`]).
fn pack_block_row(bits: &[u32], dtype: DType, out: &mut [u32]) {
    quantize_row(|i| f32::from_bits(bits[i]), bits.len(), dtype, out);
}

/// Quantizes one row of `elems` values (element `i` is `x(i)`; a last block cut short is padded with
/// zeros) into `out`, a zeroed row of [`block_row_words`].
fn quantize_row(x: impl Fn(usize) -> f32, elems: usize, dtype: DType, out: &mut [u32]) {
    let blocks = elems.div_ceil(QUANT_BLOCK);
    let value_words = if dtype == DType::Q8_0 {
        blocks * 8
    } else {
        blocks * 4
    };
    for b in 0..blocks {
        let mut block = [0.0f32; QUANT_BLOCK];
        let n = (elems - b * QUANT_BLOCK).min(QUANT_BLOCK);
        for (i, v) in block[..n].iter_mut().enumerate() {
            *v = x(b * QUANT_BLOCK + i);
        }
        let x = block;
        let d = if dtype == DType::Q8_0 {
            let (d, q) = quantize_q8(&x);
            for (i, &v) in q.iter().enumerate() {
                out[b * 8 + i / 4] |= (v as u8 as u32) << (8 * (i % 4));
            }
            d
        } else {
            let (d, q) = quantize_q4(&x);
            for (i, &v) in q.iter().enumerate() {
                out[b * 4 + i / 8] |= (v as u32) << (4 * (i % 8));
            }
            d
        };
        out[value_words + b / 2] |= d << (16 * (b % 2));
    }
}

/// Element `i` of a stored block-type row, as f32 (exact: a value of at most 8 bits times an f16).
fn block_elem(row: &[u32], dtype: DType, blocks: usize, i: usize) -> f32 {
    let b = i / QUANT_BLOCK;
    let value_words = if dtype == DType::Q8_0 {
        blocks * 8
    } else {
        blocks * 4
    };
    let d = f16::from_bits((row[value_words + b / 2] >> (16 * (b % 2))) as u16).to_f32();
    let q = if dtype == DType::Q8_0 {
        (row[i / 4] >> (8 * (i % 4))) as u8 as i8 as i32
    } else {
        ((row[i / 8] >> (4 * (i % 8))) & 0xf) as i32 - 8
    };
    q as f32 * d
}

/// An empty `Vec` with room for `n` elements, or `None` when `n` is unknown (an overflowed size) or
/// cannot be allocated (a `Vec` past `isize::MAX` bytes would panic instead, which wasm32 reaches at
/// 2 GiB).
pub(crate) fn with_room<T>(n: Option<usize>) -> Option<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n?).ok()?;
    Some(v)
}

/// `n` zeros, or an empty `Vec` when `n` is unknown or cannot be allocated.
pub(crate) fn zeros<T: Clone + Default>(n: Option<usize>) -> Vec<T> {
    match (n, with_room(n)) {
        (Some(n), Some(mut v)) => {
            v.resize(n, T::default());
            v
        }
        _ => Vec::new(),
    }
}

/// A copy of `x`, or an empty `Vec` where this process cannot allocate one.
fn copied<T: Copy>(x: &[T]) -> Vec<T> {
    let Some(mut v) = with_room(Some(x.len())) else {
        return Vec::new();
    };
    v.extend_from_slice(x);
    v
}

/// Packs row-major element bits (one element per entry) into stored words: whole rows of `row_elems`
/// elements, 16-bit types two per word low half first, fp8 four per word, the block types quantized
/// (see [`DType`]), each row padded to a whole word. f32 elements are their own words, a partial
/// last row included; the other types drop a partial last row. Empty where the words cannot be
/// allocated.
pub fn pack_rows(bits: &[u32], dtype: DType, row_elems: usize) -> Vec<u32> {
    if dtype == DType::F32 {
        return copied(bits);
    }
    if row_elems == 0 {
        return Vec::new();
    }
    let row_words = packed_row_words(dtype, row_elems);
    let rows = bits.len() / row_elems;
    let mut out = zeros(rows.checked_mul(row_words));
    for (row, out) in bits
        .chunks_exact(row_elems)
        .zip(out.chunks_exact_mut(row_words))
    {
        match dtype {
            DType::Q8_0 | DType::Q4_0 => pack_block_row(row, dtype, out),
            _ => {
                let per = 4 / dtype.size();
                let mask = if per == 2 { 0xffff } else { 0xff };
                for (e, &b) in row.iter().enumerate() {
                    out[e / per] |= (b & mask) << (32 / per * (e % per));
                }
            }
        }
    }
    out
}

/// Inverse of [`pack_rows`]: element bits of every whole row, padding dropped (the block types'
/// elements dequantized to f32 bits); empty where the result cannot be allocated.
pub fn unpack_rows(words: &[u32], dtype: DType, row_elems: usize) -> Vec<u32> {
    if dtype == DType::F32 {
        return copied(words);
    }
    let row_words = packed_row_words(dtype, row_elems).max(1);
    let blocks = row_elems.div_ceil(QUANT_BLOCK);
    let rows = words.len() / row_words;
    let Some(mut out) = with_room(rows.checked_mul(row_elems)) else {
        return Vec::new();
    };
    out.extend(words.chunks_exact(row_words).flat_map(|row| {
        (0..row_elems).map(move |e| match dtype {
            DType::Q8_0 | DType::Q4_0 => block_elem(row, dtype, blocks, e).to_bits(),
            _ => {
                let per = 4 / dtype.size();
                let mask = if per == 2 { 0xffff } else { 0xff };
                (row[e / per] >> (32 / per * (e % per))) & mask
            }
        })
    }));
    out
}

/// Stored words to f32 values, `[rows, row_elems]` row-major; empty where they cannot be allocated.
pub fn decode_rows(words: &[u32], dtype: DType, row_elems: usize) -> Vec<f32> {
    if dtype == DType::F32 {
        return copied(bytemuck::cast_slice(words));
    }
    let row_words = packed_row_words(dtype, row_elems).max(1);
    let rows = words.len() / row_words;
    let mut out = zeros(rows.checked_mul(row_elems));
    if row_elems == 0 {
        return out;
    }
    // Row by row, each type's elements where they lie (the 16-bit ones and fp8 low bits first, as
    // little-endian words hold them); f16 through `half`'s slice conversion, which converts as
    // `f16::to_f32` does (F16C's eight at a time where the processor has it).
    let blocks = row_elems.div_ceil(QUANT_BLOCK);
    for (row, values) in words
        .chunks_exact(row_words)
        .zip(out.chunks_exact_mut(row_elems))
    {
        match dtype {
            DType::F16 => {
                let halves: &[f16] = bytemuck::cast_slice(row);
                halves[..row_elems].convert_to_f32_slice(values);
            }
            DType::BF16 => {
                let halves: &[bf16] = bytemuck::cast_slice(row);
                halves[..row_elems].convert_to_f32_slice(values);
            }
            DType::F8E4M3 | DType::F8E5M2 => {
                let bytes: &[u8] = bytemuck::cast_slice(row);
                for (v, &b) in values.iter_mut().zip(bytes) {
                    *v = bits_to_f32(b as u32, dtype);
                }
            }
            _ => {
                for (e, v) in values.iter_mut().enumerate() {
                    *v = block_elem(row, dtype, blocks, e);
                }
            }
        }
    }
    out
}

/// The multiplier appends apply to the values of an fp8 slot scaled by `scale`
/// ([`crate::SlotSpec::scale`]): `1 / scale` in f32, which kernels and twins multiply by alike.
pub fn inverse_scale(scale: f32) -> f32 {
    1.0 / scale
}

/// `x` as a scaled fp8 slot stores it before rounding: `x * inv` rounded once, where `inv` is
/// the slot's [`inverse_scale`] (positive and normal; any other `inv` gets the plain product);
/// NaN and the infinities kept as they are (the fp8 encoder saturates an infinity). The
/// slab-write kernel computes the same from the same bits, so that its codes match on every
/// adapter, although WGSL lets an adapter flush subnormal operands and results (SwiftShader does)
/// and leaves an overflow to infinity indeterminate:
/// - a magnitude above 2^(17 - k) for `inv` in [2^k, 2^(k+1)) is taken as that limit, whose product
///   lies in [2^17, 2^18): past every fp8 format's largest code (so the code is the same), and
///   finite;
/// - a subnormal `x` is scaled through its integer mantissa (`m · 2^-149 · inv` as
///   `m · (inv · 2^-149)`, the same real number rounded once), or taken as zero where `inv` is
///   below 2^23, so that the product is below 2^-103, zero in every fp8 format;
/// - the product is of the magnitude, and `x`'s sign is put back after it (a flushed result keeps
///   its sign).
pub fn prescaled(x: f32, inv: f32) -> f32 {
    if !(inv.is_normal() && inv > 0.0) {
        return if x.is_nan() { x } else { x * inv };
    }
    let bits = x.to_bits();
    let (sign, mag) = (bits & 0x8000_0000, bits & 0x7fff_ffff);
    if mag >= 0x7f80_0000 {
        return x;
    }
    let inv_bits = inv.to_bits();
    let product = if mag >= 0x0080_0000 {
        f32::from_bits(mag.min(scaled_limit(inv_bits))) * inv
    } else if inv_bits >> 23 > 149 {
        mag as f32 * f32::from_bits(inv_bits - (149 << 23))
    } else {
        0.0
    };
    f32::from_bits(sign | product.to_bits())
}

/// The f32 bits of the largest magnitude [`prescaled`] multiplies by `inv` (bits of a positive
/// normal f32, whose biased exponent `b` is 1..=254): 2^(17 - k) for `inv` in [2^k, 2^(k+1)),
/// k = b - 127, whose product lies in [2^17, 2^18): past e4m3's 448 and e5m2's 57,344, and
/// finite. Its biased exponent is 144 - k = 271 - b. Where that power is not an f32 (b <= 16:
/// `inv` below 2^-110), f32::MAX, whose product is below 2^18.
fn scaled_limit(inv_bits: u32) -> u32 {
    let b = inv_bits >> 23;
    if b <= 16 {
        0x7f7f_ffff
    } else {
        (271 - b) << 23
    }
}

/// Element bits of host data stored in a slot of `storage` whose values are scaled by `scale`
/// (`None`: [`host_bits`]).
pub fn scaled_host_bits(data: HostData<'_>, storage: DType, scale: Option<f32>) -> Vec<u32> {
    let Some(scale) = scale else {
        return host_bits(data, storage);
    };
    let inv = inverse_scale(scale);
    let bits = |x: f32| f32_to_bits(prescaled(x, inv), storage);
    match data {
        HostData::F32(d) => d.iter().map(|&x| bits(x)).collect(),
        HostData::F16(d) => d.iter().map(|x| bits(x.to_f32())).collect(),
        HostData::BF16(d) => d.iter().map(|x| bits(x.to_f32())).collect(),
    }
}

/// Stored words of a slot scaled by `scale` to f32 values: [`decode_rows`] times the scale.
pub fn decode_scaled_rows(
    words: &[u32],
    dtype: DType,
    row_elems: usize,
    scale: Option<f32>,
) -> Vec<f32> {
    let mut values = decode_rows(words, dtype, row_elems);
    if let Some(scale) = scale {
        values.iter_mut().for_each(|x| *x *= scale);
    }
    values
}

/// Element bits of host data converted to `storage`.
pub fn host_bits(data: HostData<'_>, storage: DType) -> Vec<u32> {
    match data {
        HostData::F32(d) => d.iter().map(|&x| f32_to_bits(x, storage)).collect(),
        HostData::F16(d) => d
            .iter()
            .map(|x| convert_bits(x.to_bits() as u32, DType::F16, storage))
            .collect(),
        HostData::BF16(d) => d
            .iter()
            .map(|x| convert_bits(x.to_bits() as u32, DType::BF16, storage))
            .collect(),
    }
}

/// Host rows as stored: the data's own bytes when they already are (the storage type, rows of whole
/// words), else encoded into `scratch`. `scale`: a scaled fp8 slot's ([`scaled_host_bits`]).
pub(crate) fn stored_bytes<'a>(
    data: HostData<'a>,
    storage: DType,
    row_elems: usize,
    scale: Option<f32>,
    scratch: &'a mut Vec<u8>,
) -> &'a [u8] {
    match as_stored(data, storage, row_elems) {
        Some(bytes) => bytes,
        None => {
            encode_rows(data, storage, row_elems, scale, scratch);
            scratch
        }
    }
}

/// The data's own bytes where they are already stored so (the storage type, rows of whole words).
fn as_stored(data: HostData<'_>, storage: DType, row_elems: usize) -> Option<&[u8]> {
    let unpadded = (row_elems * storage.size()).is_multiple_of(4);
    match data {
        HostData::F32(d) if storage == DType::F32 => Some(bytemuck::cast_slice(d)),
        HostData::F16(d) if storage == DType::F16 && unpadded => Some(bytemuck::cast_slice(d)),
        HostData::BF16(d) if storage == DType::BF16 && unpadded => Some(bytemuck::cast_slice(d)),
        _ => None,
    }
}

/// The bytes [`stored_bytes`] encodes `data` into its scratch (0 where it takes the data's own):
/// the one large allocation of a conversion, for a caller to reserve first.
pub(crate) fn scratch_bytes(data: HostData<'_>, storage: DType, row_elems: usize) -> usize {
    if as_stored(data, storage, row_elems).is_some() {
        return 0;
    }
    let rows = data.len().checked_div(row_elems).unwrap_or(0);
    match storage.block() {
        Some(_) => rows * block_row_words(storage, row_elems) * 4,
        None => rows * padded_row_bytes(row_elems, storage) as usize,
    }
}

/// Encodes host rows into the stored byte layout, reusing `out`'s allocation.
pub(crate) fn encode_rows(
    data: HostData<'_>,
    storage: DType,
    row_elems: usize,
    scale: Option<f32>,
    out: &mut Vec<u8>,
) {
    out.clear();
    if storage.block().is_some() {
        // Straight from the host values into the stored words, a row at a time (the one large
        // allocation is `out`, which a caller may have reserved: [`scratch_bytes`]).
        let row_words = block_row_words(storage, row_elems);
        let rows = data.len().checked_div(row_elems).unwrap_or(0);
        let mut row = vec![0u32; row_words];
        for r in 0..rows {
            let at = r * row_elems;
            row.fill(0);
            match data {
                HostData::F32(d) => quantize_row(|i| d[at + i], row_elems, storage, &mut row),
                HostData::F16(d) => {
                    quantize_row(|i| d[at + i].to_f32(), row_elems, storage, &mut row)
                }
                HostData::BF16(d) => {
                    quantize_row(|i| d[at + i].to_f32(), row_elems, storage, &mut row)
                }
            }
            out.extend_from_slice(bytemuck::cast_slice(&row));
        }
        return;
    }
    let row_bytes = padded_row_bytes(row_elems, storage) as usize;
    let rows = data.len().checked_div(row_elems).unwrap_or(0);
    out.resize(rows * row_bytes, 0);
    if rows == 0 {
        return;
    }
    // Row by row: each row's bytes are its elements' bits, then the padding (zero).
    let out_rows = out.chunks_exact_mut(row_bytes);
    if scale.is_some() {
        for (r, row) in out_rows.enumerate() {
            let bits = scaled_host_bits(
                data.part(r * row_elems..(r + 1) * row_elems),
                storage,
                scale,
            );
            put_row(bits.into_iter(), storage, row);
        }
        return;
    }
    match data {
        // f32 to a 16-bit type through `half`'s slice conversions (F16C's eight at a time where
        // the processor has it), which round as `f16::from_f32` and `bf16::from_f32` do.
        HostData::F32(d) if storage == DType::F16 => {
            put_f32_rows_as(f16::ZERO, d, row_elems, out_rows)
        }
        HostData::F32(d) if storage == DType::BF16 => {
            put_f32_rows_as(bf16::ZERO, d, row_elems, out_rows)
        }
        HostData::F32(d) => {
            for (src, row) in d.chunks_exact(row_elems).zip(out_rows) {
                put_row(src.iter().map(|&x| f32_to_bits(x, storage)), storage, row);
            }
        }
        // Data of the storage type as it is; f16 or bf16 into fp8 converted.
        HostData::F16(d) => {
            let halves: &[u16] = bytemuck::cast_slice(d);
            put_half_rows(halves, DType::F16, storage, row_elems, out_rows);
        }
        HostData::BF16(d) => {
            let halves: &[u16] = bytemuck::cast_slice(d);
            put_half_rows(halves, DType::BF16, storage, row_elems, out_rows);
        }
    }
}

/// f32 rows into rows of a 16-bit type `H` (`f16` or `bf16`, `zero` its zero) through `half`'s
/// slice conversion, one row at a time; each row's padding stays as it is (zero).
fn put_f32_rows_as<'a, H: bytemuck::Pod>(
    zero: H,
    data: &[f32],
    row_elems: usize,
    out_rows: impl Iterator<Item = &'a mut [u8]>,
) where
    [H]: HalfFloatSliceExt,
{
    let mut half = vec![zero; row_elems];
    for (src, row) in data.chunks_exact(row_elems).zip(out_rows) {
        half.convert_from_f32_slice(src);
        row[..2 * row_elems].copy_from_slice(bytemuck::cast_slice(&half));
    }
}

/// Rows of `row_elems` 16-bit host elements of type `from` (f16 or bf16 bits) into stored rows of
/// `storage`, converted where the types differ.
fn put_half_rows<'a>(
    halves: &[u16],
    from: DType,
    storage: DType,
    row_elems: usize,
    out_rows: impl Iterator<Item = &'a mut [u8]>,
) {
    for (src, row) in halves.chunks_exact(row_elems).zip(out_rows) {
        let bits = src.iter().map(|&h| convert_bits(h as u32, from, storage));
        put_row(bits, storage, row);
    }
}

/// Writes one row's element bits into the front of its stored bytes `row`, `storage.size()`
/// little-endian bytes each (a 16-bit or fp8 type's low bits), leaving the padding after them.
fn put_row(bits: impl Iterator<Item = u32>, storage: DType, row: &mut [u8]) {
    match storage.size() {
        1 => row.iter_mut().zip(bits).for_each(|(o, b)| *o = b as u8),
        2 => row
            .chunks_exact_mut(2)
            .zip(bits)
            .for_each(|(o, b)| o.copy_from_slice(&(b as u16).to_le_bytes())),
        _ => row
            .chunks_exact_mut(4)
            .zip(bits)
            .for_each(|(o, b)| o.copy_from_slice(&b.to_le_bytes())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Host rows encoded row by row (F16C's slice conversion for f16) hold the bits that element by
    /// element conversion and [`pack_rows`] give, for every type but the block ones, padded rows
    /// and not, f32 / f16 / bf16 host data and scaled slots: specials, subnormals, values halfway
    /// between two stored ones, and every f16 code as f32.
    #[test]
    fn encoded_rows_hold_the_bits_of_each_element_converted() {
        let mut x: Vec<f32> = [
            0.0,
            -0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            -f32::NAN,
            f32::from_bits(0x7f80_0001),
            f32::MAX,
            f32::MIN_POSITIVE,
            1e-40,
            -1e-45,
            65504.0,
            65520.0,
            1.0 + f32::EPSILON,
            1.0 + 1.0 / 2048.0,
            1.0 + 3.0 / 2048.0,
            448.0,
            464.0,
            57344.0,
            61440.0,
        ]
        .to_vec();
        x.extend((0..=u16::MAX).map(|h| f16::from_bits(h).to_f32()));
        // The f16 codes and the halfway points between neighbours.
        x.extend(
            (0..u16::MAX).map(|h| f32::from_bits(f16::from_bits(h).to_f32().to_bits() + 0x1000)),
        );
        x.extend((0..4096u32).map(|i| f32::from_bits(i.wrapping_mul(0x9e37_79b9))));
        let halves: Vec<f16> = x.iter().map(|&v| f16::from_f32(v)).collect();
        let brains: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
        let mut out = Vec::new();
        for storage in [
            DType::F16,
            DType::BF16,
            DType::F8E4M3,
            DType::F8E5M2,
            DType::F32,
            DType::Q8_0,
            DType::Q4_0,
        ] {
            for row_elems in [1, 3, 64, 100] {
                let n = x.len() / row_elems * row_elems;
                for data in [
                    HostData::F32(&x[..n]),
                    HostData::F16(&halves[..n]),
                    HostData::BF16(&brains[..n]),
                ] {
                    // Scales are fp8's alone.
                    let scales = match storage.block() {
                        Some(_) => &[None][..],
                        None => &[None, Some(0.25)][..],
                    };
                    for &scale in scales {
                        encode_rows(data, storage, row_elems, scale, &mut out);
                        let bits = scaled_host_bits(data, storage, scale);
                        let want = pack_rows(&bits, storage, row_elems);
                        assert_eq!(
                            out,
                            bytemuck::cast_slice::<u32, u8>(&want),
                            "{:?} into {storage:?}, rows of {row_elems}, scale {scale:?}",
                            data.dtype()
                        );
                    }
                }
            }
        }
    }

    /// Stored rows decoded row by row hold each element's value as [`unpack_rows`] and
    /// [`bits_to_f32`] give it, bit for bit: every f16 and bf16 code, every fp8 byte, and quantized
    /// blocks, in padded rows and not.
    #[test]
    fn decoded_rows_hold_the_value_of_each_element() {
        let codes: Vec<u32> = (0..=u16::MAX as u32).collect();
        let x: Vec<f32> = (0..8192u32)
            .map(|i| f32::from_bits(i.wrapping_mul(0x9e37_79b9)))
            .map(|v| if v.is_finite() { v % 1e4 } else { 0.5 })
            .collect();
        for dtype in DType::STORAGE {
            let bits: Vec<u32> = match dtype {
                DType::F16 | DType::BF16 => codes.clone(),
                DType::F8E4M3 | DType::F8E5M2 => codes.iter().map(|c| c & 0xff).collect(),
                _ => x.iter().map(|&v| f32_to_bits(v, dtype)).collect(),
            };
            let widths: &[usize] = if dtype.block().is_some() {
                &[32, 64, 256]
            } else {
                &[1, 3, 64, 100]
            };
            for &row_elems in widths {
                let n = bits.len() / row_elems * row_elems;
                let words = pack_rows(&bits[..n], dtype, row_elems);
                let got: Vec<u32> = decode_rows(&words, dtype, row_elems)
                    .iter()
                    .map(|v| v.to_bits())
                    .collect();
                let want: Vec<u32> = unpack_rows(&words, dtype, row_elems)
                    .into_iter()
                    .map(|b| bits_to_f32(b, dtype).to_bits())
                    .collect();
                assert_eq!(got, want, "{dtype:?}, rows of {row_elems}");
            }
        }
    }

    /// Any words and any width give whole rows and no panic (`decode_rows` is public through
    /// `kvgpu::reference`): no words, fewer than a row, a partial row after whole ones, a width of
    /// 0 and the largest width. f32 words are values whatever the width, as before.
    #[test]
    fn decoded_rows_of_any_length_are_whole_rows() {
        let words: Vec<u32> = (0..40u32).map(|i| i.wrapping_mul(0x0101_0101)).collect();
        for dtype in DType::STORAGE {
            for row_elems in [0, 1, 3, 32, 33, 1 << 20, usize::MAX] {
                for n in [0, 1, 7, 40] {
                    let got = decode_rows(&words[..n], dtype, row_elems);
                    let want = if dtype == DType::F32 {
                        n
                    } else if row_elems == 0 {
                        0
                    } else {
                        n / packed_row_words(dtype, row_elems) * row_elems
                    };
                    assert_eq!(got.len(), want, "{dtype:?}, rows of {row_elems}, {n} words");
                }
            }
        }
        let mut out = Vec::new();
        encode_rows(HostData::F32(&[]), DType::F16, 3, None, &mut out);
        assert!(out.is_empty());
    }

    /// Results past what a `Vec` may hold (`isize::MAX` bytes) are empty, not a panic.
    #[test]
    fn results_that_cannot_be_allocated_are_empty() {
        assert_eq!(zeros::<u64>(Some(usize::MAX / 4)), Vec::<u64>::new());
        assert_eq!(with_room::<u64>(Some(usize::MAX / 4)), None);
        assert_eq!(zeros::<u32>(Some(3)), vec![0; 3]);
    }

    #[test]
    fn encode_rows_pads_16_bit_rows() {
        let mut out = Vec::new();
        encode_rows(
            HostData::F32(&[1.0, 2.0, 3.0]),
            DType::BF16,
            3,
            None,
            &mut out,
        );
        assert_eq!(out.len(), 8);
        let words: Vec<u32> = bytemuck::pod_collect_to_vec(&out);
        assert_eq!(decode_rows(&words, DType::BF16, 3), vec![1.0, 2.0, 3.0]);
    }

    #[test]
    fn packing_takes_any_input_without_panicking() {
        for dtype in DType::ALL {
            // No elements per row, rows cut short, empty input: whole rows only, never a panic.
            assert!(pack_rows(&[1, 2, 3], dtype, 0).len() <= 3);
            assert_eq!(pack_rows(&[], dtype, 5), Vec::<u32>::new());
            let words = pack_rows(&[1, 2, 3], dtype, 2);
            if dtype != DType::F32 {
                assert_eq!(words, vec![1 | 2 << 16]);
                assert_eq!(unpack_rows(&words, dtype, 2), vec![1, 2]);
                assert_eq!(unpack_rows(&[7, 8, 9], dtype, 4), vec![7, 0, 8, 0]);
            }
            assert_eq!(decode_rows(&[], dtype, 0), Vec::<f32>::new());
            let _ = unpack_rows(&[1, 2, 3], dtype, 0);
            let _ = unpack_rows(&[1, 2, 3], dtype, usize::MAX);
        }
    }

    /// Pseudo-random f32 of every magnitude: random bits, finite ones kept.
    fn any_floats(n: usize, seed: u64) -> Vec<f32> {
        let mut rng = crate::reference::Xorshift::new(seed);
        let mut out = Vec::with_capacity(n);
        while out.len() < n {
            let bits = (rng.below(1 << 16) as u32) << 16 | rng.below(1 << 16) as u32;
            let x = f32::from_bits(bits);
            if x.is_finite() {
                out.push(x);
            }
        }
        out
    }

    /// 200 blocks of moderate values, 200 of finite values of every magnitude, then `ties`.
    fn blocks(seed: u64, ties: [f32; 32]) -> Vec<[f32; 32]> {
        let moderate = crate::reference::pseudo_random(seed, 32 * 200, 3.0);
        let wild = any_floats(32 * 200, seed + 1);
        let mut all: Vec<[f32; 32]> = moderate
            .chunks(32)
            .chain(wild.chunks(32))
            .map(|c| <[f32; 32]>::try_from(c).unwrap())
            .collect();
        all.push(ties);
        all
    }

    #[test]
    fn the_kernel_spells_one_over_127_with_these_bits() {
        assert_eq!(INV_127.to_bits(), 0x3c01_0204);
    }

    /// q8_0 against the definition computed in f64 (exact for these quotients): the nearest integer
    /// to x / d, half away from zero, with d the stored f16 scale.
    #[test]
    fn q8_0_rounds_to_the_nearest_step_of_its_stored_scale() {
        // Exact ties: a largest value of 127 makes the scale 1.
        let ties: [f32; 32] =
            std::array::from_fn(|i| if i == 0 { 127.0 } else { i as f32 * 4.0 - 64.5 });
        for x in &blocks(3, ties) {
            let (d_bits, q) = quantize_q8(x);
            let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
            let want_d = f16::from_f32(amax * INV_127);
            let want_d = if want_d.is_infinite() {
                f16::MAX
            } else {
                want_d
            };
            assert_eq!(
                d_bits,
                want_d.to_bits() as u32 & if want_d.to_f32() == 0.0 { 0 } else { 0xffff }
            );
            let d = want_d.to_f32() as f64;
            for (&v, &q) in x.iter().zip(&q) {
                let want = if d == 0.0 {
                    0.0
                } else {
                    ((v as f64).abs() / d + 0.5)
                        .floor()
                        .min(127.0)
                        .copysign(v as f64)
                };
                assert_eq!(q as f64, want, "{v} with scale {d}");
            }
        }
        let (_, q) = quantize_q8(&ties);
        assert_eq!(
            &q[..4],
            &[127, -61, -57, -53],
            "-60.5 rounds away from zero"
        );
        assert_eq!(q[17], 4, "3.5 rounds away from zero");
    }

    /// `round_div` against `floor(a / d + 0.5)` in f64, over the quotients both block types take
    /// (q4_0's negative ones too): every half step and a hair either side, for scales from
    /// subnormal f16 to the largest.
    #[test]
    fn round_div_is_the_nearest_quotient_half_up() {
        for d in [6e-8f32, 1e-5, 0.0071, 0.5, 1.0, 3.3, 127.0, 65504.0] {
            let d = f16::from_f32(d).to_f32();
            for k in -16..=256 {
                let mid = (k as f32 + 0.5) * d;
                for a in [
                    mid,
                    f32::from_bits(mid.to_bits() + 1),
                    f32::from_bits(mid.to_bits().saturating_sub(1)),
                    k as f32 * d,
                ] {
                    let want = (a as f64 / d as f64 + 0.5).floor();
                    assert_eq!(round_div(a, d) as f64, want, "{a} / {d}");
                }
            }
        }
    }

    /// q4_0 against its definition in f64: d = m / -8 stored as f16 (llama.cpp's scale), then
    /// clamp(floor(x / d + 8.5), 0, 15) with that stored d.
    #[test]
    fn q4_0_follows_the_reference_definition() {
        // Exact ties: a first largest value of -8 makes the scale 1.
        let ties: [f32; 32] =
            std::array::from_fn(|i| if i == 0 { -8.0 } else { i as f32 * 0.5 - 8.0 });
        for x in &blocks(5, ties) {
            let (d_bits, q) = quantize_q4(x);
            let m = x
                .iter()
                .fold(0f32, |m, &v| if v.abs() > m.abs() { v } else { m });
            let d = f16::from_f32(m * -0.125);
            let d = if d.is_infinite() {
                f16::MAX.to_f32().copysign(d.to_f32())
            } else {
                d.to_f32()
            };
            assert_eq!(f16::from_bits(d_bits as u16).to_f32(), d);
            for (&v, &q) in x.iter().zip(&q) {
                let want = if d == 0.0 {
                    8.0
                } else {
                    (v as f64 / d as f64 + 8.5).floor().clamp(0.0, 15.0)
                };
                assert_eq!(q as f64, want, "{v} with scale {d}");
            }
        }
        // An infinity is f32::MAX: after -f32::MAX of the same magnitude it is not the first
        // largest, and the scale stays positive (-f32::MAX / -8, saturated).
        let mut x = [0f32; 32];
        x[0] = -f32::MAX;
        x[1] = f32::INFINITY;
        assert_eq!(quantize_q4(&x).0, 0x7bff);
    }

    /// An fp8 encoder against a search over its `finite` codes (`decode`d): the nearest, ties to
    /// the even code, saturating at the largest; on `xs` and on every midpoint between neighbouring
    /// codes and a hair either side.
    fn nearest_even_codes(
        encode: fn(f32) -> u32,
        decode: fn(u32) -> f32,
        finite: u32,
        mut xs: Vec<f32>,
    ) {
        let codes: Vec<(u32, f64)> = (0..finite).map(|b| (b, decode(b) as f64)).collect();
        let max = codes[codes.len() - 1].1;
        for w in codes.windows(2) {
            let mid = ((w[0].1 + w[1].1) / 2.0) as f32;
            xs.extend([
                mid,
                f32::from_bits(mid.to_bits() + 1),
                f32::from_bits(mid.to_bits() - 1),
            ]);
        }
        for x in xs {
            let a = (x as f64).abs().min(max);
            let best = codes
                .iter()
                .min_by(|p, q| {
                    let (dp, dq) = ((p.1 - a).abs(), (q.1 - a).abs());
                    dp.partial_cmp(&dq).unwrap().then((p.0 & 1).cmp(&(q.0 & 1)))
                })
                .unwrap();
            let sign = if x.is_sign_negative() { 0x80 } else { 0 };
            assert_eq!(encode(x), best.0 | sign, "{x}");
        }
    }

    #[test]
    fn e4m3_rounds_to_the_nearest_even_code_and_saturates() {
        assert_eq!(e4m3_to_f32(0x7e), 448.0);
        assert_eq!(e4m3_to_f32(0x01), 1.0 / 512.0);
        assert!(e4m3_to_f32(0x7f).is_nan() && e4m3_to_f32(0xff).is_nan());
        let mut xs = any_floats(20_000, 7);
        xs.extend(crate::reference::pseudo_random(8, 20_000, 500.0));
        nearest_even_codes(f32_to_e4m3, e4m3_to_f32, 0x7f, xs);
        assert_eq!(f32_to_e4m3(f32::INFINITY), 0x7e);
        assert_eq!(f32_to_e4m3(f32::NEG_INFINITY), 0xfe);
        assert_eq!(f32_to_e4m3(-f32::NAN), 0xff);
    }

    #[test]
    fn e5m2_rounds_to_the_nearest_even_code_and_saturates() {
        assert_eq!(e5m2_to_f32(0x7b), 57344.0);
        assert_eq!(e5m2_to_f32(0x01), 1.0 / 65536.0);
        assert_eq!(e5m2_to_f32(0x3c), 1.0);
        assert!(e5m2_to_f32(0x7f).is_nan() && e5m2_to_f32(0xff).is_nan());
        let mut xs = any_floats(20_000, 9);
        xs.extend(crate::reference::pseudo_random(10, 20_000, 60_000.0));
        xs.extend(crate::reference::pseudo_random(11, 20_000, 1e-4));
        // Finite codes only (0x7c is infinity, 0x7d-0x7f NaN).
        nearest_even_codes(f32_to_e5m2, e5m2_to_f32, 0x7c, xs);
        assert_eq!(f32_to_e5m2(f32::INFINITY), 0x7b);
        assert_eq!(f32_to_e5m2(f32::NEG_INFINITY), 0xfb);
        assert_eq!(f32_to_e5m2(-f32::NAN), 0xff);
        assert_eq!(f32_to_e5m2(-0.0), 0x80);
        // Every code decodes and encodes back to itself (NaN to the canonical 0x7f).
        for b in 0..=0xffu32 {
            let back = f32_to_e5m2(e5m2_to_f32(b));
            let want = match b & 0x7f {
                0x7c => (b & 0x80) | 0x7b,
                0x7d..=0x7f => (b & 0x80) | 0x7f,
                _ => b,
            };
            assert_eq!(back, want, "{b:#x}");
        }
    }

    /// The product `prescaled` computes without subnormal operands, overflow or infinities gives
    /// the fp8 code of the plain IEEE product, for finite inputs of every kind (subnormals, and
    /// magnitudes whose product overflows), at scales from 2^-125 to 2^125; it is never infinite,
    /// and where both operands of the subnormal path are exact it is the plain product itself.
    #[test]
    fn prescaled_gives_the_codes_of_the_plain_product() {
        let mut xs = any_floats(20_000, 12);
        let mut rng = crate::reference::Xorshift::new(13);
        // Subnormals of every size, both signs; the extremes.
        for _ in 0..5_000 {
            let m = rng.below(1 << 23) as u32;
            xs.extend([f32::from_bits(m), f32::from_bits(0x8000_0000 | m)]);
        }
        xs.extend([
            f32::MAX,
            -f32::MAX,
            f32::MIN_POSITIVE,
            0.0,
            -0.0,
            1.0,
            -448.0,
            65504.0,
        ]);
        let invs = [
            (2f32).powi(125),
            (2f32).powi(110),
            (2f32).powi(23),
            250.0,
            1.0,
            0.7,
            (2f32).powi(-110),
            (2f32).powi(-111),
            (2f32).powi(-125),
            f32::from_bits(0x5ef0_1234),
            f32::from_bits(0x0123_4567),
        ];
        for inv in invs {
            assert!(inv.is_normal() && inv > 0.0);
            for &x in &xs {
                let (got, plain) = (prescaled(x, inv), x * inv);
                assert!(got.is_finite(), "{x:e} x {inv:e}: {got}");
                for encode in [f32_to_e4m3, f32_to_e5m2] {
                    assert_eq!(encode(got), encode(plain), "{x:e} x {inv:e}: {got:e}");
                }
                if plain.is_finite() && plain.abs() < 65536.0 && got != 0.0 {
                    assert_eq!(got.to_bits(), plain.to_bits(), "{x:e} x {inv:e}");
                }
            }
        }
        assert!(prescaled(f32::NAN, 250.0).is_nan());
        assert_eq!(prescaled(f32::INFINITY, 1e-30), f32::INFINITY);
        assert_eq!(prescaled(f32::NEG_INFINITY, 1e30), f32::NEG_INFINITY);
        // An inverse scale no slot has (not positive and normal): the plain product, no panic.
        for inv in [
            -0.5,
            -2f32.powi(120),
            0.0,
            -0.0,
            1e-40,
            f32::INFINITY,
            f32::NAN,
        ] {
            for x in [1.0f32, -3.0, 1e-40, f32::MAX] {
                let (got, plain) = (prescaled(x, inv), x * inv);
                assert!(
                    got.to_bits() == plain.to_bits() || (got.is_nan() && plain.is_nan()),
                    "{x:e} x {inv:e}: {got}"
                );
            }
        }
    }

    #[test]
    fn scaled_fp8_multiplies_before_rounding_and_after_decoding() {
        let (scale, inv) = (0.004f32, inverse_scale(0.004));
        assert_eq!(inv, 1.0 / 0.004f32);
        let x = [
            1.0,
            -1.5,
            2.0,
            f32::NAN,
            -f32::NAN,
            f32::INFINITY,
            -1e-40,
            0.001,
        ];
        let bits = scaled_host_bits(HostData::F32(&x), DType::F8E4M3, Some(scale));
        let want: Vec<u32> = x
            .iter()
            .map(|&v| f32_to_e4m3(if v.is_nan() { v } else { v * inv }))
            .collect();
        assert_eq!(bits, want);
        // 2 / 0.004 = 500 saturates at 448; NaN keeps its sign; a tiny negative is -0.
        assert_eq!(&bits[2..7], &[0x7e, 0x7f, 0xff, 0x7e, 0x80]);
        // f16 and bf16 data take the same path through f32.
        let h: Vec<f16> = x.iter().map(|&v| f16::from_f32(v)).collect();
        let via_f32: Vec<f32> = h.iter().map(|v| v.to_f32()).collect();
        assert_eq!(
            scaled_host_bits(HostData::F16(&h), DType::F8E4M3, Some(scale)),
            scaled_host_bits(HostData::F32(&via_f32), DType::F8E4M3, Some(scale))
        );
        // Encoding stores the same bytes; decoding multiplies by the scale.
        let mut out = Vec::new();
        encode_rows(HostData::F32(&x), DType::F8E4M3, 8, Some(scale), &mut out);
        let words: Vec<u32> = bytemuck::pod_collect_to_vec(&out);
        assert_eq!(words, pack_rows(&bits, DType::F8E4M3, 8));
        let values = decode_scaled_rows(&words, DType::F8E4M3, 8, Some(scale));
        // 1 / 0.004 = 250 is stored as 256, the nearest e4m3.
        assert_eq!(values[0], 256.0 * scale);
        assert_eq!(values[2], 448.0 * scale);
        assert_eq!(values[6].to_bits(), (-0.0f32).to_bits());
        assert!(values[3].is_nan() && values[4].is_nan() && values[4].is_sign_negative());
        // Without a scale, nothing changes.
        assert_eq!(
            scaled_host_bits(HostData::F32(&x), DType::F8E4M3, None),
            host_bits(HostData::F32(&x), DType::F8E4M3)
        );
    }

    #[test]
    fn quantized_rows_round_trip_through_their_layout() {
        for dtype in DType::QUANTIZED {
            let x = crate::reference::pseudo_random(9, 96 * 3, 2.0);
            let bits: Vec<u32> = x.iter().map(|&v| f32_to_bits(v, dtype)).collect();
            let words = pack_rows(&bits, dtype, 96);
            assert_eq!(words.len() as u64 * 4, 3 * dtype.row_bytes(96).unwrap());
            let back = decode_rows(&words, dtype, 96);
            assert_eq!(back.len(), x.len());
            // Stored values re-quantize to themselves.
            let again: Vec<u32> = back.iter().map(|&v| f32_to_bits(v, dtype)).collect();
            assert_eq!(pack_rows(&again, dtype, 96), words, "{dtype}");
            // Blocks of odd widths (refused by specs) are padded here, never a panic.
            let _ = pack_rows(&bits[..50], dtype, 50);
            let _ = unpack_rows(&words, dtype, 50);
        }
        assert_eq!(DType::Q8_0.row_bytes(1024), Some(1088));
        assert_eq!(DType::Q4_0.row_bytes(1024), Some(576));
        assert_eq!(DType::Q4_0.row_bytes(32), Some(20));
        assert_eq!(DType::Q8_0.row_bytes(48), None);
        assert_eq!(DType::F8E4M3.row_bytes(5), Some(8));
        for d in DType::STORAGE {
            assert_eq!(DType::parse(&d.to_string()), Some(d));
        }
    }
}
