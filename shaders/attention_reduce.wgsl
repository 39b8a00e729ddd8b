// Attention, pass 2 of 2: merges the per-chunk partials of attention_partial.wgsl into the output.
// Workgroups per query: one per head on GPUs; on CPU adapters a few, each merging every few heads
// (head h by workgroup h mod the grid's width), so that per-workgroup costs stay small. Chunks that
// saw no row of the query (sum 0) are skipped.

// The lowest finite f32, as in attention_partial.wgsl.
const NEG: f32 = -3.4028234e38;

// Invocations per workgroup: 64 on GPUs; 8 on CPU adapters, one SIMD vector, so that a workgroup
// works out each head's max and sum once instead of once per vector.
override LANES: u32 = 64u;
// The weight of each of a head's first W chunks is worked out once, not once per output element.
const W: u32 = 16u;

@group(0) @binding(0) var<storage, read> stats: array<f32>;
@group(0) @binding(1) var<storage, read> part: array<f32>;
// [n_q, n_heads, d_v] along p.view_out
@group(0) @binding(2) var<storage, read_write> out: array<f32>;
@group(1) @binding(0) var<uniform> p: AttnParams;

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
        || p.n_chunks * rows * 2u > arrayLength(&stats) || p.n_chunks * rows * p.d_v > arrayLength(&part) {
        return;
    }
    var w: array<f32, W>;
    for (var h = wg.x; h < p.n_heads; h += grid.x) {
        var m = NEG;
        for (var c = 0u; c < p.n_chunks; c++) {
            let s = (c * p.q_count + local) * p.n_heads + h;
            if stats[2u * s + 1u] > 0.0 {
                m = max(m, stats[2u * s]);
            }
        }
        // A chunk's weight, 0 where it saw no row of the query.
        var l = 0.0;
        for (var c = 0u; c < p.n_chunks; c++) {
            let s = (c * p.q_count + local) * p.n_heads + h;
            let sum = stats[2u * s + 1u];
            var wc = 0.0;
            if sum > 0.0 {
                wc = exp(stats[2u * s] - m);
                l += sum * wc;
            }
            if c < W {
                w[c] = wc;
            }
        }
        let inv = select(0.0, 1.0 / l, l > 0.0);
        for (var d = lid; d < p.d_v; d += LANES) {
            var o = 0.0;
            for (var c = 0u; c < p.n_chunks; c++) {
                let s = (c * p.q_count + local) * p.n_heads + h;
                if stats[2u * s + 1u] > 0.0 {
                    var wc = 0.0;
                    if c < W {
                        wc = w[c];
                    } else {
                        wc = exp(stats[2u * s] - m);
                    }
                    o += part[s * p.d_v + d] * wc;
                }
            }
            out[view_at(p.view_out, qi, h, d)] = o * inv;
        }
    }
}
