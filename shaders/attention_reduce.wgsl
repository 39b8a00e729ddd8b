// Attention, pass 2 of 2: merges the per-chunk partials of attention_partial.wgsl into the output.
// Workgroups per query: on GPUs one per head and 32 output elements (`split`); on CPU adapters a
// few, each merging every few heads (head h by workgroup h mod the grid's width), so that
// per-workgroup costs stay small. Chunks that saw no row of the query (sum 0) are skipped (`seen`). Two
// entry points: `main`, whose every invocation walks all of a head's chunks for its own output
// elements (CPU adapters, where a barrier costs more than a loop), and `split` (GPUs), whose
// invocations split the chunks between them and merge through workgroup memory.

// The lowest finite f32, as in attention_partial.wgsl.
const NEG: f32 = -3.4028234e38;

// Whether a chunk's (or a merge's) sum of weights is not the +0 of one that saw no row of the query,
// whose partial output is stale. Tested on the bits: a NaN sum (from a NaN score) is seen, so that
// the NaN reaches the output, as in the twin (a test of `sum > 0` took that chunk for an empty one).
fn seen(sum: f32) -> bool {
    return bitcast<u32>(sum) != 0u;
}

// Invocations per workgroup: 64 on GPUs; 8 on CPU adapters, one SIMD vector, so that a workgroup
// works out each head's max and sum once instead of once per vector.
override LANES: u32 = 64u;
// Each invocation holds 4 vectors of 4 output elements per pass over the chunks: a pass merges
// 16 LANES elements of a head, reading each chunk's (max, sum) and working out its weight once. (No
// loop but those over heads, chunks and passes: the planner counts their iterations.)

// (max, sum) of each (chunk, query, head).
@group(0) @binding(0) var<storage, read> stats: array<vec2<f32>>;
// Read as vectors of 4 (the scratch buffer is a multiple of 16 bytes); element by element where d_v
// is not a multiple of 4.
@group(0) @binding(1) var<storage, read> part: array<vec4<f32>>;
// [n_q, n_heads, d_v] along p.view_out
@group(0) @binding(2) var<storage, read_write> out: array<f32>;
@group(1) @binding(0) var<uniform> p: AttnParams;

fn part1(e: u32, end: u32) -> f32 {
    return select(0.0, part[min(e, end - 1u) / 4u][min(e, end - 1u) % 4u], e < end);
}

// Elements e..e+3 of the partials, 0 from element `end` on (`whole`: e and end are multiples of 4).
fn part4(e: u32, whole: bool, end: u32) -> vec4<f32> {
    if whole {
        return part[e / 4u];
    }
    return vec4<f32>(part1(e, end), part1(e + 1u, end), part1(e + 2u, end), part1(e + 3u, end));
}

// Adds `w` times the partials of chunk entry `s` at elements d..d+3 to `o`, where d < d_v.
fn add4(o: ptr<function, vec4<f32>>, s: u32, d: u32, whole: bool, w: f32) {
    if d < p.d_v {
        *o += part4(s * p.d_v + d, whole, (s + 1u) * p.d_v) * w;
    }
}

// Stores the elements d..d+3 of `o` that lie below d_v.
fn store4(qi: u32, h: u32, d: u32, o: vec4<f32>) {
    if d < p.d_v { out[view_at(p.view_out, qi, h, d)] = o.x; }
    if d + 1u < p.d_v { out[view_at(p.view_out, qi, h, d + 1u)] = o.y; }
    if d + 2u < p.d_v { out[view_at(p.view_out, qi, h, d + 2u)] = o.z; }
    if d + 3u < p.d_v { out[view_at(p.view_out, qi, h, d + 3u)] = o.w; }
}

// The bindings hold the pair's partial results and the output: the query `local` of this pair, or
// false (uniform: workgroup id and uniforms).
fn pair_fits(local: u32) -> bool {
    let rows = p.q_count * p.n_heads;
    return !(local >= p.q_count || p.q_first >= p.n_q || p.q_count > p.n_q - p.q_first
        || !view_fits(p.view_out, p.n_q, p.n_heads, p.d_v, arrayLength(&out))
        || p.n_chunks * rows > arrayLength(&stats)
        || p.n_chunks * rows > (4u * arrayLength(&part)) / max(p.d_v, 1u));
}

@compute @workgroup_size(LANES)
fn main(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(num_workgroups) grid: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    // The query among this pair's partial results, and among all n_q.
    let local = wg.y;
    let qi = p.q_first + local;
    if !pair_fits(local) {
        return;
    }
    let whole = p.d_v % 4u == 0u;
    for (var h = wg.x; h < p.n_heads; h += grid.x) {
        var m = NEG;
        for (var c = 0u; c < p.n_chunks; c++) {
            let s = (c * p.q_count + local) * p.n_heads + h;
            let st = stats[s];
            if seen(st.y) {
                m = max(m, st.x);
            }
        }
        var l = 0.0;
        for (var c = 0u; c < p.n_chunks; c++) {
            let s = (c * p.q_count + local) * p.n_heads + h;
            let st = stats[s];
            if seen(st.y) {
                l += st.y * exp(st.x - m);
            }
        }
        let inv = select(0.0, 1.0 / l, seen(l));
        // This invocation's vectors of a pass from d0 start at d0 + 4 lid + 4 LANES k, k < 4.
        for (var d0 = 4u * lid; d0 < p.d_v; d0 += 16u * LANES) {
            let d = array<u32, 4>(d0, d0 + 4u * LANES, d0 + 8u * LANES, d0 + 12u * LANES);
            var o0 = vec4<f32>(0.0);
            var o1 = vec4<f32>(0.0);
            var o2 = vec4<f32>(0.0);
            var o3 = vec4<f32>(0.0);
            for (var c = 0u; c < p.n_chunks; c++) {
                let s = (c * p.q_count + local) * p.n_heads + h;
                // A chunk's weight; chunks that saw no row of the query are skipped.
                let st = stats[s];
                if seen(st.y) {
                    let w = exp(st.x - m);
                    add4(&o0, s, d[0], whole, w);
                    add4(&o1, s, d[1], whole, w);
                    add4(&o2, s, d[2], whole, w);
                    add4(&o3, s, d[3], whole, w);
                }
            }
            store4(qi, h, d[0], o0 * inv);
            store4(qi, h, d[1], o1 * inv);
            store4(qi, h, d[2], o2 * inv);
            store4(qi, h, d[3], o3 * inv);
        }
    }
}

// Invocations per workgroup of `split` (src/kernels/mod.rs's REDUCE_SPLIT_LANES).
const SPLIT: u32 = 256u;
// Output vectors of 4 that one workgroup of `split` merges (REDUCE_SPLIT_ELEMENTS / 4 there): a
// head's values take ceil(d_v / 32) workgroups, and the invocations of each vector, SPLIT /
// SPLIT_COLUMNS of them, take every 32nd chunk.
const SPLIT_COLUMNS: u32 = 8u;
const SPLIT_STRIDES: u32 = SPLIT / SPLIT_COLUMNS;
// (max, sum) of each invocation's chunks, then of their pairs, halving (a tree).
var<workgroup> split_stats: array<vec2<f32>, SPLIT>;
// Each invocation's weighted sum of its chunks for one output vector, then merged as a tree.
var<workgroup> split_out: array<vec4<f32>, SPLIT>;

// Two (max, sum) pairs as one: each sum rescaled to the larger max. An empty pair (NEG, 0) adds 0.
fn merge_stats(a: vec2<f32>, b: vec2<f32>) -> vec2<f32> {
    let m = max(a.x, b.x);
    return vec2<f32>(m, a.y * exp(a.x - m) + b.y * exp(b.x - m));
}

// The same merge as `main` for GPUs, where one invocation per output element walking every chunk
// waits on one load after another, and one workgroup per head leaves most of the GPU idle. Each
// workgroup takes one head and SPLIT_COLUMNS of its output vectors (workgroup x of the grid is
// head x / blocks, block x % blocks, where a head's vectors are `blocks` blocks): invocation i takes
// chunks i, i + SPLIT, ... for the head's (max, sum), merged through workgroup memory; then the
// invocations of each vector take every SPLIT_STRIDES-th chunk, and their sums are merged the same
// way. Every loop bound and branch around a barrier is uniform.
@compute @workgroup_size(SPLIT)
fn split(
    @builtin(local_invocation_index) lid: u32,
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(num_workgroups) grid: vec3<u32>,
) {
    // Uniform: the workgroup's query (wg.y) and the bindings.
    if !pair_fits(wg.y) {
        return;
    }
    let local = wg.y;
    let qi = p.q_first + local;
    let whole = p.d_v % 4u == 0u;
    let blocks = max((p.d_v + 4u * SPLIT_COLUMNS - 1u) / (4u * SPLIT_COLUMNS), 1u);
    let col = lid % SPLIT_COLUMNS;
    let stride = lid / SPLIT_COLUMNS;
    for (var hb = wg.x; hb < p.n_heads * blocks; hb += grid.x) {
        let h = hb / blocks;
        let d = 4u * ((hb % blocks) * SPLIT_COLUMNS + col);
        var st = vec2<f32>(NEG, 0.0);
        for (var c = lid; c < p.n_chunks; c += SPLIT) {
            let s = stats[(c * p.q_count + local) * p.n_heads + h];
            if seen(s.y) {
                st = merge_stats(st, s);
            }
        }
        split_stats[lid] = st;
        workgroupBarrier();
        for (var half = SPLIT / 2u; half > 0u; half >>= 1u) {
            if lid < half {
                split_stats[lid] = merge_stats(split_stats[lid], split_stats[lid + half]);
            }
            workgroupBarrier();
        }
        let total = split_stats[0];
        var o = vec4<f32>(0.0);
        for (var c = stride; c < p.n_chunks; c += SPLIT_STRIDES) {
            let s = (c * p.q_count + local) * p.n_heads + h;
            let w = stats[s];
            if seen(w.y) {
                add4(&o, s, d, whole, exp(w.x - total.x));
            }
        }
        split_out[lid] = o;
        workgroupBarrier();
        for (var half = SPLIT_STRIDES / 2u; half > 0u; half >>= 1u) {
            if stride < half {
                split_out[lid] = split_out[lid] + split_out[lid + half * SPLIT_COLUMNS];
            }
            workgroupBarrier();
        }
        if stride == 0u {
            store4(qi, h, d, split_out[lid] * select(0.0, 1.0 / total.y, seen(total.y)));
        }
        // Every invocation has read `total` and its sums before the next block writes them.
        workgroupBarrier();
    }
}
