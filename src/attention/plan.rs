//! The attention planner: from the shapes of one call and the device's facts, the dispatch sizes and
//! kernel parameters of both passes. Pure: no wgpu object, so every rule is unit-tested on the CPU.
//!
//! Besides the device's limits it keeps one rule of the software adapters: Mesa's llvmpipe and
//! lavapipe stop every loop of one shader invocation once 65,535 iterations have run in total, with
//! no error, so an invocation that walks a long context would silently drop its last rows. The
//! planner counts the loop iterations an invocation of each pass performs (as the WGSL is written,
//! before any unrolling) and cuts the context into chunks short enough to stay within
//! [`LOOP_BUDGET`], on every adapter.

use crate::codec::DType;
use crate::kernels::{AttnParams, HEAD_BATCHES, ROWS_PER_INVOCATION};

/// Rows per tile of pass 1 with one row per invocation (`TILE` in the shaders).
pub(crate) const TILE: usize = 64;
/// Most loop iterations one invocation may run: well below Mesa's silent limit of 65,535.
pub(crate) const LOOP_BUDGET: usize = 49_152;
/// Pass 1 aims for at least this many workgroups, so that a single decode query fills a large GPU.
const TARGET_WORKGROUPS: usize = 1024;
/// On CPU adapters (llvmpipe, lavapipe, WARP) each workgroup has a fixed cost that outweighs the
/// parallelism of more chunks; a few per core suffice there.
const TARGET_WORKGROUPS_CPU: usize = 16;

/// What the planner needs to know of the device.
#[derive(Clone, Copy, Debug)]
pub(crate) struct DeviceFacts {
    pub max_workgroups: usize,
    pub max_binding: u64,
    pub cpu: bool,
}

/// The shapes of one call, already checked against each other and the layer.
#[derive(Clone, Copy, Debug)]
pub(crate) struct CallShape {
    pub dtype: DType,
    pub n_q: usize,
    pub n_heads: usize,
    pub n_kv: usize,
    pub d_a: usize,
    pub d_b: usize,
    pub d_v: usize,
    pub visible: usize,
    pub row_words: [usize; 3],
    /// Rows a query may see ending at its own (`0`: no window), already at most `visible`.
    pub window: usize,
    pub scale: f32,
    /// `0`: no soft-cap.
    pub soft_cap: f32,
}

/// The dispatches of one call: pairs of (pass 1, reduce), each for `q_per_pair` of the queries (the
/// last pair for the rest), so that one pair's partial results fit one storage binding.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Dispatch {
    /// The parameters of the first pair; [`Dispatch::pairs`] gives every pair's.
    pub params: AttnParams,
    /// Index into `HEAD_BATCHES`.
    pub batch: usize,
    /// Index into `ROWS_PER_INVOCATION`.
    pub rpl: usize,
    /// Workgroups of pass 1 (chunks, KV heads x head batches) and of the reduce (heads); the third
    /// dimension of both is the pair's query count.
    pub pass1: (u32, u32),
    pub pass2: u32,
    pub q_per_pair: usize,
    /// Scratch bytes one pair needs.
    pub stats_bytes: u64,
    pub part_bytes: u64,
    /// Bytes of the output `[n_q, n_heads, d_v]` f32.
    pub out_bytes: u64,
}

impl Dispatch {
    /// The parameters of every pair, in order.
    pub(crate) fn pairs(&self) -> impl Iterator<Item = AttnParams> + '_ {
        let n_q = self.params.n_q as usize;
        (0..n_q)
            .step_by(self.q_per_pair.max(1))
            .map(move |q| AttnParams {
                q_first: q as u32,
                q_count: self.q_per_pair.min(n_q - q) as u32,
                ..self.params
            })
    }
}

/// Loop iterations of one pass-1 invocation per tile, counted from `attention_partial.wgsl` (every
/// back-edge of every loop it may run, the worst invocation of the workgroup).
pub(crate) fn pass1_iterations_per_tile(
    dtype: DType,
    d_a: usize,
    d_b: usize,
    d_v: usize,
    hb: usize,
    rpl: usize,
) -> usize {
    let span = TILE * rpl;
    // One step of a dot product: the row loads (rpl), the heads (hb), the rows per head (hb * rpl).
    let step = 1 + rpl + hb * (1 + rpl);
    let dot = |d: usize| {
        if d == 0 {
            return 0;
        }
        let steps = match dtype {
            // Four elements per step, then one per step.
            DType::F32 => d / 4 + d % 4,
            // Packed words (one more when the slice starts on an odd element), two per step, then
            // one.
            _ => {
                let words = d.div_ceil(2) + 1;
                words / 2 + words % 2
            }
        };
        rpl + steps * step
    };
    // The value phase: per 4 output dims, every row of the tile for every head (and the up-to-4
    // element fallback of a partial quad), then the stores.
    let value = d_v.div_ceil(4 * TILE) * (1 + span * (1 + hb + 4) + hb * (1 + 4));
    1 + rpl + dot(d_a) + dot(d_b) + rpl * (1 + hb) + span + rpl * (1 + hb) + span + value
}

/// Loop iterations of one reduce invocation (`attention_reduce.wgsl`) over `n_chunks`.
pub(crate) fn reduce_iterations(n_chunks: usize, d_v: usize) -> usize {
    2 * n_chunks + d_v.div_ceil(64) * (1 + n_chunks)
}

/// Plans one call, or says why the device cannot run it.
pub(crate) fn plan(s: &CallShape, dev: &DeviceFacts) -> Result<Dispatch, String> {
    let group = s.n_heads / s.n_kv;
    let batch = HEAD_BATCHES
        .iter()
        .position(|&b| group.is_multiple_of(b))
        .unwrap_or(HEAD_BATCHES.len() - 1);
    let hb = HEAD_BATCHES[batch];
    let n_batches = group / hb;
    let per_chunk = s.n_kv * n_batches * s.n_q;
    for (what, n) in [
        ("queries", s.n_q),
        ("query heads", s.n_heads),
        ("KV heads x head batches", s.n_kv * n_batches),
    ] {
        if n > dev.max_workgroups {
            return Err(format!(
                "{n} {what} exceed the device's {} workgroups per dispatch dimension",
                dev.max_workgroups
            ));
        }
    }
    let target = if dev.cpu {
        TARGET_WORKGROUPS_CPU
    } else {
        TARGET_WORKGROUPS
    };
    // The rows any query can see.
    let lo = match s.window {
        0 => 0,
        w => (s.visible - s.n_q + 1).saturating_sub(w),
    };
    let rows = s.visible - lo;
    // Rows per invocation: as many as the heads allow, unless a chunk of 64-row tiles would be
    // shorter than one tile of them (short contexts keep their parallelism), and never so many that
    // one tile alone runs past the loop budget.
    let chunks_64 = target.div_ceil(per_chunk).min(rows.div_ceil(TILE)).max(1);
    let rows_per_chunk = rows.div_ceil(chunks_64);
    let per_tile = |rpl: usize| {
        pass1_iterations_per_tile(s.dtype, s.d_a, s.d_b, s.d_v, hb, ROWS_PER_INVOCATION[rpl])
    };
    let fits = |rpl: usize| per_tile(rpl) < LOOP_BUDGET;
    let Some(rpl) = ROWS_PER_INVOCATION.iter().enumerate().rposition(|(i, &r)| {
        fits(i) && (r == 1 || ((32 / hb).clamp(1, 8) >= r && TILE * r <= rows_per_chunk))
    }) else {
        return Err(format!(
            "one tile of {TILE} rows with {hb} heads per workgroup, d = {} + {} and d_v = {} needs {} \
             loop iterations per invocation, more than the {LOOP_BUDGET} every adapter runs",
            s.d_a,
            s.d_b,
            s.d_v,
            per_tile(0)
        ));
    };
    let tile = TILE * ROWS_PER_INVOCATION[rpl];
    let tiles = rows.div_ceil(tile);
    let out_bytes = (s.n_q * s.n_heads * s.d_v * 4) as u64;
    // Partial results of one query in one chunk: the unnormalised output and (max, sum) per head.
    let query_chunk_bytes = (s.n_heads * s.d_v.max(2) * 4) as u64;
    let by_binding = usize::try_from(dev.max_binding / query_chunk_bytes).unwrap_or(usize::MAX);
    let want = target
        .div_ceil(per_chunk)
        .min(tiles)
        .min(by_binding)
        .min(dev.max_workgroups)
        .max(1);
    let max_tiles = ((LOOP_BUDGET - 1) / per_tile(rpl)).max(1);
    let tiles_per_chunk = tiles.div_ceil(want).min(max_tiles);
    let n_chunks = tiles.div_ceil(tiles_per_chunk);
    let q_per_pair = usize::try_from(dev.max_binding / (n_chunks as u64 * query_chunk_bytes))
        .unwrap_or(usize::MAX)
        .min(s.n_q);
    if n_chunks > dev.max_workgroups
        || q_per_pair == 0
        || reduce_iterations(n_chunks, s.d_v) >= LOOP_BUDGET
    {
        return Err(format!(
            "{rows} rows need {n_chunks} chunks of at most {} rows to stay within the loop budget, \
             more than this device can merge for one query of {} heads x {}",
            tiles_per_chunk * tile,
            s.n_heads,
            s.d_v,
        ));
    }
    let stats_bytes = (n_chunks * q_per_pair * s.n_heads * 2 * 4) as u64;
    let part_bytes = (n_chunks * q_per_pair * s.n_heads * s.d_v * 4) as u64;
    let params = AttnParams {
        n_q: s.n_q as u32,
        n_heads: s.n_heads as u32,
        group: group as u32,
        n_batches: n_batches as u32,
        d_a: s.d_a as u32,
        d_b: s.d_b as u32,
        d_v: s.d_v as u32,
        visible: s.visible as u32,
        row_words_a: s.row_words[0] as u32,
        row_words_b: s.row_words[1] as u32,
        row_words_v: s.row_words[2] as u32,
        window: s.window as u32,
        lo: lo as u32,
        chunk_len: (tiles_per_chunk * tile) as u32,
        n_chunks: n_chunks as u32,
        n_kv: s.n_kv as u32,
        scale: s.scale,
        soft_cap: s.soft_cap,
        q_first: 0,
        q_count: q_per_pair as u32,
    };
    Ok(Dispatch {
        params,
        batch,
        rpl,
        pass1: (n_chunks as u32, (s.n_kv * n_batches) as u32),
        pass2: s.n_heads as u32,
        q_per_pair,
        stats_bytes,
        part_bytes,
        out_bytes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const LAVAPIPE: DeviceFacts = DeviceFacts {
        max_workgroups: 65535,
        max_binding: 128 << 20,
        cpu: true,
    };
    const GPU: DeviceFacts = DeviceFacts {
        max_workgroups: 65535,
        max_binding: 2 << 30,
        cpu: false,
    };

    fn gqa(
        dtype: DType,
        n_q: usize,
        n_heads: usize,
        n_kv: usize,
        d: usize,
        visible: usize,
    ) -> CallShape {
        let per_word = if dtype == DType::F32 { 1 } else { 2 };
        let row_words = (n_kv * d).div_ceil(per_word);
        CallShape {
            dtype,
            n_q,
            n_heads,
            n_kv,
            d_a: d,
            d_b: 0,
            d_v: d,
            visible,
            row_words: [row_words; 3],
            window: 0,
            scale: 1.0,
            soft_cap: 0.0,
        }
    }

    fn mla(dtype: DType, n_q: usize, visible: usize) -> CallShape {
        let per_word = if dtype == DType::F32 { 1 } else { 2 };
        CallShape {
            d_a: 512,
            d_b: 64,
            d_v: 512,
            n_kv: 1,
            n_heads: 16,
            row_words: [512 / per_word, 64 / per_word, 512 / per_word],
            ..gqa(dtype, n_q, 16, 1, 512, visible)
        }
    }

    /// The most loop iterations one invocation of either pass runs.
    fn worst_iterations(s: &CallShape, d: &Dispatch) -> usize {
        let rpl = ROWS_PER_INVOCATION[d.rpl];
        let tiles = d.params.chunk_len as usize / (TILE * rpl);
        let per_tile =
            pass1_iterations_per_tile(s.dtype, s.d_a, s.d_b, s.d_v, HEAD_BATCHES[d.batch], rpl);
        (tiles * per_tile).max(reduce_iterations(d.n_chunks(), s.d_v))
    }

    impl Dispatch {
        fn n_chunks(&self) -> usize {
            self.params.n_chunks as usize
        }
    }

    #[test]
    fn a_4096_row_decode_is_split_into_chunks() {
        for dev in [LAVAPIPE, GPU] {
            let d = plan(&gqa(DType::F16, 1, 32, 8, 128, 4096), &dev).unwrap();
            assert!(d.n_chunks() > 1, "{dev:?}: {d:?}");
            assert!(d.params.chunk_len as usize * d.n_chunks() >= 4096);
            assert_eq!(d.pass1, (d.params.n_chunks, 8));
            assert_eq!(d.pairs().count(), 1);
        }
    }

    #[test]
    fn no_invocation_runs_past_the_loop_budget() {
        let mut checked = 0;
        for dtype in DType::ALL {
            for &(n_heads, n_kv, d) in &[
                (32, 8, 128),
                (4, 1, 64),
                (16, 16, 256),
                (8, 1, 576),
                (1, 1, 8),
            ] {
                for &n_q in &[1, 8, 16, 64] {
                    for &visible in &[64, 2048, 13_000, 16_384, 65_536, 524_288] {
                        if n_q > visible {
                            continue;
                        }
                        for dev in [LAVAPIPE, GPU] {
                            let s = gqa(dtype, n_q, n_heads, n_kv, d, visible);
                            let Ok(p) = plan(&s, &dev) else { continue };
                            let worst = worst_iterations(&s, &p);
                            assert!(worst < LOOP_BUDGET, "{s:?} {dev:?}: {worst} iterations");
                            assert!(p.params.chunk_len as usize * p.n_chunks() >= visible);
                            checked += 1;
                        }
                    }
                }
            }
            for &n_q in &[1, 16, 64] {
                for &visible in &[2048, 16_384, 131_072] {
                    let s = mla(dtype, n_q, visible);
                    let p = plan(&s, &LAVAPIPE).unwrap();
                    assert!(worst_iterations(&s, &p) < LOOP_BUDGET, "{s:?}");
                    checked += 1;
                }
            }
        }
        assert!(checked > 300, "{checked} plans checked");
    }

    #[test]
    fn the_reported_failures_are_now_planned_within_the_budget() {
        // 16 queries over 16,384 rows (one workgroup used to walk it all) and MLA with 16 queries over
        // 2,048 rows, DeepSeek-V2-Lite shapes.
        let s = gqa(DType::F32, 16, 32, 8, 128, 16_384);
        let p = plan(&s, &LAVAPIPE).unwrap();
        assert!(p.n_chunks() > 1);
        assert!(worst_iterations(&s, &p) < LOOP_BUDGET);
        let s = mla(DType::F16, 16, 2048);
        let p = plan(&s, &LAVAPIPE).unwrap();
        assert!(worst_iterations(&s, &p) < LOOP_BUDGET);
    }

    #[test]
    fn queries_whose_partials_overflow_one_binding_are_split_into_pairs() {
        // 4096 queries of 32 heads x 128 over 512k rows, and MLA chunked prefill at 128k.
        for s in [
            gqa(DType::F32, 4096, 32, 8, 128, 524_288),
            mla(DType::F32, 64, 131_072),
        ] {
            let d = plan(&s, &LAVAPIPE).unwrap();
            assert!(d.part_bytes <= LAVAPIPE.max_binding && d.stats_bytes <= LAVAPIPE.max_binding);
            let pairs: Vec<_> = d.pairs().collect();
            assert!(pairs.len() > 1, "{d:?}");
            // The pairs cover every query once, in order.
            let mut next = 0;
            for p in &pairs {
                assert_eq!(p.q_first, next);
                assert!(p.q_count >= 1 && p.q_count as usize <= d.q_per_pair);
                next += p.q_count;
            }
            assert_eq!(next as usize, s.n_q);
        }
    }
}
