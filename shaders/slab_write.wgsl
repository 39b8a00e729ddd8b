// Slab-write kernel: copies `n_rows` rows from a strided GPU source into rows of one slot buffer,
// converting the element type: consecutive rows from `dst_word_offset` on, or, in the scatter variant,
// row `r` into the destination row that entry `map_word + r` of `rows` names (a paged pool's page
// rows, for the rows of many sequences in one dispatch). One invocation writes one 32-bit word of the
// destination, so the two halves of a packed 16-bit word are never written by two invocations. All
// conversions are done on the bit patterns with integer arithmetic: exact, round-to-nearest-even, no
// flush of subnormals. Quantized storage is written by `main_quant` (one invocation per pair of blocks
// or per fp8 word) from element sources, or moved as stored words by `main` when the source already
// holds stored rows (an upload of host rows the CPU quantized).

override SRC_DTYPE: u32 = 0u;
override DST_DTYPE: u32 = 0u;
override SCATTER: bool = false;

// Must match `WriteParams` in src/kernels/params.rs.
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
    // Scatter variant: the entry of `rows` holding row 0's destination row.
    map_word: u32,
    // A scaled fp8 destination: the bits of 1 / scale, which values are multiplied by before rounding
    // (NaN kept as it is); 0 otherwise.
    inv_scale: u32,
    _pad1: u32,
    _pad2: u32,
    shape: array<vec4<u32>, 2>,
    stride: array<vec4<u32>, 2>,
}

@group(0) @binding(0) var<storage, read> src: array<u32>;
@group(0) @binding(1) var<storage, read_write> dst: array<u32>;
// Destination rows of the scatter variant (a placeholder otherwise); the host wrote every entry the
// dispatch reads.
@group(0) @binding(2) var<storage, read> rows: array<u32>;
@group(1) @binding(0) var<uniform> p: WriteParams;

// The same two buffers seen as 16-byte vectors, for `main_vec4`.
@group(0) @binding(0) var<storage, read> src4: array<vec4<u32>>;
@group(0) @binding(1) var<storage, read_write> dst4: array<vec4<u32>>;

// Source element index of element `e` (row-major over the trailing shape) of row `row`.
fn src_index(row: u32, e: u32) -> u32 {
    var idx = p.src_offset + row * p.seq_stride;
    if p.rank <= 1u {
        // One strided run per row, the usual case once contiguous axes are merged (a fused QKV slice,
        // a contiguous slab): no division.
        return idx + e * p.stride[0].x;
    }
    var rem = e;
    for (var d = p.rank; d > 0u; d -= 1u) {
        let k = d - 1u;
        let n = p.shape[k / 4u][k % 4u];
        idx += (rem % n) * p.stride[k / 4u][k % 4u];
        rem /= n;
    }
    return idx;
}

// Raw bits of source element `i`; 16-bit elements are packed low half first. The host checked that
// every source element lies in the bound range, and reads out of range are defined in WGSL (they return
// some value of the buffer, or zero), so there is no check here: a branch per load costs on SIMD
// adapters.
fn load_bits(i: u32) -> u32 {
    if SRC_DTYPE == F32 {
        return src[i];
    }
    return (src[i >> 1u] >> ((i & 1u) * 16u)) & 0xffffu;
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

// Branch-free, so the lanes of a SIMD group never diverge: every case is computed and one selected.
fn f32_to_f16_bits(x: u32) -> u32 {
    let sign = (x >> 16u) & 0x8000u;
    let a = x & 0x7fffffffu;
    let man = a & 0x007fffffu;
    // Normal result (|x| >= 2^-14): rebias the exponent and round to nearest even on bit 13; the
    // carry of the rounding may step into the exponent, and anything from 65520 up becomes infinity.
    let n = a - 0x38000000u;
    let normal = min((n + 0xfffu + ((n >> 13u) & 1u)) >> 13u, 0x7c00u);
    // Subnormal result: shift the mantissa with its hidden bit right, round to nearest even. Shifts
    // past 24 leave zero, as they must.
    let shift = u32(clamp(126 - i32(a >> 23u), 1, 31));
    let full = man | 0x00800000u;
    let round_bit = 1u << (shift - 1u);
    let up = select(0u, 1u, (full & round_bit) != 0u && (full & (3u * round_bit - 1u)) != 0u);
    let sub = (full >> shift) + up;
    var bits = select(sub, normal, a >= 0x38800000u);
    // NaN: quiet, keeping the top mantissa bits.
    bits = select(bits, 0x7e00u | (man >> 13u), a > 0x7f800000u);
    return sign | bits;
}

fn bf16_to_f32_bits(b: u32) -> u32 {
    // A NaN gets its quiet bit set, as the host conversion does.
    if (b & 0x7fffu) > 0x7f80u {
        return (b | 0x40u) << 16u;
    }
    return b << 16u;
}

fn f32_to_bf16_bits(x: u32) -> u32 {
    // Round to nearest even on bit 16; a NaN is made quiet instead.
    let rounded = (x + 0x7fffu + ((x >> 16u) & 1u)) >> 16u;
    return select(rounded, (x >> 16u) | 0x40u, (x & 0x7fffffffu) > 0x7f800000u);
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

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let total = p.n_rows * p.row_words;
    let dst_len = arrayLength(&dst);
    for (var w = gid.x; w < total; w += p.thread_stride) {
        let row = w / p.row_words;
        let word = w - row * p.row_words;
        var out = 0u;
        if DST_DTYPE == F32 {
            // f32 (or stored words of any type, which host scatters move as f32 elements).
            out = convert(load_bits(src_index(row, word)));
        } else {
            // Two elements per word; the second one's index follows from the first in the usual
            // one-run case.
            let e = word * 2u;
            let i0 = src_index(row, e);
            if SRC_DTYPE == DST_DTYPE && p.rank <= 1u && p.stride[0].x == 1u && (i0 & 1u) == 0u {
                // Both elements in one source word, stored as they are: one load. A row of odd
                // length keeps its padding half zero.
                out = src[i0 >> 1u];
                if e + 1u >= p.row_elems {
                    out &= 0xffffu;
                }
            } else {
                out = convert(load_bits(i0));
                if e + 1u < p.row_elems {
                    var i1 = i0 + p.stride[0].x;
                    if p.rank > 1u {
                        i1 = src_index(row, e + 1u);
                    }
                    out |= convert(load_bits(i1)) << 16u;
                }
            }
        }
        var d = p.dst_word_offset + w;
        if SCATTER {
            d = rows[p.map_word + row] * p.row_words + word;
        }
        if d < dst_len {
            dst[d] = out;
        }
    }
}

// The 16-byte path, chosen by the host for an f32 source (or a 16-bit source of the storage type)
// whose rows are contiguous runs starting on 16-byte boundaries, written to rows of whole 16-byte
// vectors: one invocation stores one vector of the destination (4 f32 or 8 packed 16-bit elements)
// from one or two vectors of the source.
@compute @workgroup_size(256)
fn main_vec4(@builtin(global_invocation_id) gid: vec3<u32>) {
    let row_vecs = p.row_words / 4u;
    let total = p.n_rows * row_vecs;
    let dst_len = arrayLength(&dst4);
    for (var v = gid.x; v < total; v += p.thread_stride) {
        let row = v / row_vecs;
        let c = v - row * row_vecs;
        let base = (p.src_offset + row * p.seq_stride) / 4u;
        var out: vec4<u32>;
        if SRC_DTYPE != F32 {
            // 16-bit elements of the storage type, 8 per vector, moved as they are.
            out = src4[(p.src_offset + row * p.seq_stride) / 8u + c];
            if 8u * c + 8u > p.row_elems {
                out.w &= 0xffffu;
            }
        } else if DST_DTYPE == F32 {
            out = src4[base + c];
        } else {
            let a = src4[base + 2u * c];
            let b = src4[base + 2u * c + 1u];
            out = vec4<u32>(
                convert(a.x) | (convert(a.y) << 16u),
                convert(a.z) | (convert(a.w) << 16u),
                convert(b.x) | (convert(b.y) << 16u),
                convert(b.z) | (convert(b.w) << 16u),
            );
            // A row of 8k - 1 elements ends in a padding half, which stays zero as on every other
            // path (the source element read for it belongs to the next row or to nothing).
            if 8u * c + 8u > p.row_elems {
                out.w &= 0xffffu;
            }
        }
        var d = p.dst_word_offset / 4u + v;
        if SCATTER {
            d = rows[p.map_word + row] * row_vecs + c;
        }
        if d < dst_len {
            dst4[d] = out;
        }
    }
}

// Source element `e` of row `row` as f32 bits.
fn src_f32_bits(row: u32, e: u32) -> u32 {
    let bits = load_bits(src_index(row, e));
    if SRC_DTYPE == F16 {
        return f16_to_f32_bits(bits);
    }
    if SRC_DTYPE == BF16 {
        return bf16_to_f32_bits(bits);
    }
    return bits;
}

// A value as the block types see it: NaN as 0, infinities as the largest finite f32 of their sign.
fn finite_at(row: u32, e: u32) -> f32 {
    let b = src_f32_bits(row, e);
    let a = b & 0x7fffffffu;
    if a > 0x7f800000u {
        return 0.0;
    }
    return bitcast<f32>(select(b, (b & 0x80000000u) | 0x7f7fffffu, a == 0x7f800000u));
}

// fp8 of f32 bits, as `f32_to_fp8` in src/codec.rs: round to nearest even, saturating at the largest
// finite code `max` (infinities included), NaN kept (0x7f with the sign). The format: f32 bits of its
// smallest normal, the rebias of its exponent, the mantissa bits f32 has beyond it, and the shift
// base of its subnormals. The dtype's are constants, so each pipeline folds them.
fn f32_to_fp8(b: u32, min_normal: u32, rebias: u32, drop: u32, max: u32, sub: i32) -> u32 {
    let sign = (b >> 24u) & 0x80u;
    let a = b & 0x7fffffffu;
    if a > 0x7f800000u {
        return sign | 0x7fu;
    }
    if a >= min_normal {
        let n = a - (rebias << 23u);
        return sign | min((n + ((1u << (drop - 1u)) - 1u) + ((n >> drop) & 1u)) >> drop, max);
    }
    let shift = u32(clamp(sub - i32(a >> 23u), 1, 31));
    let full = (a & 0x007fffffu) | 0x00800000u;
    let round_bit = 1u << (shift - 1u);
    let up = select(0u, 1u, (full & round_bit) != 0u && (full & (3u * round_bit - 1u)) != 0u);
    return sign | ((full >> shift) + up);
}

// fp8 of the destination type (e4m3: max 448; e5m2: max 57344) of f32 bits.
fn f32_to_dst_fp8(b: u32) -> u32 {
    if DST_DTYPE == F8E5M2 {
        return f32_to_fp8(b, 0x38800000u, 112u, 21u, 0x7bu, 134);
    }
    return f32_to_fp8(b, 0x3c800000u, 120u, 20u, 0x7eu, 141);
}

// f16 bits of a block scale: saturating at +-65504, and a zero scale is +0 whatever its sign.
fn scale_bits(d: f32) -> u32 {
    let h = f32_to_f16_bits(bitcast<u32>(d));
    if (h & 0x7fffu) == 0u {
        return 0u;
    }
    return select(h, h - 1u, (h & 0x7fffu) == 0x7c00u);
}

// floor(a / d + 0.5) for d > 0 and a small quotient, decided by exact products around an estimate
// (as `round_div` in codec.rs).
fn round_div(a: f32, d: f32) -> i32 {
    var q = i32(floor(a * (1.0 / d) + 0.5));
    let hi = (f32(q) + 0.5) * d;
    let lo = (f32(q) - 0.5) * d;
    if a >= hi {
        q += 1;
    } else if a < lo {
        q -= 1;
    }
    return q;
}

fn put(d: u32, w: u32, len: u32) {
    if d < len {
        dst[d] = w;
    }
}

// Quantizes block `b` of row `row` into the row at word `base` (its value words) and returns the
// block's scale bits.
fn quantize_block(row: u32, b: u32, base: u32, len: u32) -> u32 {
    var x: array<f32, 32>;
    for (var i = 0u; i < 32u; i++) {
        x[i] = finite_at(row, 32u * b + i);
    }
    if DST_DTYPE == Q8_0 {
        var amax = 0.0;
        for (var i = 0u; i < 32u; i++) {
            amax = max(amax, abs(x[i]));
        }
        // amax * (1 / 127), the constant spelled by its bits as in codec.rs.
        let d_bits = scale_bits(amax * bitcast<f32>(0x3c010204u));
        let d = bitcast<f32>(f16_to_f32_bits(d_bits));
        for (var w = 0u; w < 8u; w++) {
            var out = 0u;
            for (var j = 0u; j < 4u; j++) {
                let v = x[4u * w + j];
                let a = abs(v);
                var m = 0;
                if d != 0.0 {
                    m = select(clamp(round_div(a, d), 0, 127), 127, a >= 126.5 * d);
                }
                m = select(m, -m, v < 0.0);
                out |= (u32(m) & 0xffu) << (8u * j);
            }
            put(base + 8u * b + w, out, len);
        }
        return d_bits;
    }
    // q4_0: the first element of largest magnitude sets the scale m / -8.
    var amax = 0.0;
    var mx = 0.0;
    for (var i = 0u; i < 32u; i++) {
        if abs(x[i]) > amax {
            amax = abs(x[i]);
            mx = x[i];
        }
    }
    let d_bits = scale_bits(mx * -0.125);
    let d = bitcast<f32>(f16_to_f32_bits(d_bits));
    let ad = abs(d);
    for (var w = 0u; w < 4u; w++) {
        var out = 0u;
        for (var j = 0u; j < 8u; j++) {
            let v = x[8u * w + j];
            var q = 8;
            if d != 0.0 {
                let y = select(-v, v, d > 0.0);
                var k = round_div(y, ad);
                k = select(k, 7, y >= 6.5 * ad);
                k = select(k, -8, y < -7.5 * ad);
                q = clamp(k, -8, 7) + 8;
            }
            out |= u32(q) << (4u * j);
        }
        put(base + 4u * b + w, out, len);
    }
    return d_bits;
}

// f32 bits `x` times a scaled fp8 slot's inverse scale (bits `inv`, positive and normal, of biased
// exponent e), as src/codec.rs's `prescaled` computes it: NaN and the infinities as they are; a
// magnitude above 2^(17 - k) for `inv` in [2^k, 2^(k+1)) (k = e - 127; biased exponent 271 - e)
// taken as that (its product is past every fp8 code, and finite); a subnormal through its integer
// mantissa, or zero where `inv` is below 2^23 (e <= 149); the
// product of the magnitude, with the sign put back. So no operand or result of the product is
// subnormal or infinite where the code depends on it, and an adapter that flushes subnormals or
// does not keep infinities stores the host's codes.
fn prescaled(x: u32, inv: u32) -> u32 {
    let mag = x & 0x7fffffffu;
    if mag >= 0x7f800000u {
        return x;
    }
    let e = inv >> 23u;
    var product = 0.0;
    if mag >= 0x00800000u {
        let limit = select((271u - e) << 23u, 0x7f7fffffu, e <= 16u);
        product = bitcast<f32>(min(mag, limit)) * bitcast<f32>(inv);
    } else if e > 149u {
        product = f32(mag) * bitcast<f32>(inv - (149u << 23u));
    }
    return (x & 0x80000000u) | bitcast<u32>(product);
}

// Quantized storage from a source of element type: one invocation writes one unit of a row: for
// q8_0 and q4_0 a pair of blocks (their values and the scale word they share), for fp8 one word of
// four elements.
@compute @workgroup_size(256)
fn main_quant(@builtin(global_invocation_id) gid: vec3<u32>) {
    let nb = p.row_elems / 32u;
    let units = select((nb + 1u) / 2u, p.row_words, is_fp8(DST_DTYPE));
    let total = p.n_rows * units;
    let len = arrayLength(&dst);
    for (var u = gid.x; u < total; u += p.thread_stride) {
        let row = u / units;
        let k = u - row * units;
        var base = p.dst_word_offset + row * p.row_words;
        if SCATTER {
            base = rows[p.map_word + row] * p.row_words;
        }
        if is_fp8(DST_DTYPE) {
            var out = 0u;
            for (var j = 0u; j < 4u; j++) {
                let e = 4u * k + j;
                if e < p.row_elems {
                    var x = src_f32_bits(row, e);
                    if p.inv_scale != 0u {
                        x = prescaled(x, p.inv_scale);
                    }
                    out |= f32_to_dst_fp8(x) << (8u * j);
                }
            }
            put(base + k, out, len);
        } else {
            let values = select(nb * 4u, nb * 8u, DST_DTYPE == Q8_0);
            var scales = 0u;
            for (var h = 0u; h < 2u; h++) {
                let b = 2u * k + h;
                if b < nb {
                    scales |= quantize_block(row, b, base, len) << (16u * h);
                }
            }
            put(base + values + k, scales, len);
        }
    }
}
