// Attention, pass 2 of 2: merges the per-chunk partials of attention_partial.wgsl into the output.
// Workgroups per query: one per head on GPUs; on CPU adapters a few, each merging every few heads
// (head h by workgroup h mod the grid's width), so that per-workgroup costs stay small. Chunks that
// saw no row of the query (sum 0) are skipped.

// The lowest finite f32, as in attention_partial.wgsl.
const NEG: f32 = -3.4028234e38;

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

@compute @workgroup_size(LANES)
fn main(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(num_workgroups) grid: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    // The query among this pair's partial results, and among all n_q.
    let local = wg.y;
    let qi = p.q_first + local;
    let rows = p.q_count * p.n_heads;
    if local >= p.q_count || p.q_first >= p.n_q || p.q_count > p.n_q - p.q_first
        || !view_fits(p.view_out, p.n_q, p.n_heads, p.d_v, arrayLength(&out))
        || p.n_chunks * rows > arrayLength(&stats)
        || p.n_chunks * rows > (4u * arrayLength(&part)) / max(p.d_v, 1u) {
        return;
    }
    let whole = p.d_v % 4u == 0u;
    for (var h = wg.x; h < p.n_heads; h += grid.x) {
        var m = NEG;
        for (var c = 0u; c < p.n_chunks; c++) {
            let s = (c * p.q_count + local) * p.n_heads + h;
            let st = stats[s];
            if st.y > 0.0 {
                m = max(m, st.x);
            }
        }
        var l = 0.0;
        for (var c = 0u; c < p.n_chunks; c++) {
            let s = (c * p.q_count + local) * p.n_heads + h;
            let st = stats[s];
            if st.y > 0.0 {
                l += st.y * exp(st.x - m);
            }
        }
        let inv = select(0.0, 1.0 / l, l > 0.0);
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
                if st.y > 0.0 {
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
