// Shared by every kvgpu kernel: build.rs prepends this file to each shader of shaders/ before it
// validates it and before the library compiles it, so nothing here is written twice.

// Element type codes, as `DType::code` in src/codec.rs.
const F32: u32 = 0u;
const F16: u32 = 1u;
const BF16: u32 = 2u;
// Quantized storage (src/codec.rs, "Quantized storage"): rows of [values][f16 scales per 32 elements]
// for q8_0 and q4_0, one byte per element for fp8 (e4m3, e5m2).
const Q8_0: u32 = 3u;
const Q4_0: u32 = 4u;
const F8E4M3: u32 = 5u;
const F8E5M2: u32 = 6u;

// Whether storage type `t` is an 8-bit float (one byte per element).
fn is_fp8(t: u32) -> bool {
    return t == F8E4M3 || t == F8E5M2;
}

// Parameters of the zeroing kernels (zero.wgsl, zero_int64.wgsl); must match `ZeroParams` in
// src/kernels/params.rs.
struct ZeroParams {
    start_word: u32,
    n_words: u32,
    // Invocations in the dispatch (workgroups x 256): the loop stride, in blocks.
    thread_stride: u32,
    _pad: u32,
}

// Parameters of both attention passes; must match `AttnParams` in src/kernels/params.rs.
struct AttnParams {
    n_q: u32,
    n_heads: u32,
    // Query heads per KV head.
    group: u32,
    // Workgroups per KV head: group / HB.
    n_batches: u32,
    d_a: u32,
    d_b: u32,
    d_v: u32,
    // Visible rows of the layer; the queries are the last n_q of them.
    visible: u32,
    row_words_a: u32,
    row_words_b: u32,
    row_words_v: u32,
    // Attend to at most this many rows ending at the query's own (0: no window).
    window: u32,
    // First row any query can see, and rows per chunk (a multiple of TILE).
    lo: u32,
    chunk_len: u32,
    n_chunks: u32,
    n_kv: u32,
    scale: f32,
    // Logit soft-cap (0: none).
    soft_cap: f32,
    // The queries of this dispatch pair: q_first .. q_first + q_count of the n_q (a call whose partial
    // results would not fit one binding is split into several pairs).
    q_first: u32,
    q_count: u32,
    // Paged storage (pipelines built with PAGED): rows per page, the sequence's first entry in the
    // page table, and the pool's pages (table entries are clamped below it); 0 otherwise.
    page_size: u32,
    table_base: u32,
    n_pages: u32,
    // Teams (KV head x head batch) side by side in a workgroup of one-invocation teams; 1 otherwise.
    team_width: u32,
    // The f32 views of q_a, q_b and the output: (offset in its binding, query stride, head stride,
    // element stride), in elements; element (i, h, e) is x + i * y + h * z + e * w.
    view_a: vec4<u32>,
    view_b: vec4<u32>,
    view_out: vec4<u32>,
    // Scales of slots a, b and v: 1 but for scaled fp8 slots, whose stored numbers times the scale
    // are the values.
    slot_scales: vec4<f32>,
    // 1 where pass 1 writes the normalised output itself into the output, bound in place of the
    // partial results, and no reduce runs (a streaming kernel's call of one chunk); 0 otherwise.
    direct: u32,
}

// Element (i, h, e) of view `v`.
fn view_at(v: vec4<u32>, i: u32, h: u32, e: u32) -> u32 {
    return v.x + i * v.y + h * v.z + e * v.w;
}

// (n - 1) * s < len, without overflow (n, len >= 1). A stride of 0 never moves (queries shared by
// every head, or one element for a whole head).
fn steps_fit(n: u32, s: u32, len: u32) -> bool {
    return s == 0u || n - 1u <= (len - 1u) / s;
}

// Every element of view `v` over [n_q, n_heads, d] lies in a binding of `len` elements (an empty
// view always does). Each term is checked below len (< 2^30) before the sum, so nothing wraps.
fn view_fits(v: vec4<u32>, n_q: u32, n_heads: u32, d: u32, len: u32) -> bool {
    if n_q == 0u || n_heads == 0u || d == 0u {
        return true;
    }
    if len == 0u || v.x >= len || !steps_fit(n_q, v.y, len) || !steps_fit(n_heads, v.z, len)
        || !steps_fit(d, v.w, len) {
        return false;
    }
    return view_at(v, n_q - 1u, n_heads - 1u, d - 1u) < len;
}

// A paged pool of n_pages pages of page_size rows of rw words fits a binding of len words, and the
// table entries of a sequence of `visible` rows from entry `base` fit a table of `entries`. Written
// with divisions, so no product wraps.
fn pool_fits(page_size: u32, n_pages: u32, rw: u32, len: u32) -> bool {
    return page_size >= 1u && n_pages >= 1u && rw >= 1u && page_size <= len / rw
        && n_pages <= len / (page_size * rw);
}

fn table_fits(base: u32, visible: u32, page_size: u32, entries: u32) -> bool {
    return page_size >= 1u && visible >= 1u && base < entries
        && (visible - 1u) / page_size < entries - base;
}

// tanh that cannot overflow for large |x| and keeps its precision for small |x|: below
// |x| = 0.125, where (1 - t) / (1 + t) loses bits to cancellation (all of them below 1e-4), the
// odd Taylor polynomial to x^9 (within 1e-12 there).
fn tanh_safe(x: f32) -> f32 {
    let t = exp(-2.0 * abs(x));
    let r = (1.0 - t) / (1.0 + t);
    let x2 = x * x;
    let poly = x * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0 + x2 * (62.0 / 2835.0)))));
    return select(select(r, -r, x < 0.0), poly, abs(x) < 0.125);
}
