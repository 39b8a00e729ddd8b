//! Element types and their stored encodings: the one place that knows how a value becomes stored bits,
//! how rows are packed into 32-bit words and padded, and how they come back. The cache, the CPU twins
//! and the errors speak through it; a storage encoding with block scales would change only this file's
//! row sizes and packing, since callers ask for a row's stored bytes, never for an element's.

use std::fmt;

use half::{bf16, f16};

/// Element type of the stored cache. 16-bit types are packed two to a `u32` word.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    F16,
    BF16,
}

impl DType {
    /// Every element type, for tests and tools that cover them all.
    pub const ALL: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
        }
    }

    /// The code the WGSL kernels use for this type (`0` f32, `1` f16, `2` bf16).
    pub(crate) const fn code(self) -> u32 {
        match self {
            DType::F32 => 0,
            DType::F16 => 1,
            DType::BF16 => 2,
        }
    }

    /// Parses `f32`, `f16` or `bf16`.
    pub fn parse(s: &str) -> Option<DType> {
        match s.to_ascii_lowercase().as_str() {
            "f32" => Some(DType::F32),
            "f16" => Some(DType::F16),
            "bf16" => Some(DType::BF16),
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
        })
    }
}

/// Elements in one row of the given trailing shape (rank 0 is one element).
pub(crate) fn row_elems(trailing: &[usize]) -> Option<usize> {
    trailing
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
}

/// Bytes of one stored row: elements times element size, padded up to a 4-byte word.
pub(crate) fn padded_row_bytes(elems: usize, dtype: DType) -> u64 {
    (elems as u64)
        .saturating_mul(dtype.size() as u64)
        .div_ceil(4)
        .saturating_mul(4)
}

/// Host data for one slab: f32 (converted to the storage type) or data already in the storage type.
#[derive(Clone, Copy, Debug)]
pub enum HostData<'a> {
    F32(&'a [f32]),
    F16(&'a [f16]),
    BF16(&'a [bf16]),
}

impl HostData<'_> {
    pub fn dtype(&self) -> DType {
        match self {
            HostData::F32(_) => DType::F32,
            HostData::F16(_) => DType::F16,
            HostData::BF16(_) => DType::BF16,
        }
    }

    pub fn len(&self) -> usize {
        match self {
            HostData::F32(d) => d.len(),
            HostData::F16(d) => d.len(),
            HostData::BF16(d) => d.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Bits of `x` stored as `dtype` (low 16 bits for 16-bit types).
pub fn f32_to_bits(x: f32, dtype: DType) -> u32 {
    match dtype {
        DType::F32 => x.to_bits(),
        DType::F16 => f16::from_f32(x).to_bits() as u32,
        DType::BF16 => bf16::from_f32(x).to_bits() as u32,
    }
}

/// The f32 value of bits stored as `dtype`.
pub fn bits_to_f32(bits: u32, dtype: DType) -> f32 {
    match dtype {
        DType::F32 => f32::from_bits(bits),
        DType::F16 => f16::from_bits(bits as u16).to_f32(),
        DType::BF16 => bf16::from_bits(bits as u16).to_f32(),
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

/// `x` rounded through the storage type, as a read of the cache returns it.
pub fn round_trip(x: f32, dtype: DType) -> f32 {
    bits_to_f32(f32_to_bits(x, dtype), dtype)
}

/// Packs row-major element bits (one element per entry) into stored words: whole rows of `row_elems`
/// elements, 16-bit types two per word low half first, each row padded to a whole word.
pub fn pack_rows(bits: &[u32], dtype: DType, row_elems: usize) -> Vec<u32> {
    if dtype == DType::F32 {
        return bits.to_vec();
    }
    if row_elems == 0 {
        return Vec::new();
    }
    let row_words = row_elems.div_ceil(2);
    let rows = bits.len().checked_div(row_elems).unwrap_or(0);
    let mut out = vec![0u32; rows * row_words];
    for (r, row) in bits.chunks_exact(row_elems).enumerate() {
        for (e, &b) in row.iter().enumerate() {
            out[r * row_words + e / 2] |= (b & 0xffff) << (16 * (e % 2));
        }
    }
    out
}

/// Inverse of [`pack_rows`]: element bits of every whole row, padding dropped.
pub fn unpack_rows(words: &[u32], dtype: DType, row_elems: usize) -> Vec<u32> {
    if dtype == DType::F32 {
        return words.to_vec();
    }
    let row_words = row_elems.div_ceil(2).max(1);
    words
        .chunks_exact(row_words)
        .flat_map(|row| (0..row_elems).map(move |e| (row[e / 2] >> (16 * (e % 2))) & 0xffff))
        .collect()
}

/// Stored words to f32 values, `[rows, row_elems]` row-major.
pub fn decode_rows(words: &[u32], dtype: DType, row_elems: usize) -> Vec<f32> {
    unpack_rows(words, dtype, row_elems)
        .into_iter()
        .map(|b| bits_to_f32(b, dtype))
        .collect()
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
/// words), else encoded into `scratch`.
pub(crate) fn stored_bytes<'a>(
    data: HostData<'a>,
    storage: DType,
    row_elems: usize,
    scratch: &'a mut Vec<u8>,
) -> &'a [u8] {
    let unpadded = (row_elems * storage.size()).is_multiple_of(4);
    match data {
        HostData::F32(d) if storage == DType::F32 => bytemuck::cast_slice(d),
        HostData::F16(d) if storage == DType::F16 && unpadded => bytemuck::cast_slice(d),
        HostData::BF16(d) if storage == DType::BF16 && unpadded => bytemuck::cast_slice(d),
        data => {
            encode_rows(data, storage, row_elems, scratch);
            scratch
        }
    }
}

/// Encodes host rows into the stored byte layout, reusing `out`'s allocation.
pub(crate) fn encode_rows(data: HostData<'_>, storage: DType, row_elems: usize, out: &mut Vec<u8>) {
    out.clear();
    let row_bytes = padded_row_bytes(row_elems, storage) as usize;
    let rows = data.len().checked_div(row_elems).unwrap_or(0);
    out.resize(rows * row_bytes, 0);
    let esize = storage.size();
    let mut put = |i: usize, bits: u32| {
        let (r, e) = (i / row_elems, i % row_elems);
        let at = r * row_bytes + e * esize;
        out[at..at + esize].copy_from_slice(&bits.to_le_bytes()[..esize]);
    };
    match data {
        HostData::F32(d) => d
            .iter()
            .enumerate()
            .for_each(|(i, &x)| put(i, f32_to_bits(x, storage))),
        HostData::F16(d) => d
            .iter()
            .enumerate()
            .for_each(|(i, x)| put(i, x.to_bits() as u32)),
        HostData::BF16(d) => d
            .iter()
            .enumerate()
            .for_each(|(i, x)| put(i, x.to_bits() as u32)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encode_rows_pads_16_bit_rows() {
        let mut out = Vec::new();
        encode_rows(HostData::F32(&[1.0, 2.0, 3.0]), DType::BF16, 3, &mut out);
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
}
