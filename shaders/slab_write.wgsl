// Slab-write kernel: copies `n_rows` rows from a strided GPU source into consecutive rows of one slot
// buffer, converting the element type. One invocation writes one 32-bit word of the destination, so the
// two halves of a packed 16-bit word are never written by two invocations. All conversions are done on
// the bit patterns with integer arithmetic: exact, round-to-nearest-even, no flush of subnormals.

// Element type codes, as `DType::code` in src/spec.rs.
const F32: u32 = 0u;
const F16: u32 = 1u;
const BF16: u32 = 2u;

override SRC_DTYPE: u32 = 0u;
override DST_DTYPE: u32 = 0u;

// Must match `WriteParams` in src/kernels.rs.
struct WriteParams {
    // Element index of row 0, element 0, relative to the start of the bound source range.
    src_offset: u32,
    // Source elements between consecutive rows.
    seq_stride: u32,
    n_rows: u32,
    // Elements per destination row.
    row_elems: u32,
    // Words per destination row (padded).
    row_words: u32,
    // Word of the destination where the first row starts.
    dst_word_offset: u32,
    // Number of trailing dimensions described in `shape` / `stride` (0 to 8).
    rank: u32,
    // Invocations in the dispatch: the loop stride.
    thread_stride: u32,
    shape: array<vec4<u32>, 2>,
    stride: array<vec4<u32>, 2>,
}

@group(0) @binding(0) var<storage, read> src: array<u32>;
@group(0) @binding(1) var<storage, read_write> dst: array<u32>;
@group(0) @binding(2) var<uniform> p: WriteParams;

// Source element index of element `e` (row-major over the trailing shape) of row `row`.
fn src_index(row: u32, e: u32) -> u32 {
    var rem = e;
    var idx = p.src_offset + row * p.seq_stride;
    for (var d = p.rank; d > 0u; d -= 1u) {
        let k = d - 1u;
        let n = p.shape[k / 4u][k % 4u];
        idx += (rem % n) * p.stride[k / 4u][k % 4u];
        rem /= n;
    }
    return idx;
}

// Raw bits of source element `i`; 16-bit elements are packed low half first. Out of range reads 0.
fn load_bits(i: u32) -> u32 {
    if SRC_DTYPE == F32 {
        if i >= arrayLength(&src) {
            return 0u;
        }
        return src[i];
    }
    let w = i >> 1u;
    if w >= arrayLength(&src) {
        return 0u;
    }
    return (src[w] >> ((i & 1u) * 16u)) & 0xffffu;
}

fn f16_to_f32_bits(h: u32) -> u32 {
    let sign = (h & 0x8000u) << 16u;
    let exp = (h >> 10u) & 0x1fu;
    let man = h & 0x3ffu;
    if exp == 0x1fu {
        if man == 0u {
            return sign | 0x7f800000u;
        }
        return sign | 0x7fc00000u | (man << 13u);
    }
    if exp == 0u {
        if man == 0u {
            return sign;
        }
        // Subnormal: shift the mantissa up to its hidden bit, lowering the exponent each step.
        var m = man;
        var e = 113u;
        while (m & 0x400u) == 0u {
            m <<= 1u;
            e -= 1u;
        }
        return sign | (e << 23u) | ((m & 0x3ffu) << 13u);
    }
    return sign | ((exp + 112u) << 23u) | (man << 13u);
}

fn f32_to_f16_bits(x: u32) -> u32 {
    let sign = (x >> 16u) & 0x8000u;
    let exp = x & 0x7f800000u;
    let man = x & 0x007fffffu;
    if exp == 0x7f800000u {
        var nan_bit = 0u;
        if man != 0u {
            nan_bit = 0x200u;
        }
        return sign | 0x7c00u | nan_bit | (man >> 13u);
    }
    let half_exp = i32(exp >> 23u) - 127 + 15;
    if half_exp >= 0x1f {
        return sign | 0x7c00u;
    }
    if half_exp <= 0 {
        if 14 - half_exp > 24 {
            return sign;
        }
        let full = man | 0x00800000u;
        var half_man = full >> u32(14 - half_exp);
        let round_bit = 1u << u32(13 - half_exp);
        if (full & round_bit) != 0u && (full & (3u * round_bit - 1u)) != 0u {
            half_man += 1u;
        }
        return sign | half_man;
    }
    let bits = sign | (u32(half_exp) << 10u) | (man >> 13u);
    let round_bit = 0x1000u;
    if (man & round_bit) != 0u && (man & (3u * round_bit - 1u)) != 0u {
        return bits + 1u;
    }
    return bits;
}

fn bf16_to_f32_bits(b: u32) -> u32 {
    // A NaN gets its quiet bit set, as the host conversion does.
    if (b & 0x7fffu) > 0x7f80u {
        return (b | 0x40u) << 16u;
    }
    return b << 16u;
}

fn f32_to_bf16_bits(x: u32) -> u32 {
    if (x & 0x7fffffffu) > 0x7f800000u {
        return (x >> 16u) | 0x40u;
    }
    let round_bit = 0x8000u;
    if (x & round_bit) != 0u && (x & (3u * round_bit - 1u)) != 0u {
        return (x >> 16u) + 1u;
    }
    return x >> 16u;
}

// Source element bits converted to the destination type's bits.
fn convert(bits: u32) -> u32 {
    if SRC_DTYPE == DST_DTYPE {
        return bits;
    }
    var f = bits;
    if SRC_DTYPE == F16 {
        f = f16_to_f32_bits(bits);
    } else if SRC_DTYPE == BF16 {
        f = bf16_to_f32_bits(bits);
    }
    if DST_DTYPE == F16 {
        return f32_to_f16_bits(f);
    }
    if DST_DTYPE == BF16 {
        return f32_to_bf16_bits(f);
    }
    return f;
}

fn element(row: u32, e: u32) -> u32 {
    return convert(load_bits(src_index(row, e)));
}

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let total = p.n_rows * p.row_words;
    let dst_len = arrayLength(&dst);
    for (var w = gid.x; w < total; w += p.thread_stride) {
        let row = w / p.row_words;
        let word = w % p.row_words;
        var out = 0u;
        if DST_DTYPE == F32 {
            out = element(row, word);
        } else {
            let e = word * 2u;
            out = element(row, e);
            if e + 1u < p.row_elems {
                out |= element(row, e + 1u) << 16u;
            }
        }
        let d = p.dst_word_offset + w;
        if d < dst_len {
            dst[d] = out;
        }
    }
}
