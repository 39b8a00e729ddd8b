// Attention, pass 1 of 2 (flash-decoding): one workgroup takes one chunk of the visible rows, one KV head
// and HB (up to 16) of the query heads that share it, for one query. It walks the chunk in tiles of 64 * RPL
// rows (each invocation scores RPL rows, so every query element it loads serves RPL rows) with a
// running-max softmax and writes its partial (max, sum) and unnormalised output per head; the
// reduce pass (attention_reduce.wgsl) merges the chunks. Every K / V element a workgroup reads is used
// by all of its heads, so a group of up to 16 query heads reads its KV once.
//
// The score of a row is `q_a · a + q_b · b` over two slots: GQA uses slot a = K and no b (d_b = 0); MLA
// uses a = compressed_kv and b = k_pe with one KV "head". Values come from slot v (V, or compressed_kv).
// 16-bit storage is read as packed words (low half first) and unpacked with integer bit operations
// (exact, subnormals included; no shader-f16 or packed-float built-in needed). Quantized storage
// (q8_0, q4_0, fp8; src/codec.rs) is dequantized four elements at a time, exactly as the CPU twin.
//
// The pipelines are built without WebGPU's zeroing of workgroup memory (see src/kernels/mod.rs): every
// workgroup variable here is written before it is read, by the same invocation or before a barrier.

// Storage types of slots a, b and v (K and V may differ).
override DTYPE_A: u32 = 0u;
override DTYPE_B: u32 = 0u;
override DTYPE_V: u32 = 0u;
// Query heads per workgroup: 1, 2, 4, 8 or 16, dividing the group. A constant per pipeline, so the
// per-head loops have fixed trip counts and their accumulators stay in registers.
override HB: u32 = 16u;
// Rows per invocation per tile: 32 / HB, at most 8 (RPL * HB <= 32), so a tile is 64 * RPL rows.
override RPL: u32 = 2u;
// Whether scores read slot b (MLA's k_pe): 0 for GQA, whose kernels then leave dot_b out (on a CPU
// adapter both ways of a branch run, masked, and the unused code cost compile time and speed).
override SLOT_B: u32 = 1u;
// How rows are found (shaders/shared/rows.wgsl): 0 one cache's visible rows, 1 one sequence of a
// paged pool through its page table, 2 a ragged batch of a pool's sequences.
override ROWS: u32 = 0u;

// Invocations per workgroup (TILE * RPL rows per tile) and most query heads per workgroup (HB <= HEADS).
const TILE: u32 = 64u;
const HEADS: u32 = 16u;
// Running max before the first row: the lowest finite f32 (written so that every WGSL compiler reads
// it as finite: Tint refuses a literal that rounds past f32::MAX), at or below every finite score, and
// exp(NEG - m) is 0 for any score m above it.
const NEG: f32 = -3.4028234e38;

// Group 0: the layer's slots (a bind group the cache owns); group 1: queries and scratch; group 2: the
// call's parameters.
@group(0) @binding(0) var<storage, read> slot_a: array<u32>;
@group(0) @binding(1) var<storage, read> slot_b: array<u32>;
@group(0) @binding(2) var<storage, read> slot_v: array<u32>;
@group(0) @binding(3) var<storage, read> table: array<u32>;
@group(1) @binding(0) var<storage, read> q_a: array<f32>;
@group(1) @binding(1) var<storage, read> q_b: array<f32>;
// Per (chunk, query, head): running max and sum.
@group(1) @binding(2) var<storage, read_write> stats: array<f32>;
// Per (chunk, query, head): unnormalised output [d_v].
@group(1) @binding(3) var<storage, read_write> part: array<f32>;
@group(2) @binding(0) var<uniform> p: AttnParams;

var<workgroup> scores: array<f32, 2048>; // [HB][TILE * RPL]
var<workgroup> run_max: array<f32, 16>;
var<workgroup> run_sum: array<f32, 16>;
var<workgroup> rescale: array<f32, 16>;
// Paged: the stored row of each row of the tile, for the value phase.
var<workgroup> tile_rows: array<u32, 512>;
// The query's own row and first page-table entry.
var<workgroup> query_row: vec2<u32>;

// An f16 subnormal (or zero), exactly.
fn f16_subnormal(h: u32) -> f32 {
    let mag = f32(h & 0x3ffu) * 5.9604644775390625e-8;
    return select(mag, -mag, (h & 0x8000u) != 0u);
}

// The low (hi = false) or high half of a packed word of type `t` as f32 (f16 for the block types'
// scales).
fn half_at(t: u32, w: u32, hi: bool) -> f32 {
    let h = select(w & 0xffffu, w >> 16u, hi);
    if t == BF16 {
        return bitcast<f32>(h << 16u);
    }
    let exp = h & 0x7c00u;
    if exp == 0u {
        return f16_subnormal(h);
    }
    let sign = (h & 0x8000u) << 16u;
    let mag = (h & 0x7fffu) << 13u;
    // Normal: rebias the exponent by 127 - 15; infinity and NaN: all exponent bits set.
    return bitcast<f32>(sign | select(mag + (112u << 23u), mag | 0x7f800000u, exp == 0x7c00u));
}

// fp8 e4m3 byte as f32 (exact; 0x7f / 0xff are NaN).
fn e4m3(b: u32) -> f32 {
    let sign = (b & 0x80u) << 24u;
    let e = (b >> 3u) & 0xfu;
    let m = b & 7u;
    if e == 0u {
        let v = f32(m) * 0.001953125;
        return select(v, -v, sign != 0u);
    }
    return bitcast<f32>(sign | select(((e + 120u) << 23u) | (m << 20u), 0x7fc00000u, e == 15u && m == 7u));
}

// Quantized rows of type `t`: the word holding element `i`'s value, and, in a row of `elems`
// elements, the word holding its block's scale (after the values).
fn qword(t: u32, i: u32) -> u32 {
    return select(i >> 2u, i >> 3u, t == Q4_0);
}

fn sword(t: u32, elems: u32, i: u32) -> u32 {
    return select(elems >> 2u, elems >> 3u, t == Q4_0) + (i >> 6u);
}

// Element `i` of a quantized row of type `t` from its value word `w` and scale word `s`.
fn deq(t: u32, w: u32, s: u32, i: u32) -> f32 {
    if t == F8E4M3 {
        return e4m3((w >> (8u * (i & 3u))) & 0xffu);
    }
    if t == F8E5M2 {
        // The top byte of an f16.
        return half_at(F16, ((w >> (8u * (i & 3u))) & 0xffu) << 8u, false);
    }
    let d = half_at(F16, s, ((i >> 5u) & 1u) == 1u);
    if t == Q8_0 {
        return f32(bitcast<i32>(w << (24u - 8u * (i & 3u))) >> 24u) * d;
    }
    return (f32((w >> (4u * (i & 7u))) & 0xfu) - 8.0) * d;
}

// Elements [i, i + 4) (i a multiple of 4) of a quantized row of type `t` from their value word and
// scale word.
fn deq4(t: u32, w: u32, s: u32, i: u32) -> vec4<f32> {
    if t == F8E4M3 {
        return vec4<f32>(e4m3(w & 0xffu), e4m3((w >> 8u) & 0xffu), e4m3((w >> 16u) & 0xffu), e4m3(w >> 24u));
    }
    if t == F8E5M2 {
        return vec4<f32>(half_at(F16, (w & 0xffu) << 8u, false), half_at(F16, w & 0xff00u, false),
            half_at(F16, (w >> 8u) & 0xff00u, false), half_at(F16, (w >> 16u) & 0xff00u, false));
    }
    let d = half_at(F16, s, ((i >> 5u) & 1u) == 1u);
    if t == Q8_0 {
        let v = vec4<i32>(bitcast<i32>(w << 24u), bitcast<i32>(w << 16u), bitcast<i32>(w << 8u), bitcast<i32>(w));
        return vec4<f32>(v >> vec4<u32>(24u)) * d;
    }
    let n = (vec4<u32>(w) >> (vec4<u32>(4u * (i & 7u)) + vec4<u32>(0u, 4u, 8u, 12u))) & vec4<u32>(0xfu);
    return (vec4<f32>(n) - vec4<f32>(8.0)) * d;
}

// fp8 numbers of a slot scaled by `k` as values (1 but for scaled slots).
fn scaled(t: u32, k: f32, v: vec4<f32>) -> vec4<f32> {
    if is_fp8(t) {
        return v * k;
    }
    return v;
}

// Elements [i, i + m) (m <= 4) of row `row` of quantized slot a, b or v, zero beyond.
fn quad_a(row: u32, i: u32, m: u32) -> vec4<f32> {
    let t = DTYPE_A;
    let base = row * p.row_words_a;
    let elems = p.n_kv * p.d_a;
    // Block types always take whole aligned quads (their widths are whole blocks): the fallback is
    // compiled for fp8 only.
    if !is_fp8(t) || (m == 4u && (i & 3u) == 0u) {
        var s = 0u;
        if !is_fp8(t) {
            s = slot_a[base + sword(t, elems, i)];
        }
        return scaled(t, p.slot_scales.x, deq4(t, slot_a[base + qword(t, i)], s, i));
    }
    // fp8 rows hold no scale words: none is read.
    var v = vec4<f32>(0.0);
    for (var k = 0u; k < m; k++) {
        v[k] = deq(t, slot_a[base + qword(t, i + k)], 0u, i + k);
    }
    return scaled(t, p.slot_scales.x, v);
}

fn quad_b(row: u32, i: u32, m: u32) -> vec4<f32> {
    let t = DTYPE_B;
    let base = row * p.row_words_b;
    let elems = p.n_kv * p.d_b;
    // Block types always take whole aligned quads (their widths are whole blocks): the fallback is
    // compiled for fp8 only.
    if !is_fp8(t) || (m == 4u && (i & 3u) == 0u) {
        var s = 0u;
        if !is_fp8(t) {
            s = slot_b[base + sword(t, elems, i)];
        }
        return scaled(t, p.slot_scales.y, deq4(t, slot_b[base + qword(t, i)], s, i));
    }
    // fp8 rows hold no scale words: none is read.
    var v = vec4<f32>(0.0);
    for (var k = 0u; k < m; k++) {
        v[k] = deq(t, slot_b[base + qword(t, i + k)], 0u, i + k);
    }
    return scaled(t, p.slot_scales.y, v);
}

fn quad_v(row: u32, i: u32, m: u32) -> vec4<f32> {
    let t = DTYPE_V;
    let base = row * p.row_words_v;
    let elems = p.n_kv * p.d_v;
    // Block types always take whole aligned quads (their widths are whole blocks): the fallback is
    // compiled for fp8 only.
    if !is_fp8(t) || (m == 4u && (i & 3u) == 0u) {
        var s = 0u;
        if !is_fp8(t) {
            s = slot_v[base + sword(t, elems, i)];
        }
        return scaled(t, p.slot_scales.z, deq4(t, slot_v[base + qword(t, i)], s, i));
    }
    // fp8 rows hold no scale words: none is read.
    var v = vec4<f32>(0.0);
    for (var k = 0u; k < m; k++) {
        v[k] = deq(t, slot_v[base + qword(t, i + k)], 0u, i + k);
    }
    return scaled(t, p.slot_scales.z, v);
}

// Element `e` of row `row` of slot v.
fn v_elem(row: u32, e: u32) -> f32 {
    if DTYPE_V == F32 {
        return bitcast<f32>(slot_v[row * p.row_words_v + e]);
    }
    return half_at(DTYPE_V, slot_v[row * p.row_words_v + (e >> 1u)], (e & 1u) == 1u);
}

// Elements [e, e + m) of row `row` of slot v (m <= 4), zero beyond.
fn v_quad(row: u32, e: u32, m: u32) -> vec4<f32> {
    if DTYPE_V >= Q8_0 {
        return quad_v(row, e, m);
    }
    let base = row * p.row_words_v;
    if DTYPE_V == F32 {
        if m == 4u {
            return vec4<f32>(
                bitcast<f32>(slot_v[base + e]),
                bitcast<f32>(slot_v[base + e + 1u]),
                bitcast<f32>(slot_v[base + e + 2u]),
                bitcast<f32>(slot_v[base + e + 3u]),
            );
        }
    } else if m == 4u && (e & 1u) == 0u {
        let w0 = slot_v[base + (e >> 1u)];
        let w1 = slot_v[base + (e >> 1u) + 1u];
        return vec4<f32>(half_at(DTYPE_V, w0, false), half_at(DTYPE_V, w0, true), half_at(DTYPE_V, w1, false),
            half_at(DTYPE_V, w1, true));
    }
    var v = vec4<f32>(0.0);
    for (var k = 0u; k < m; k++) {
        v[k] = v_elem(row, e + k);
    }
    return v;
}

// acc[k * HB + h] += q_a[head h0 + h] · (elements [e0, e0 + d_a) of row rows[k] of slot a), for h < HB
// and k < RPL: each query element loaded once serves RPL rows. q0 is element 0 of head h0's query in
// the view `p.view_a`.
fn dot_a(rows: array<u32, 8>, e0: u32, q0: u32, acc: ptr<function, array<f32, 32>>) {
    let d = p.d_a;
    var base: array<u32, 8>;
    for (var k = 0u; k < RPL; k++) {
        base[k] = rows[k] * p.row_words_a;
    }
    // The query view's head and element strides.
    let sh = p.view_a.z;
    let se = p.view_a.w;
    if DTYPE_A >= Q8_0 {
        for (var e = 0u; e < d; e += 4u) {
            let m = min(4u, d - e);
            var x: array<vec4<f32>, 8>;
            for (var k = 0u; k < RPL; k++) {
                x[k] = quad_a(rows[k], e0 + e, m);
            }
            for (var h = 0u; h < HB; h++) {
                let at = q0 + h * sh + e * se;
                var q = vec4<f32>(0.0);
                if !is_fp8(DTYPE_A) || m == 4u {
                    q = vec4<f32>(q_a[at], q_a[at + se], q_a[at + 2u * se], q_a[at + 3u * se]);
                } else {
                    for (var j = 0u; j < m; j++) {
                        q[j] = q_a[at + j * se];
                    }
                }
                for (var k = 0u; k < RPL; k++) {
                    (*acc)[k * HB + h] += dot(q, x[k]);
                }
            }
        }
        return;
    }
    if DTYPE_A == F32 {
        // Four elements per step (so a step's loop iterations serve four elements), then the rest.
        let d4 = d & ~3u;
        for (var e = 0u; e < d4; e += 4u) {
            var x: array<vec4<f32>, 8>;
            for (var k = 0u; k < RPL; k++) {
                let at = base[k] + e0 + e;
                x[k] = vec4<f32>(
                    bitcast<f32>(slot_a[at]),
                    bitcast<f32>(slot_a[at + 1u]),
                    bitcast<f32>(slot_a[at + 2u]),
                    bitcast<f32>(slot_a[at + 3u]),
                );
            }
            for (var h = 0u; h < HB; h++) {
                let at = q0 + h * sh + e * se;
                let q = vec4<f32>(q_a[at], q_a[at + se], q_a[at + 2u * se], q_a[at + 3u * se]);
                for (var k = 0u; k < RPL; k++) {
                    (*acc)[k * HB + h] += dot(q, x[k]);
                }
            }
        }
        for (var e = d4; e < d; e++) {
            var x: array<f32, 8>;
            for (var k = 0u; k < RPL; k++) {
                x[k] = bitcast<f32>(slot_a[base[k] + e0 + e]);
            }
            for (var h = 0u; h < HB; h++) {
                let q = q_a[q0 + h * sh + e * se];
                for (var k = 0u; k < RPL; k++) {
                    (*acc)[k * HB + h] += q * x[k];
                }
            }
        }
        return;
    }
    // Packed words: two per step (four elements) from the first element that starts a word.
    let odd = select(0u, 1u, (e0 & 1u) == 1u && d > 0u);
    let steps = (d - odd) / 4u;
    for (var s = 0u; s < steps; s++) {
        let e = odd + 4u * s;
        let w = (e0 + e) >> 1u;
        var x: array<vec4<f32>, 8>;
        for (var k = 0u; k < RPL; k++) {
            let w0 = slot_a[base[k] + w];
            let w1 = slot_a[base[k] + w + 1u];
            x[k] = vec4<f32>(half_at(DTYPE_A, w0, false), half_at(DTYPE_A, w0, true), half_at(DTYPE_A, w1, false),
                half_at(DTYPE_A, w1, true));
        }
        for (var h = 0u; h < HB; h++) {
            let at = q0 + h * sh + e * se;
            let q = vec4<f32>(q_a[at], q_a[at + se], q_a[at + 2u * se], q_a[at + 3u * se]);
            for (var k = 0u; k < RPL; k++) {
                (*acc)[k * HB + h] += dot(q, x[k]);
            }
        }
    }
    // The elements the steps leave, an odd first one and up to three at the end, one at a time
    // (`half_a`), in one loop so that its unrolled body is compiled once: a slice that starts or
    // ends inside a word takes that element alone, since the word's other half is the next or
    // previous head's, or row padding, and an infinity or NaN there would make a zero query
    // element's product NaN.
    let done = odd + 4u * steps;
    for (var j = 0u; j < odd + d - done; j++) {
        half_a(base, e0, q0, select(done + j - odd, 0u, j < odd), acc);
    }
}

// Element e of slot a's slice that starts at element e0 (16-bit storage), alone: the half of its
// word that holds it, times the query element e of each head.
fn half_a(base: array<u32, 8>, e0: u32, q0: u32, e: u32, acc: ptr<function, array<f32, 32>>) {
    let i = e0 + e;
    var x: array<f32, 8>;
    for (var k = 0u; k < RPL; k++) {
        x[k] = half_at(DTYPE_A, slot_a[base[k] + (i >> 1u)], (i & 1u) == 1u);
    }
    for (var h = 0u; h < HB; h++) {
        let q = q_a[q0 + h * p.view_a.z + e * p.view_a.w];
        for (var k = 0u; k < RPL; k++) {
            (*acc)[k * HB + h] += q * x[k];
        }
    }
}

// As dot_a, for q_b and slot b.
fn dot_b(rows: array<u32, 8>, e0: u32, q0: u32, acc: ptr<function, array<f32, 32>>) {
    let d = p.d_b;
    var base: array<u32, 8>;
    for (var k = 0u; k < RPL; k++) {
        base[k] = rows[k] * p.row_words_b;
    }
    // The query view's head and element strides.
    let sh = p.view_b.z;
    let se = p.view_b.w;
    if DTYPE_B >= Q8_0 {
        for (var e = 0u; e < d; e += 4u) {
            let m = min(4u, d - e);
            var x: array<vec4<f32>, 8>;
            for (var k = 0u; k < RPL; k++) {
                x[k] = quad_b(rows[k], e0 + e, m);
            }
            for (var h = 0u; h < HB; h++) {
                let at = q0 + h * sh + e * se;
                var q = vec4<f32>(0.0);
                if !is_fp8(DTYPE_B) || m == 4u {
                    q = vec4<f32>(q_b[at], q_b[at + se], q_b[at + 2u * se], q_b[at + 3u * se]);
                } else {
                    for (var j = 0u; j < m; j++) {
                        q[j] = q_b[at + j * se];
                    }
                }
                for (var k = 0u; k < RPL; k++) {
                    (*acc)[k * HB + h] += dot(q, x[k]);
                }
            }
        }
        return;
    }
    if DTYPE_B == F32 {
        // Four elements per step (so a step's loop iterations serve four elements), then the rest.
        let d4 = d & ~3u;
        for (var e = 0u; e < d4; e += 4u) {
            var x: array<vec4<f32>, 8>;
            for (var k = 0u; k < RPL; k++) {
                let at = base[k] + e0 + e;
                x[k] = vec4<f32>(
                    bitcast<f32>(slot_b[at]),
                    bitcast<f32>(slot_b[at + 1u]),
                    bitcast<f32>(slot_b[at + 2u]),
                    bitcast<f32>(slot_b[at + 3u]),
                );
            }
            for (var h = 0u; h < HB; h++) {
                let at = q0 + h * sh + e * se;
                let q = vec4<f32>(q_b[at], q_b[at + se], q_b[at + 2u * se], q_b[at + 3u * se]);
                for (var k = 0u; k < RPL; k++) {
                    (*acc)[k * HB + h] += dot(q, x[k]);
                }
            }
        }
        for (var e = d4; e < d; e++) {
            var x: array<f32, 8>;
            for (var k = 0u; k < RPL; k++) {
                x[k] = bitcast<f32>(slot_b[base[k] + e0 + e]);
            }
            for (var h = 0u; h < HB; h++) {
                let q = q_b[q0 + h * sh + e * se];
                for (var k = 0u; k < RPL; k++) {
                    (*acc)[k * HB + h] += q * x[k];
                }
            }
        }
        return;
    }
    // Packed words: two per step (four elements) from the first element that starts a word.
    let odd = select(0u, 1u, (e0 & 1u) == 1u && d > 0u);
    let steps = (d - odd) / 4u;
    for (var s = 0u; s < steps; s++) {
        let e = odd + 4u * s;
        let w = (e0 + e) >> 1u;
        var x: array<vec4<f32>, 8>;
        for (var k = 0u; k < RPL; k++) {
            let w0 = slot_b[base[k] + w];
            let w1 = slot_b[base[k] + w + 1u];
            x[k] = vec4<f32>(half_at(DTYPE_B, w0, false), half_at(DTYPE_B, w0, true), half_at(DTYPE_B, w1, false),
                half_at(DTYPE_B, w1, true));
        }
        for (var h = 0u; h < HB; h++) {
            let at = q0 + h * sh + e * se;
            let q = vec4<f32>(q_b[at], q_b[at + se], q_b[at + 2u * se], q_b[at + 3u * se]);
            for (var k = 0u; k < RPL; k++) {
                (*acc)[k * HB + h] += dot(q, x[k]);
            }
        }
    }
    // The elements the steps leave, an odd first one and up to three at the end, one at a time
    // (`half_b`), in one loop so that its unrolled body is compiled once: a slice that starts or
    // ends inside a word takes that element alone, since the word's other half is the next or
    // previous head's, or row padding, and an infinity or NaN there would make a zero query
    // element's product NaN.
    let done = odd + 4u * steps;
    for (var j = 0u; j < odd + d - done; j++) {
        half_b(base, e0, q0, select(done + j - odd, 0u, j < odd), acc);
    }
}

// Element e of slot b's slice that starts at element e0 (16-bit storage), alone: the half of its
// word that holds it, times the query element e of each head.
fn half_b(base: array<u32, 8>, e0: u32, q0: u32, e: u32, acc: ptr<function, array<f32, 32>>) {
    let i = e0 + e;
    var x: array<f32, 8>;
    for (var k = 0u; k < RPL; k++) {
        x[k] = half_at(DTYPE_B, slot_b[base[k] + (i >> 1u)], (i & 1u) == 1u);
    }
    for (var h = 0u; h < HB; h++) {
        let q = q_b[q0 + h * p.view_b.z + e * p.view_b.w];
        for (var k = 0u; k < RPL; k++) {
            (*acc)[k * HB + h] += q * x[k];
        }
    }
}

// A row of `elems` elements fits `rw` stored words (the block types: whole blocks, values and scales).
fn row_fits(t: u32, elems: u32, rw: u32) -> bool {
    if t == F32 {
        return elems <= rw;
    }
    if t == F16 || t == BF16 {
        return elems <= rw * 2u;
    }
    if is_fp8(t) {
        return elems <= rw * 4u;
    }
    let scales = (elems / 32u + 1u) / 2u;
    return elems % 32u == 0u && elems / select(4u, 8u, t == Q4_0) + scales <= rw;
}

// A score with the call's soft-cap, if it has one.
fn capped(s: f32) -> f32 {
    if p.soft_cap > 0.0 {
        return p.soft_cap * tanh_safe(s / p.soft_cap);
    }
    return s;
}

// Every index this dispatch can touch is inside its binding; checked once, up front, on uniform values.
fn in_bounds() -> bool {
    let parts = p.n_chunks * p.q_count * p.n_heads;
    return HB >= 1u && HB <= HEADS && (SLOT_B != 0u || p.d_b == 0u) && RPL >= 1u && RPL <= 8u && RPL * HB <= 32u && p.group % HB == 0u && p.n_batches * HB == p.group
        && queries_fit(parts) && p.n_kv * p.group == p.n_heads
        && p.q_count >= 1u && p.q_first < p.n_q && p.q_count <= p.n_q - p.q_first
        && p.chunk_len % (TILE * RPL) == 0u
        && view_fits(p.view_a, p.n_q, p.n_heads, p.d_a, arrayLength(&q_a))
        && view_fits(p.view_b, p.n_q, p.n_heads, p.d_b, arrayLength(&q_b))
        && row_fits(DTYPE_A, p.n_kv * p.d_a, p.row_words_a) && rows_fit(p.row_words_a, arrayLength(&slot_a))
        && row_fits(DTYPE_B, p.n_kv * p.d_b, p.row_words_b) && rows_fit(p.row_words_b, arrayLength(&slot_b))
        && row_fits(DTYPE_V, p.n_kv * p.d_v, p.row_words_v) && rows_fit(p.row_words_v, arrayLength(&slot_v))
        && parts * 2u <= arrayLength(&stats) && parts * p.d_v <= arrayLength(&part);
}

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    // Grid (chunks, queries, teams): teams vary slowest, so an adapter that splits the grid into
    // contiguous blocks per core gives each core whole teams, every query's rows, however ragged.
    let chunk = wg.x;
    let kv = wg.z / max(p.n_batches, 1u);
    let batch = wg.z % max(p.n_batches, 1u);
    // The query (of all n_q) and its place among this pair's partial results.
    let local = wg.y;
    let qi = p.q_first + local;
    if chunk >= p.n_chunks || kv >= p.n_kv || batch * HB >= p.group || local >= p.q_count || !in_bounds() {
        return;
    }
    let h0 = kv * p.group + batch * HB;
    // This query's own row and first page-table entry: from uniforms (one sequence), or from the
    // query table (a batch), read once and shared so that the loops below stay in uniform control
    // flow. Then the first row its window reaches.
    var last = p.visible - p.n_q + qi;
    var tb = p.table_base;
    if ROWS == 2u {
        if lid == 0u {
            query_row = vec2<u32>(query_last(qi), query_table(qi));
        }
        let own = workgroupUniformLoad(&query_row);
        last = own.x;
        tb = own.y;
        if !query_fits(last, tb) {
            return;
        }
    }
    var first = 0u;
    if p.window > 0u && last + 1u > p.window {
        first = last + 1u - p.window;
    }
    let c_start = p.lo + chunk * p.chunk_len;
    let start = max(c_start, first);
    let end = min(min(p.visible, c_start + p.chunk_len), last + 1u);
    if lid < HEADS {
        run_max[lid] = NEG;
        run_sum[lid] = 0.0;
    }
    let out0 = (chunk * p.q_count + local) * p.n_heads + h0;
    let qa0 = view_at(p.view_a, qi, h0, 0u);
    let qb0 = view_at(p.view_b, qi, h0, 0u);
    let span = TILE * RPL;
    for (var t0 = start; t0 < end; t0 += span) {
        let n = min(span, end - t0);
        if lid < n {
            // This invocation's rows lid, lid + TILE, ...; rows past the tile repeat its last row
            // (always a readable row) and are not stored.
            var rows: array<u32, 8>;
            for (var k = 0u; k < RPL; k++) {
                rows[k] = stored(t0 + min(lid + k * TILE, n - 1u), tb);
                if ROWS != 0u && lid + k * TILE < n {
                    tile_rows[lid + k * TILE] = rows[k];
                }
            }
            // Explicitly zeroed: Chromium 156 (Tint) keeps an uninitialised loop-local value from the
            // previous iteration.
            var acc = array<f32, 32>();
            dot_a(rows, kv * p.d_a, qa0, &acc);
            if SLOT_B != 0u && p.d_b > 0u {
                dot_b(rows, kv * p.d_b, qb0, &acc);
            }
            for (var k = 0u; k < RPL; k++) {
                let t = lid + k * TILE;
                if t < n {
                    for (var h = 0u; h < HB; h++) {
                        scores[h * span + t] = acc[k * HB + h] * p.scale;
                    }
                }
            }
        }
        workgroupBarrier();
        // The scores are uncapped here: the soft-cap c * tanh(s / c) rises with s, so the tile's
        // largest capped score is the cap of its largest score, and each score is capped as it is
        // exponentiated, in a loop over (head, row) that is compiled once. Capped in the unrolled
        // loops above (HB * RPL copies of tanh), the cap took a tenth to a fifth of a cold first
        // call of DeepSeek-V2-Lite's 16 heads in f32 on OpenGL (docs/benchmarks.md).
        if lid < HB {
            var m = NEG;
            for (var t = 0u; t < n; t++) {
                m = max(m, scores[lid * span + t]);
            }
            m = max(run_max[lid], capped(m));
            rescale[lid] = exp(run_max[lid] - m);
            run_max[lid] = m;
        }
        workgroupBarrier();
        for (var i = lid; i < HB * span; i += TILE) {
            let t = i % span;
            if t < n {
                scores[i] = exp(capped(scores[i]) - run_max[i / span]);
            }
        }
        workgroupBarrier();
        if lid < HB {
            var s = 0.0;
            for (var t = 0u; t < n; t++) {
                s += scores[lid * span + t];
            }
            run_sum[lid] = run_sum[lid] * rescale[lid] + s;
        }
        // Each invocation owns 4 consecutive output dims, so one score load feeds 4 multiply-adds.
        for (var d = 4u * lid; d < p.d_v; d += 4u * TILE) {
            var acc = array<vec4<f32>, 16>();
            let e = kv * p.d_v + d;
            let m = min(4u, p.d_v - d);
            for (var t = 0u; t < n; t++) {
                var row = t0 + t;
                if ROWS != 0u {
                    row = tile_rows[t];
                }
                let v = v_quad(row, e, m);
                for (var h = 0u; h < HB; h++) {
                    acc[h] += scores[h * span + t] * v;
                }
            }
            for (var h = 0u; h < HB; h++) {
                let i = (out0 + h) * p.d_v + d;
                for (var k = 0u; k < m; k++) {
                    if t0 == start {
                        part[i + k] = acc[h][k];
                    } else {
                        part[i + k] = part[i + k] * rescale[h] + acc[h][k];
                    }
                }
            }
        }
        workgroupBarrier();
    }
    if lid < HB {
        stats[2u * (out0 + lid)] = run_max[lid];
        stats[2u * (out0 + lid) + 1u] = run_sum[lid];
    }
}
