//! The attention planner: from the shapes of one call and the device's facts, the dispatch sizes and
//! kernel parameters of both passes. Pure: no wgpu object, so every rule is unit-tested on the CPU.
//!
//! Besides the device's limits it keeps one rule of the software adapters: Mesa's llvmpipe and
//! lavapipe stop every loop of one shader invocation once 65,535 iterations have run in total, with
//! no error, so an invocation that walks a long context would silently drop its last rows. The
//! planner counts the loop iterations an invocation of each pass performs (as the WGSL is written,
//! before any unrolling) and cuts the context into chunks short enough to stay within
//! [`LOOP_BUDGET`], on every adapter.

use super::stream::{self, ALONE_TEAMS, StreamKey, TeamSum};
use crate::codec::DType;
use crate::error::{AttentionLimit, AttentionProblem, Error};
use crate::kernels::{
    AttnParams, HEAD_BATCHES, REDUCE_LANES, REDUCE_SPLIT_BYTES, REDUCE_SPLIT_ELEMENTS,
    REDUCE_SPLIT_LANES, ROWS_PER_INVOCATION, TILED_WORKGROUP_BYTES,
};
pub(crate) use crate::placement::Paging;

/// Rows per tile of pass 1 with one row per invocation (`TILE` in the shaders).
pub(crate) const TILE: usize = 64;
/// Most loop iterations one invocation may run: well below Mesa's silent limit of 65,535.
pub(crate) const LOOP_BUDGET: usize = 49_152;
/// Pass 1 aims for at least this many workgroups, so that a single decode query fills a large GPU
/// (the tiled kernel's default on GPUs).
const TARGET_WORKGROUPS: usize = 1024;
/// The streaming kernels' default on GPUs for values of [`GPU_TARGET_D_V`] elements or fewer; for
/// longer values proportionally fewer, down to [`TARGET_WORKGROUPS`]: the reduce merges values of
/// `d_v` elements from every chunk, so its work grows with both. On an H200 (docs/benchmarks.md,
/// 2026-12-04) Llama-3-8B's GQA decode (d_v 128, 8 teams, four rows per iteration) at 32k-128k
/// rows took 0.66-0.86 (f32) and 0.80-0.89 (f16) of its time at 1,024 with 4,096 (512 chunks per
/// team). 2,048 took 0.79-0.92 of 4,096's time in f32 but 1.16-1.27 in f16; 8,192 and 16,384 were
/// slower but for f32 at 128k (8,192: 0.97). DeepSeek-V2-Lite's MLA (d_v 512) was fastest at 1,024
/// of 1,024, 2,048 and 4,096.
const TARGET_WORKGROUPS_GPU: usize = 4096;
const GPU_TARGET_D_V: usize = 128;
/// The largest workgroup target an app's is taken as: more than any plan can use (a query's chunks
/// stay within the device's grid), and small enough for the planner's arithmetic on 32-bit targets.
const MOST_TARGET: usize = 1 << 24;
/// On CPU adapters (llvmpipe, lavapipe, WARP) each workgroup has a fixed cost that outweighs the
/// parallelism of more chunks; a few per core suffice there.
const TARGET_WORKGROUPS_CPU: usize = 16;
/// The streaming kernel on CPU adapters: workgroups per call (each is one team of a few lanes).
const STREAM_WORKGROUPS_CPU: usize = 32;
/// Most f32 registers one lane of a streaming team may hold (queries, accumulators, one row's
/// elements); shapes that need more use the tiled kernel. More heads per team means fewer teams
/// loading each row: on lavapipe DeepSeek-V2-Lite's MLA ran about 1.2-1.5x faster with 4 heads per
/// team (616 floats) than with 1 (208); 8 heads (1,160) gained a little more but compiled for
/// seconds longer per shape. Its q8_0, q4_0 and fp8 rows take 656 with 4 heads (the 64-element rope
/// key is one 16-element vector on each of 4 lanes): with 2 heads per team, under the earlier 640,
/// their attention took 1.03-1.08x the f16 time at 16k; with 4, 0.78-0.86x.
pub(crate) const LANE_FLOATS: usize = 656;
/// The same for MLA's subgroup kernel on CPU adapters, which takes [`MLA_CPU_STEP_ROWS`] rows per
/// loop iteration (every row's elements count): DeepSeek-V2-Lite's latent rows take 8 heads per
/// team (1,376 floats for f32 and 16-bit storage, 1,472 for q8_0, q4_0 and fp8, whose 64-element
/// rope key is four 16-element vectors, one vector's registers on each of the 8 lanes), so each
/// row is loaded by 2 teams instead of 4, and each spilled query element and accumulator serves
/// every row of the iteration. On lavapipe two rows and 8 heads took 0.69-0.81 of the time of 4
/// heads and one row (f32, f16; q8_0, q4_0 and bf16 0.76-0.87; two rows alone gained 5-10%, 8
/// heads alone 10-13%; 16 heads, one team per row, compiled for 44 s and ran no faster), and four
/// rows 0.79-0.91 of the time of two (docs/benchmarks.md).
pub(crate) const LANE_FLOATS_MLA_CPU: usize = 1472;
/// Rows of one loop iteration of MLA's subgroup teams on CPU adapters ([`StreamKey::step_rows`]):
/// on lavapipe DeepSeek-V2-Lite's decode at 4k took 0.79-0.91 of the time of two rows for every
/// storage type (f32, f16, bf16, q8_0, q4_0, e4m3), and a first call's compile with an empty
/// shader cache 1.5-1.9 times as long (15-23 s against 9-12 per storage type;
/// docs/benchmarks.md). Where four rows would leave a team fewer heads than two (subgroups of 4
/// lanes), it takes two.
pub(crate) const MLA_CPU_STEP_ROWS: u32 = 4;
/// The same for the kernel that sums through workgroup memory (OpenGL, the browser): its kernels are
/// kept smaller, since there a cold shader compile is what a first call waits for (Mesa's GL path
/// took seconds for DeepSeek-V2-Lite's MLA with 4 heads per team).
pub(crate) const LANE_FLOATS_SHARED: usize = 320;
/// The same on CPU adapters, whose teams have 8 lanes (OpenGL's llvmpipe): two heads of
/// DeepSeek-V2-Lite's MLA per team (344 floats) instead of one, so each latent row is loaded by 8
/// teams instead of 16. On llvmpipe GL its decode at 32k rows took 0.66-0.75 of the time (f16 and
/// f32), and a first call's compile 2.1-2.7 s against 1.3-1.6 (an empty shader cache). Four heads
/// (616 floats) took 0.45-0.7 of the time but 5.5-6.5 s to compile (docs/benchmarks.md). GQA's
/// teams of 8 lanes are unchanged: Llama-3-8B's group of 4 fits either budget whole.
pub(crate) const LANE_FLOATS_SHARED_CPU: usize = 344;
/// The same for the kernel whose teams are one invocation ([`TeamSum::Alone`]): it holds whole
/// rows.
pub(crate) const LANE_FLOATS_ALONE: usize = 800;
/// Workgroups per host thread for teams of several KV heads on a CPU adapter: each is a quarter of
/// a row's KV heads or more, and fewer, longer chunks leave less to the reduce. On lavapipe (2
/// threads, so 8 workgroups instead of 32) Llama-3-8B's decode at 512 rows took 0.88-0.97 ms (f32)
/// and 0.70-0.82 (f16) against 1.03-1.17 and 0.88-1.17; at 4k the same within the noise
/// (docs/benchmarks.md). The same for MLA's teams of several rows per iteration (8 heads): on
/// lavapipe, with two rows, DeepSeek-V2-Lite's decode at 512 rows took 0.60-0.71 of the time of 32
/// workgroups, at 4k 0.92-0.99.
const KV_TEAM_WORKGROUPS_PER_CORE: usize = 4;
/// Queries per team on CPU adapters with subgroups, the most first ([`StreamKey::queries`]).
/// [`crate::Attention::prepare`] builds the kernels of calls of each of these counts beside
/// decode's. Calls of 2 or 3 queries keep decode's kernel: each team size is one more kernel to
/// compile (about 2 s for Llama-3-8B's on lavapipe with an empty shader cache).
pub(crate) const QUERIES_PER_TEAM: [usize; 2] = [8, 4];
/// KV heads per subgroup team on CPU adapters, the most first ([`StreamKey::kvs`]).
const KV_HEADS_PER_TEAM: [usize; 3] = [8, 4, 2];
/// The first Mesa whose lavapipe runs GQA over 16-bit and narrower storage faster in teams of one
/// KV head than of several. Mesa 22.3.6's lavapipe loads a storage vector lane by lane, component
/// by component, so a team that reads a run of the row saves loads: there Llama-3-8B's decode at 4k
/// took about half the time of teams of one KV head when teams of several came in (0.69 of it in a
/// probe on 2026-12-07). Mesa 25.0.7's lavapipe loads faster (a plain stream of 32-byte vectors
/// read 1.4-1.5 times faster): there teams of one KV head, in the fixed 32 workgroups of such teams
/// instead of 4 per host thread (2 threads measured), took 0.71-0.85 of the time of teams of 4
/// over f16 and q8_0 wherever the cache's buffers lay, and 0.76 over bf16; q4_0 and fp8 were not
/// measured and follow them. Over f32 (rows of 4 KiB) they took 0.45-0.67 of it where the cache's
/// buffers were allocated first and 1.2-1.4 times it where they came after a 128 MiB buffer
/// (docs/benchmarks.md): f32 keeps the teams of several. Mesa 23 and 24, Mesa before 22.3 and
/// drivers that do not say their version were not measured, and keep 22.3's teams.
pub(crate) const MESA_ONE_KV_HEAD: (u32, u32) = (25, 0);
/// Fewest rows of a chunk of the kernel whose teams are one invocation, where the rows allow: each
/// team loads its queries and writes its partial output once per chunk, whole heads of both.
const ALONE_MIN_ROWS: usize = 64;
/// Most rows of one streaming chunk: one loop iteration per row, within the loop budget. (A team of
/// one invocation that takes blocks of rows through a page table may take one block,
/// [`stream::ALONE_BLOCK_ROWS`] rows, more than a chunk.)
const STREAM_MAX_ROWS: usize = LOOP_BUDGET - 1 - stream::ALONE_BLOCK_ROWS as usize;
/// Rows of one loop iteration of GQA's subgroup teams on GPUs over a contiguous f32 cache
/// ([`StreamKey::step_rows`]): a team of one subgroup walks its chunk waiting on each row's loads,
/// and a second row per iteration puts more loads in flight at once. On an H200 (4,096
/// workgroups, Llama-3-8B at 32k-128k rows) two rows took 0.89-0.92 of the time of one in f32 but
/// the same within 1% in f16, and four rows 1.13-1.24 and 1.33-1.35 of it. A ragged batch through
/// a page table took 1.35-1.36 of the time with two rows (f32; f16 the same). So only f32 slots
/// over contiguous rows take two. (Two rows for every storage type had not slowed lavapipe's cold
/// attention suite, which runs the GPU plans: side by side on one host it took 530 s with them and
/// 575-633 s with this rule; docs/benchmarks.md.)
pub(crate) const GPU_STEP_ROWS: u32 = 2;
/// Lanes of a streaming team summed through workgroup memory: on CPU adapters 8 (one SIMD vector of
/// llvmpipe), elsewhere 32.
const SHARED_LANES_CPU: u32 = 8;
const SHARED_LANES_GPU: u32 = 32;

/// What the planner needs to know of the device.
#[derive(Clone, Copy, Debug)]
pub(crate) struct DeviceFacts {
    pub max_workgroups: usize,
    pub max_binding: u64,
    /// `min_storage_buffer_offset_alignment`: where a query or output binding may start.
    pub offset_alignment: u64,
    pub cpu: bool,
    /// The host's threads, where a CPU adapter runs its workgroups (`available_parallelism`; 4
    /// where the platform does not say).
    pub cores: usize,
    /// The subgroup size, when the device has subgroups and every subgroup has this size.
    pub subgroup: Option<u32>,
    /// The device has `wgpu::Features::SHADER_INT64`.
    pub int64: bool,
    /// The version of Mesa whose driver the adapter is (lavapipe, llvmpipe's OpenGL), where its
    /// driver information says so.
    pub mesa: Option<(u32, u32)>,
    /// `max_storage_buffers_per_shader_stage` and `max_bind_groups`: pass 1 binds
    /// [`ATTENTION_STORAGE_BUFFERS`] in three groups.
    pub storage_buffers: u32,
    pub bind_groups: u32,
    /// `max_compute_workgroup_storage_size`: the tiled kernel needs
    /// [`TILED_WORKGROUP_BYTES`](crate::kernels::TILED_WORKGROUP_BYTES).
    pub workgroup_bytes: u64,
    /// Which pass-1 kernel the app asked for.
    pub choice: KernelChoice,
    /// The app's pass-1 workgroup target ([`crate::Attention::set_target_workgroups`]), in place of
    /// the adapter's default.
    pub target: Option<usize>,
}

/// Storage buffers attention's pass 1 binds in one stage: slots a, b and v and the page table,
/// the queries (a and b), the statistics and the partial results.
pub(crate) const ATTENTION_STORAGE_BUFFERS: u32 = 8;

/// Which pass-1 kernel attention uses. [`KernelChoice::Auto`] (the default) picks the streaming
/// kernel wherever the shape allows it: every head dimension (GQA's `d_k` and `d_v`, MLA's
/// `compressed_kv` and `k_pe` widths) a whole number of vectors of its slot's storage (4 f32, 8 f16
/// or bf16, 16 q8_0, q4_0 or fp8 elements), rows of whole 16-byte vectors (q8_0 and q4_0 rows,
/// whose scales follow the values, may end inside one), and few enough floats per lane for a team
/// of one query head. It sums across a subgroup when the device has subgroups of one fixed size.
/// The tiled kernel takes every other shape, and the calls whose streaming kernel the device
/// refuses (a generated kernel it cannot compile: the refusal is kept, so later calls fall back at
/// once).
/// The others force one kernel, for comparisons and tests; a call the forced kernel cannot run, or
/// whose kernel the device refuses, is refused with
/// [`AttentionProblem::DeviceLimit`](crate::AttentionProblem::DeviceLimit).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum KernelChoice {
    /// The streaming kernel where the shape and the device allow it, else the tiled one (see
    /// above).
    #[default]
    Auto,
    /// One workgroup per KV head and chunk, tiles of rows scored one row per invocation
    /// (`shaders/attention_partial.wgsl`): every shape, every adapter.
    Tiled,
    /// The generated streaming kernel, its lanes summing through workgroup memory.
    StreamShared,
    /// The generated streaming kernel summing across a subgroup (`subgroupAdd`, or steps of
    /// `subgroupShuffleXor` on CPU adapters; needs `wgpu::Features::SUBGROUP` and one subgroup size).
    StreamSubgroup,
    /// The generated streaming kernel with one invocation per team: each reads whole rows of its
    /// own chunk, so there is nothing to sum between invocations (any adapter; what CPU adapters
    /// without subgroups pick).
    StreamAlone,
}

/// The pass-1 kernel of a planned call.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Pass1 {
    /// `attention_partial.wgsl` for the storage types of slots a, b and v, whether scores read slot
    /// b (MLA; GQA's kernels leave that code out), with (`HEAD_BATCHES` index,
    /// `ROWS_PER_INVOCATION` index) and how it finds rows.
    Tiled {
        dtypes: [DType; 3],
        slot_b: bool,
        batch: usize,
        rpl: usize,
        rows: RowMode,
    },
    Stream(StreamKey),
}

/// The shapes of one call, already checked against each other and the layer.
#[derive(Clone, Copy, Debug)]
pub(crate) struct CallShape {
    /// Storage types of slots a, b and v (slot b is slot a when there is none: GQA).
    pub dtypes: [DType; 3],
    /// Scales of slots a, b and v (1 but for scaled fp8 slots).
    pub scales: [f32; 3],
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
    /// Values are slot a's elements (MLA's latent): slot v is slot a and `d_v == d_a`.
    pub v_from_a: bool,
    /// Rows read through a page table (a sequence of a paged pool).
    pub paging: Option<Paging>,
    /// A ragged batch of a paged pool's sequences: each query's own row and table entry come from the
    /// query table (`n_q` counts them all, `visible` is the longest sequence's).
    pub ragged: Option<Ragged>,
}

/// Bytes of one query's entry in a ragged batch's query table: its own row and its first page-table
/// entry, two 32-bit words.
pub(crate) const QUERY_TABLE_BYTES: u64 = 8;

/// What the recorder adds to each word of a query table: the table lies in the statistics binding,
/// an `array<f32>`, and a row number below 2^23 would be the bit pattern of a subnormal f32, which
/// an adapter that flushes subnormals could read as 0. Biased by 2^23, every word is a normal
/// positive f32 (the kernels subtract the bias after `bitcast<u32>`; shaders/shared/rows.wgsl).
pub(crate) const QUERY_TABLE_BIAS: u32 = 1 << 23;

/// The largest value a query table holds: biased, it stays below f32's infinity (0x7f800000).
pub(crate) const QUERY_TABLE_MAX: u32 = 0x7f7f_ffff - QUERY_TABLE_BIAS;

/// What the planner knows of a ragged batch's queries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Ragged {
    /// The first row any query sees.
    pub lo: usize,
    /// Rows all queries see together: the work of one team.
    pub seen: usize,
}

/// Chunks a ragged batch's rows need so that the work of its busiest sequence is spread like the
/// rest: chunks of about `teams · seen / target` rows. Chunks only cover the longest sequence (a
/// query's chunks past its own rows end at once), so without this one long sequence among short
/// ones would be one chunk on one core.
fn ragged_chunks(s: &CallShape, rows: usize, teams: usize, target: usize) -> usize {
    s.ragged.map_or(1, |r| {
        rows.saturating_mul(target)
            .div_ceil(teams.saturating_mul(r.seen).max(1))
    })
}

/// How pass 1 finds a query's rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum RowMode {
    /// The visible rows of one cache, the queries its last `n_q`.
    Contiguous,
    /// The same, through one sequence's page table.
    Paged,
    /// A batch of sequences: per query its own row and page-table entry, from the query table.
    Ragged,
}

impl RowMode {
    /// The shader's `ROWS` constant.
    pub(crate) fn code(self) -> u32 {
        self as u32
    }
}

impl CallShape {
    pub(crate) fn row_mode(&self) -> RowMode {
        match (self.paging, self.ragged) {
            (None, _) => RowMode::Contiguous,
            (Some(_), None) => RowMode::Paged,
            (Some(_), Some(_)) => RowMode::Ragged,
        }
    }
}

/// The dispatches of one call: pairs of (pass 1, reduce), each for `q_per_pair` of the queries (the
/// last pair for the rest), so that one pair's partial results fit one storage binding.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Dispatch {
    /// The parameters of the first pair; [`Dispatch::pairs`] gives every pair's.
    pub params: AttnParams,
    pub kernel: Pass1,
    /// Workgroups of pass 1 (chunks, KV heads x head batches: its grid is chunks x the pair's
    /// teams of queries x teams, [`Dispatch::pass1_grid`]) and of the reduce per query (its grid is
    /// that x the pair's queries).
    pub pass1: (u32, u32),
    pub pass2: u32,
    /// Invocations per reduce workgroup, one of [`REDUCE_LANES`].
    pub reduce_lanes: u32,
    pub q_per_pair: usize,
    /// Scratch bytes one pair needs.
    pub stats_bytes: u64,
    pub part_bytes: u64,
}

impl Dispatch {
    /// The workgroups of pass 1 for a pair of `q_count` queries: (chunks, teams of queries, KV
    /// heads x head batches), a team of queries holding [`StreamKey::queries`] of them.
    pub(crate) fn pass1_grid(&self, q_count: u32) -> (u32, u32, u32) {
        let queries = match self.kernel {
            Pass1::Stream(key) => key.queries,
            Pass1::Tiled { .. } => 1,
        };
        let (chunks, teams) = self.pass1;
        (chunks, q_count.div_ceil(queries), teams)
    }

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

/// Bytes of one scratch binding (partial results, or statistics and a batch's query table): the
/// device's binding limit in whole 16-byte vectors, as the kernels bind the partial results
/// (`array<vec4<f32>>`, whose length rounds down). Vulkan and DX12 report limits such as 2^31 - 1.
fn scratch_binding(dev: &DeviceFacts) -> u64 {
    crate::kernels::whole_vectors_within(dev.max_binding)
}

/// Loop iterations of one pass-1 invocation per tile, counted from `attention_partial.wgsl` (every
/// back-edge of every loop it may run, the worst invocation of the workgroup); `usize::MAX` where
/// they do not fit `usize` (wasm32: heads of 2^27 elements come to billions).
pub(crate) fn pass1_iterations_per_tile(
    dtypes: [DType; 3],
    d_a: usize,
    d_b: usize,
    d_v: usize,
    hb: usize,
    rpl: usize,
) -> usize {
    // Counted in u64: rows of at most u32::MAX elements and at most 16 heads and 8 rows per
    // invocation keep every term below 2^48.
    let [d_a, d_b, d_v, hb, rpl] = [d_a, d_b, d_v, hb, rpl].map(|x| x as u64);
    let total = pass1_iterations_u64(dtypes, d_a, d_b, d_v, hb, rpl);
    usize::try_from(total).unwrap_or(usize::MAX)
}

fn pass1_iterations_u64(
    dtypes: [DType; 3],
    d_a: u64,
    d_b: u64,
    d_v: u64,
    hb: u64,
    rpl: u64,
) -> u64 {
    let span = TILE as u64 * rpl;
    // One step of a dot product: the row loads (rpl), the heads (hb), the rows per head (hb * rpl).
    let step = 1 + rpl + hb * (1 + rpl);
    let dot = |d: u64, dtype: DType| {
        if d == 0 {
            return 0;
        }
        let steps = match dtype {
            // Four elements per step, then one per step.
            DType::F32 => d / 4 + d % 4,
            // Whole words two per step (four elements) from the first element that starts a
            // word, then one element per step: an element alone where the slice starts inside a
            // word, and the one to three the steps leave. A slice starts at `kv * d`, inside a
            // word only where d is odd: then the more of the two starts. (Quantized rows take
            // four elements per step: fewer.)
            _ => {
                let steps = |lead: u64| lead + (d - lead) / 4 + (d - lead) % 4;
                if d.is_multiple_of(2) {
                    steps(0)
                } else {
                    steps(0).max(steps(1))
                }
            }
        };
        // An fp8 head that does not start on a word (every head after the first where d is not a
        // multiple of 4) loads each row's step element by element (up to four iterations per row),
        // and a last step of fewer than four elements loads its query elements one by one per head.
        let fallback = if dtype.is_fp8() && !d.is_multiple_of(4) {
            steps * rpl * 4 + hb * 4
        } else {
            0
        };
        rpl + steps * step + fallback
    };
    // The value phase: per 4 output dims, every row of the tile for every head (and the up-to-4
    // element fallback of a partial quad), then the stores.
    let value = d_v.div_ceil(4 * TILE as u64) * (1 + span * (1 + hb + 4) + hb * (1 + 4));
    let dots = dot(d_a, dtypes[0]) + dot(d_b, dtypes[1]);
    // The tile loop, the rows, the dot products, the scores' stores, the running max, the
    // exponentials (one loop over the tile's heads and rows), the sum, the values.
    1 + rpl + dots + rpl * (1 + hb) + span + hb * rpl + span + value
}

/// Loop iterations of one reduce invocation (`attention_reduce.wgsl`, workgroups of `lanes`) over
/// `n_chunks`.
pub(crate) fn reduce_iterations(n_chunks: usize, d_v: usize, lanes: u32) -> usize {
    if lanes == REDUCE_SPLIT_LANES {
        // `split`, per block of a head's output: the invocation's share of the chunks for (max,
        // sum) and their tree, then its share of the chunks for its output vector and their tree.
        let lanes = lanes as usize;
        let strides = lanes / (REDUCE_SPLIT_ELEMENTS / 4);
        let tree = |n: usize| n.trailing_zeros() as usize;
        return n_chunks.div_ceil(lanes) + tree(lanes) + n_chunks.div_ceil(strides) + tree(strides);
    }
    // The max and the sum, then per pass of 16 elements per invocation one walk over the chunks.
    2 * n_chunks + d_v.div_ceil(16 * lanes as usize) * (1 + n_chunks)
}

/// Invocations per reduce workgroup: on a CPU adapter 8, one SIMD vector, so that each head's max
/// and sum are worked out once per workgroup rather than once per vector of 8 (a 128-sequence
/// batch's reduce took 25 of its 118 ms on llvmpipe with 64), unless an invocation's share of a long
/// call's chunks would pass the loop budget (then 64). On GPUs [`REDUCE_SPLIT_LANES`], which split
/// the chunks between them, in a workgroup per head and [`REDUCE_SPLIT_ELEMENTS`] of its output,
/// where the device has the workgroup memory and the grid: there an invocation that walks every
/// chunk waits on one load after another, and a single query's reduce, one workgroup per head, was
/// most of the call. On an H200, Llama-3-8B's decode (32 heads) at 32k rows took 2.66-2.80 ms with
/// 2,048 chunks per KV head, against 0.35-0.49 with 128 (docs/benchmarks.md).
fn reduce_lanes(n_chunks: usize, s: &CallShape, dev: &DeviceFacts) -> u32 {
    let [wide, narrow, split] = REDUCE_LANES;
    let d_v = s.d_v;
    if !dev.cpu
        && dev.workgroup_bytes >= REDUCE_SPLIT_BYTES
        && split_workgroups(s.n_heads, d_v) <= dev.max_workgroups
    {
        split
    } else if dev.cpu && reduce_iterations(n_chunks, d_v, narrow) + 1 < LOOP_BUDGET {
        narrow
    } else {
        wide
    }
}

/// Reduce workgroups per query on a CPU adapter: one per core of the software adapters here, each
/// merging half the heads. A workgroup costs microseconds to start there, so one per head (what a
/// GPU gets) made the reduce of a many-query call cost more than its pass 1.
const REDUCE_WORKGROUPS_CPU: usize = 2;

/// Workgroups of the split reduce per query: one per head and [`REDUCE_SPLIT_ELEMENTS`] of its
/// output.
fn split_workgroups(n_heads: usize, d_v: usize) -> usize {
    n_heads.saturating_mul(d_v.div_ceil(REDUCE_SPLIT_ELEMENTS).max(1))
}

/// Reduce workgroups per query: the split reduce's [`split_workgroups`]; one per head on a GPU
/// otherwise; on a CPU adapter the fewest from [`REDUCE_WORKGROUPS_CPU`] up whose heads each keep an
/// invocation within the loop budget (a workgroup's heads are one more loop around
/// [`reduce_iterations`]).
fn reduce_workgroups(n_heads: usize, n_chunks: usize, d_v: usize, lanes: u32, cpu: bool) -> usize {
    if lanes == REDUCE_SPLIT_LANES {
        return split_workgroups(n_heads, d_v);
    }
    if !cpu {
        return n_heads;
    }
    let per_head = reduce_iterations(n_chunks, d_v, lanes) + 1;
    let most_heads = ((LOOP_BUDGET - 1) / per_head).max(1);
    n_heads
        .div_ceil(most_heads)
        .max(REDUCE_WORKGROUPS_CPU)
        .min(n_heads)
}

/// `n` workgroups fit one dimension of a dispatch, or why not.
pub(crate) fn fits_dimension(n: usize, what: &str, dev: &DeviceFacts) -> Result<(), Refusal> {
    if n > dev.max_workgroups {
        return refuse(
            AttentionLimit::Workgroups,
            format!(
                "{n} {what} exceed the device's {} workgroups per dispatch dimension",
                dev.max_workgroups
            ),
        );
    }
    Ok(())
}

/// Why the device cannot run a call: which limit, and the numbers.
pub(crate) type Refusal = (AttentionLimit, String);

fn refuse<T>(limit: AttentionLimit, detail: String) -> Result<T, Refusal> {
    Err((limit, detail))
}

/// The error of a call of `layer` the device cannot run.
pub(crate) fn refused_at(layer: usize) -> impl Fn(Refusal) -> Error {
    move |(limit, detail)| Error::AttentionRequest {
        layer,
        problem: AttentionProblem::DeviceLimit { limit, detail },
    }
}

/// Plans one call, or says why the device cannot run it.
pub(crate) fn plan(s: &CallShape, dev: &DeviceFacts) -> Result<Dispatch, Refusal> {
    if dev.storage_buffers < ATTENTION_STORAGE_BUFFERS || dev.bind_groups < 3 {
        return refuse(
            AttentionLimit::Bindings,
            format!(
                "attention binds {ATTENTION_STORAGE_BUFFERS} storage buffers in one shader stage, in 3 \
             bind groups; the device allows {} and {}",
                dev.storage_buffers, dev.bind_groups
            ),
        );
    }
    fits_dimension(s.n_q, "queries", dev)?;
    fits_dimension(s.n_heads, "query heads", dev)?;
    let refused = |why: &str| {
        let detail = format!("the {:?} attention kernel {why}", dev.choice);
        refuse(AttentionLimit::Kernel, detail)
    };
    match dev.choice {
        KernelChoice::Auto => {
            // CPU adapters without subgroups (llvmpipe's GL) take one-invocation teams, where a
            // barrier per row cost most of the time; a shape too wide for them (DeepSeek's MLA)
            // takes lanes over its rows. Lavapipe keeps subgroup sums: one-invocation teams were
            // slower there for chunked prefill and MLA. See docs/benchmarks.md.
            let across = match dev.subgroup {
                Some(_) => TeamSum::Subgroup,
                None => TeamSum::Shared,
            };
            let sums = match (dev.cpu, dev.subgroup) {
                (true, None) => vec![TeamSum::Alone, across],
                _ => vec![across],
            };
            match sums.into_iter().find_map(|sum| stream_key(s, dev, sum)) {
                Some(key) => plan_stream(s, dev, key),
                None => plan_tiled(s, dev),
            }
        }
        KernelChoice::Tiled => plan_tiled(s, dev),
        KernelChoice::StreamShared => match stream_key(s, dev, TeamSum::Shared) {
            Some(key) => plan_stream(s, dev, key),
            None => refused(STREAM_SHAPES),
        },
        KernelChoice::StreamSubgroup if dev.subgroup.is_none() => {
            refused("needs subgroups of one fixed size (wgpu::Features::SUBGROUP)")
        }
        KernelChoice::StreamSubgroup => match stream_key(s, dev, TeamSum::Subgroup) {
            Some(key) => plan_stream(s, dev, key),
            None => refused(STREAM_SHAPES),
        },
        KernelChoice::StreamAlone => match stream_key(s, dev, TeamSum::Alone) {
            Some(key) => plan_stream(s, dev, key),
            None => refused(STREAM_SHAPES),
        },
    }
}

const STREAM_SHAPES: &str = "needs every head dimension a multiple of one vector of its slot's \
                             storage (16 bytes: 4 f32, 8 16-bit, 16 q8_0 or fp8 elements; 8 bytes: \
                             16 q4_0 elements), rows of whole vectors (q8_0 and q4_0 rows may end \
                             inside one), and few enough elements per lane";

/// The streaming kernel for this call, when its shape allows one: every head dimension a whole
/// number of its slot's vectors ([`stream::per_vec`]), rows of whole 16-byte vectors but for the
/// block types', and the lane's registers within the budget of `sum` ([`LANE_FLOATS`] and the
/// others) for at least one head per team.
pub(crate) fn stream_key(s: &CallShape, dev: &DeviceFacts, sum: TeamSum) -> Option<StreamKey> {
    let dims = [s.d_a, s.d_b, s.d_v];
    if s.d_a == 0 || (0..3).any(|i| !dims[i].is_multiple_of(stream::per_vec(s.dtypes[i]))) {
        return None;
    }
    // Rows that are not whole vectors are read as words: only the block types' scales end inside a
    // vector (every head dimension here is whole vectors).
    let narrow = s.row_words.map(|w| w % 4 != 0);
    if (0..3).any(|i| narrow[i] && s.dtypes[i].block().is_none()) {
        return None;
    }
    let lanes = match (sum, dev.subgroup) {
        (TeamSum::Subgroup, Some(n)) => n,
        (TeamSum::Subgroup, None) => return None,
        (TeamSum::Shared, _) if dev.cpu => SHARED_LANES_CPU,
        (TeamSum::Shared, _) => SHARED_LANES_GPU,
        (TeamSum::Alone, _) => 1,
    };
    let group = s.n_heads / s.n_kv;
    // MLA on a CPU adapter with subgroups: MLA_CPU_STEP_ROWS rows per iteration, and more heads
    // per team. GQA over a contiguous f32 cache on a GPU with subgroups: GPU_STEP_ROWS rows per
    // iteration.
    let gpu_rows =
        !dev.cpu && !s.v_from_a && s.paging.is_none() && s.dtypes.iter().all(|&t| t == DType::F32);
    let mut step_rows = match sum {
        TeamSum::Subgroup if dev.cpu && s.v_from_a => MLA_CPU_STEP_ROWS,
        TeamSum::Subgroup if gpu_rows => GPU_STEP_ROWS,
        _ => 1,
    };
    let mla_cpu = dev.cpu && step_rows > 1;
    let most = match sum {
        TeamSum::Subgroup if mla_cpu => LANE_FLOATS_MLA_CPU,
        TeamSum::Subgroup => LANE_FLOATS,
        TeamSum::Shared if dev.cpu => LANE_FLOATS_SHARED_CPU,
        TeamSum::Shared => LANE_FLOATS_SHARED,
        TeamSum::Alone => LANE_FLOATS_ALONE,
    };
    // A GPU's lane holds its floats in registers (255 at most on NVIDIA's) and spills the rest to
    // memory: there a subgroup team takes as many heads as fit the workgroup-memory kernel's budget,
    // and one head up to the subgroup budget. On an H200 DeepSeek-V2-Lite's MLA in teams of 8 (f32)
    // / 4 (f16) heads, 308 / 184 floats, summed through workgroup memory, took 0.36-0.49 (f32, 32k
    // to 128k rows) and 0.53-0.66 (f16, 32k and 64k) of the time of the subgroup kernel's teams of
    // 16 / 8, 596 / 344 floats (docs/benchmarks.md, "A real GPU").
    let heads_within = match sum {
        TeamSum::Subgroup if !dev.cpu => most.min(LANE_FLOATS_SHARED),
        _ => most,
    };
    let heads_at = |rows: usize| {
        HEAD_BATCHES.into_iter().find(|&h| {
            let floats = stream::lane_floats(s.dtypes, lanes as usize, h, dims, s.v_from_a, rows);
            group.is_multiple_of(h) && (floats <= heads_within || (h == 1 && floats <= most))
        })
    };
    let mut heads = heads_at(step_rows as usize);
    // MLA's teams on a CPU adapter take two rows per iteration where four would leave them fewer
    // heads (subgroups of 4 lanes hold twice a lane's elements of every row) or none: each row is
    // then loaded by no more teams than before four rows (not measured on such an adapter).
    if mla_cpu && step_rows > 2 {
        let two = heads_at(2);
        if two > heads {
            (step_rows, heads) = (2, two);
        }
    }
    let heads = heads?;
    let rows = step_rows as usize;
    // On a CPU adapter a subgroup team takes whole groups of several KV heads, within the same
    // register budget: its lanes then read a run of the row instead of one head's slice at the
    // row's stride. On Mesa 22.3.6's lavapipe Llama-3-8B's decode at 4k ran 2 times faster with 4
    // KV heads per team than with 1 (docs/benchmarks.md); from Mesa 25.0 on it runs faster with one
    // where no slot is f32 ([`MESA_ONE_KV_HEAD`]). GPUs keep one, for more workgroups.
    let team_floats = stream::lane_floats(s.dtypes, lanes as usize, heads, dims, s.v_from_a, rows);
    // Several queries of one cache or one pool sequence (chunked prefill, verification) on a CPU
    // adapter: a team of one KV head with all of its query heads takes as many of them as fit the
    // same budget, so each row it loads serves every one. Loads, not arithmetic, set the pace
    // there: a query per team loaded every row once per query.
    // (Lavapipe's subgroup teams only: OpenGL's one-invocation teams hold whole rows, and teams of
    // several queries summing through workgroup memory ran Llama-3-8B's chunked prefill 2.7 to 7.3
    // times slower there than one-invocation teams of one query.)
    let queries = match sum {
        TeamSum::Subgroup if dev.cpu && s.ragged.is_none() && heads == group => QUERIES_PER_TEAM
            .into_iter()
            .find(|&n| {
                n <= s.n_q
                    && stream::lane_floats(
                        s.dtypes,
                        lanes as usize,
                        n * heads,
                        dims,
                        s.v_from_a,
                        rows,
                    ) <= most
            })
            .unwrap_or(1),
        _ => 1,
    };
    let kvs = match sum {
        _ if queries > 1 => 1,
        TeamSum::Subgroup if dev.cpu && heads == group && !one_kv_head(s, dev) => KV_HEADS_PER_TEAM
            .into_iter()
            .find(|&n| s.n_kv.is_multiple_of(n) && n * team_floats <= most)
            .unwrap_or(1),
        _ => 1,
    };
    Some(StreamKey {
        dtypes: s.dtypes,
        lanes,
        heads: heads as u32,
        kvs: kvs as u32,
        d_a: s.d_a as u32,
        d_b: s.d_b as u32,
        d_v: s.d_v as u32,
        v_from_a: s.v_from_a,
        // Left out only where a branch costs (see `StreamKey::soft_cap`): elsewhere one kernel
        // serves calls with and without a cap (fewer cold compiles on GL).
        soft_cap: s.soft_cap > 0.0 || !(dev.cpu && sum == TeamSum::Subgroup),
        step_rows,
        queries: queries as u32,
        // A CPU adapter loads a storage vector component by component, lane by lane: 64-bit
        // components halve that. GPUs keep 32-bit words (their 16-byte loads are one instruction).
        wide: dev.cpu && dev.int64,
        sum,
        // A CPU adapter sums a `subgroupAdd` lane by lane; shuffles in steps cost less there.
        shuffles: dev.cpu && sum == TeamSum::Subgroup && lanes.is_power_of_two(),
        // The same adapters convert f16 faster with `unpack2x16float` (OpenGL's llvmpipe slower).
        f16_unpack: dev.cpu && sum == TeamSum::Subgroup,
        rows: s.row_mode(),
        narrow,
    })
}

/// Whether a CPU adapter's subgroup teams take one KV head each: on lavapipe from
/// [`MESA_ONE_KV_HEAD`] on, where no slot is f32.
fn one_kv_head(s: &CallShape, dev: &DeviceFacts) -> bool {
    dev.mesa.is_some_and(|v| v >= MESA_ONE_KV_HEAD) && !s.dtypes.contains(&DType::F32)
}

/// The first row any query can see, and how many rows the queries see from there.
fn seen_rows(s: &CallShape) -> (usize, usize) {
    let lo = match (s.ragged, s.window) {
        (Some(r), _) => r.lo.min(s.visible),
        (None, 0) => 0,
        (None, w) => (s.visible - s.n_q + 1).saturating_sub(w),
    };
    (lo, s.visible - lo)
}

fn plan_stream(s: &CallShape, dev: &DeviceFacts, key: StreamKey) -> Result<Dispatch, Refusal> {
    let group = s.n_heads / s.n_kv;
    let n_batches = group / key.heads as usize;
    let teams = s.n_kv * n_batches;
    fits_dimension(teams, "KV heads x head batches", dev)?;
    // A workgroup of one-invocation teams holds `width` teams side by side (KV heads and head
    // batches: the lanes read one row's slices together) and takes `per` chunks for each, so that
    // every lane has a team and a chunk when the teams are not a multiple of 8.
    let (per, width) = match key.sum {
        TeamSum::Alone => {
            let width = (0..4)
                .map(|i| ALONE_TEAMS as usize >> i)
                .find(|&w| teams.is_multiple_of(w))
                .unwrap_or(1);
            (ALONE_TEAMS as usize / width, width)
        }
        // A workgroup is one team of `kvs` KV heads.
        _ => (1, key.kvs as usize),
    };
    // In (team, chunk) pairs: a workgroup holds `per * width` of them (8 one-invocation teams).
    let target = if let Some(n) = dev.target {
        n.min(MOST_TARGET) * per * width
    } else if dev.cpu && (key.kvs > 1 || key.step_rows > 1) {
        KV_TEAM_WORKGROUPS_PER_CORE * dev.cores.max(1) * per * width
    } else if dev.cpu {
        STREAM_WORKGROUPS_CPU * per * width
    } else {
        (TARGET_WORKGROUPS_GPU * GPU_TARGET_D_V / s.d_v.max(1))
            .clamp(TARGET_WORKGROUPS, TARGET_WORKGROUPS_GPU)
    };
    let (lo, rows) = seen_rows(s);
    // One loop iteration per row: chunks stay within the loop budget, and are at least `shortest`
    // rows.
    let shortest = match key.sum {
        TeamSum::Alone => ALONE_MIN_ROWS,
        _ => 16,
    };
    // A batch's chunks split the sequences much longer than its mean. Counted in workgroups of one-
    // invocation teams, since `width` teams walk a chunk together: every chunk past a short
    // sequence's end is a workgroup with no row (on GL a batch of 128 sequences of mean 308 rows ran
    // 1.19-1.24x the contiguous call with 4 chunks each, 1.05-1.15x with 1).
    let want = target
        .div_ceil(teams * s.n_q.div_ceil(key.queries as usize))
        .max(match key.sum {
            TeamSum::Alone => ragged_chunks(s, rows, teams, target / width),
            _ => ragged_chunks(s, rows, teams / width, target / width),
        })
        .next_multiple_of(per)
        .min(rows.div_ceil(shortest))
        .min((most_chunks(s, dev) / per).max(1) * per)
        .max(1);
    let chunk_len = rows.div_ceil(want).min(STREAM_MAX_ROWS);
    finish(
        s,
        dev,
        group,
        n_batches,
        chunk_len,
        lo,
        rows,
        (per, width),
        Pass1::Stream(key),
    )
}

/// The `ROWS_PER_INVOCATION` indices the tiled kernel may take for a shape with
/// `HEAD_BATCHES[batch]` heads per workgroup, fewest rows first: one row always, more while heads
/// times rows stays at most 32 (8 rows at most), and only those whose tile runs within the loop
/// budget. [`plan`] picks among them by context length, so
/// [`crate::Attention::prepare`] builds exactly these.
pub(crate) fn tiled_rows(s: &CallShape, batch: usize) -> impl Iterator<Item = usize> + '_ {
    let hb = HEAD_BATCHES[batch];
    ROWS_PER_INVOCATION
        .iter()
        .enumerate()
        .filter(move |&(_, &r)| {
            (r == 1 || (32 / hb).clamp(1, 8) >= r)
                && pass1_iterations_per_tile(s.dtypes, s.d_a, s.d_b, s.d_v, hb, r) < LOOP_BUDGET
        })
        .map(|(i, _)| i)
}

fn plan_tiled(s: &CallShape, dev: &DeviceFacts) -> Result<Dispatch, Refusal> {
    if dev.workgroup_bytes < TILED_WORKGROUP_BYTES {
        return refuse(
            AttentionLimit::WorkgroupMemory,
            format!(
                "the tiled attention kernel needs {TILED_WORKGROUP_BYTES} bytes of workgroup memory; \
             the device allows {}",
                dev.workgroup_bytes
            ),
        );
    }
    let group = s.n_heads / s.n_kv;
    let batch = HEAD_BATCHES
        .iter()
        .position(|&b| group.is_multiple_of(b))
        .unwrap_or(HEAD_BATCHES.len() - 1);
    let hb = HEAD_BATCHES[batch];
    let n_batches = group / hb;
    let per_chunk = s.n_kv * n_batches * s.n_q;
    fits_dimension(s.n_kv * n_batches, "KV heads x head batches", dev)?;
    let target = match dev.target {
        Some(n) => n.min(MOST_TARGET),
        None if dev.cpu => TARGET_WORKGROUPS_CPU,
        None => TARGET_WORKGROUPS,
    };
    let (lo, rows) = seen_rows(s);
    // Rows per invocation: as many as the heads allow, unless a chunk of 64-row tiles would be
    // shorter than one tile of them (short contexts keep their parallelism), and never so many that
    // one tile alone runs past the loop budget.
    let chunks_64 = target.div_ceil(per_chunk).min(rows.div_ceil(TILE)).max(1);
    let rows_per_chunk = rows.div_ceil(chunks_64);
    let per_tile = |rpl: usize| {
        pass1_iterations_per_tile(s.dtypes, s.d_a, s.d_b, s.d_v, hb, ROWS_PER_INVOCATION[rpl])
    };
    let Some(rpl) = tiled_rows(s, batch)
        .filter(|&i| i == 0 || TILE * ROWS_PER_INVOCATION[i] <= rows_per_chunk)
        .last()
    else {
        return refuse(
            AttentionLimit::HeadSize,
            format!(
                "one tile of {TILE} rows with {hb} heads per workgroup, d = {} + {} and d_v = {} needs {} \
             loop iterations per invocation, more than the {LOOP_BUDGET} every adapter runs",
                s.d_a,
                s.d_b,
                s.d_v,
                per_tile(0)
            ),
        );
    };
    let tile = TILE * ROWS_PER_INVOCATION[rpl];
    let tiles = rows.div_ceil(tile);
    // Partial results of one query in one chunk: the unnormalised output and (max, sum) per head.
    let want = target
        .div_ceil(per_chunk)
        .max(ragged_chunks(s, rows, per_chunk / s.n_q, target))
        .min(tiles)
        .min(most_chunks(s, dev))
        .max(1);
    let max_tiles = ((LOOP_BUDGET - 1) / per_tile(rpl)).max(1);
    let tiles_per_chunk = tiles.div_ceil(want).min(max_tiles);
    let kernel = Pass1::Tiled {
        dtypes: s.dtypes,
        slot_b: s.d_b > 0,
        batch,
        rpl,
        rows: s.row_mode(),
    };
    finish(
        s,
        dev,
        group,
        n_batches,
        tiles_per_chunk * tile,
        lo,
        rows,
        (1, 1),
        kernel,
    )
}

/// Most chunks one query's rows may be split into: their partial results fit one binding, pass 1
/// fits the device's grid, and one reduce invocation walks them within the loop budget.
fn most_chunks(s: &CallShape, dev: &DeviceFacts) -> usize {
    let by_binding =
        usize::try_from(scratch_binding(dev) / query_chunk_bytes(s)).unwrap_or(usize::MAX);
    // `reduce_iterations(n, d_v, lanes) + 1 < LOOP_BUDGET`, solved for n.
    let passes = s.d_v.div_ceil(16 * REDUCE_LANES[0] as usize);
    let by_reduce = (LOOP_BUDGET - 2 - passes) / (2 + passes);
    by_binding.min(by_reduce).min(dev.max_workgroups).max(1)
}

/// Scratch bytes of one query in one chunk: the unnormalised output and (max, sum) per head.
fn query_chunk_bytes(s: &CallShape) -> u64 {
    s.n_heads as u64 * s.d_v.max(2) as u64 * 4
}

/// The dispatch of `kernel` over chunks of `chunk_len` rows from `lo`, split into pairs whose
/// partial results fit one binding. A workgroup takes `per` chunks of `width` teams (one-invocation
/// teams; `(1, 1)` for the other kernels).
#[allow(clippy::too_many_arguments)]
fn finish(
    s: &CallShape,
    dev: &DeviceFacts,
    group: usize,
    n_batches: usize,
    chunk_len: usize,
    lo: usize,
    rows: usize,
    (per, width): (usize, usize),
    kernel: Pass1,
) -> Result<Dispatch, Refusal> {
    // A workgroup of one-invocation teams takes `per` chunks, which share their rows.
    let n_chunks = rows.div_ceil(chunk_len).next_multiple_of(per);
    // A ragged batch's query table (two words per query of the call) follows the partial results
    // in the stats binding.
    let table_bytes = match s.ragged {
        Some(_) => QUERY_TABLE_BYTES * s.n_q as u64,
        None => 0,
    };
    let scratch = scratch_binding(dev);
    if table_bytes >= scratch {
        return refuse(
            AttentionLimit::QueryTable,
            format!(
                "a batch of {} queries needs a query table of {table_bytes} bytes, more than one storage \
             binding of this device holds ({scratch})",
                s.n_q
            ),
        );
    }
    let q_per_pair =
        usize::try_from((scratch - table_bytes) / (n_chunks as u64 * query_chunk_bytes(s)))
            .unwrap_or(usize::MAX)
            .min(s.n_q);
    if n_chunks > dev.max_workgroups
        || q_per_pair == 0
        || reduce_iterations(n_chunks, s.d_v, REDUCE_LANES[0]) + 1 >= LOOP_BUDGET
    {
        return refuse(
            AttentionLimit::Rows,
            format!(
                "{rows} rows need {n_chunks} chunks of at most {chunk_len} rows to stay within the loop \
             budget, more than this device can merge for one query of {} heads x {}",
                s.n_heads, s.d_v,
            ),
        );
    }
    // In 64 bits: a 32-bit target's usize does not hold them for every shape `prepare` takes.
    let entries = n_chunks as u64 * q_per_pair as u64 * s.n_heads as u64; // (chunk, query, head)
    let stats_bytes = entries * 2 * 4;
    let part_bytes = entries * s.d_v as u64 * 4;
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
        chunk_len: chunk_len as u32,
        n_chunks: n_chunks as u32,
        n_kv: s.n_kv as u32,
        scale: s.scale,
        soft_cap: s.soft_cap,
        q_first: 0,
        q_count: q_per_pair as u32,
        page_size: s.paging.map_or(0, |p| p.page_size as u32),
        table_base: s.paging.map_or(0, |p| p.table_base as u32),
        n_pages: s.paging.map_or(0, |p| p.n_pages as u32),
        team_width: width as u32,
        // The views come from the bindings the recorder checks (src/attention/view.rs).
        view_a: [0; 4],
        view_b: [0; 4],
        view_out: [0; 4],
        slot_scales: [s.scales[0], s.scales[1], s.scales[2], 1.0],
        // Whether pass 1 writes the output itself depends on the output's binding (the recorder).
        direct: 0,
        _pad: [0; 3],
    };
    let reduce_lanes = reduce_lanes(n_chunks, s, dev);
    Ok(Dispatch {
        params,
        kernel,
        pass1: ((n_chunks / per) as u32, (s.n_kv * n_batches / width) as u32),
        pass2: reduce_workgroups(s.n_heads, n_chunks, s.d_v, reduce_lanes, dev.cpu) as u32,
        reduce_lanes,
        q_per_pair,
        stats_bytes,
        part_bytes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kernels subtract the query table's bias where they read it (shaders/shared/rows.wgsl,
    /// which every pass-1 kernel includes): both words, with the value the recorder adds.
    /// `pass1_iterations_per_tile` never counts fewer loop iterations than a count by hand of
    /// `attention_partial.wgsl` for its worst invocation (the first, over a full tile of
    /// `TILE · rpl` rows): the tile loop 1; the row loads `rpl`; each dot product a loop over the rows
    /// (`rpl`), then steps of 4 elements (f32), 2 words (16-bit) or a quad of a block (q8_0), each
    /// `1 + rpl` loads `+ hb` heads `+ hb · rpl` rows, and for a 16-bit head the elements the
    /// steps leave (one alone where the head starts inside a word, and the last `(d - lead) % 4`)
    /// a step each; the scores `rpl · (1 + hb)`; the running max and the sum, a tile of rows
    /// each; the exponentials `hb · rpl`; the values `⌈d_v / 256⌉` steps of
    /// `1 + rows · (1 + hb + e) + hb · (1 + 4)`, where `e` is v_quad's element loop (4 where 16-bit
    /// values start inside a word, else 0) and the last term the stores. The count charges that
    /// element loop to every row: the odd 16-bit case is exact, the others are over by it.
    #[test]
    fn the_tiled_loop_count_covers_a_count_by_hand_of_the_kernel() {
        let [f32_, f16_, q8_] = [DType::F32, DType::F16, DType::Q8_0].map(|t| [t; 3]);
        #[rustfmt::skip]
        let cases = [
            // f32, heads of 128, 4 heads and 2 rows per invocation: 32 steps of 15.
            (f32_, [128, 0, 128], 4, 2, 1 + 2 + (2 + 32 * 15) + 10 + 128 + 8 + 128 + (1 + 128 * 5 + 4 * 5), 1932),
            // f16, heads of 128 (64 words, 32 steps of 4), one head and one row.
            (f16_, [128, 0, 128], 1, 1, 1 + 1 + (1 + 32 * 4) + 2 + 64 + 1 + 64 + (1 + 64 * 2 + 5), 652),
            // f16, keys of 7 and values of 5 on an odd head (a lone element, a step of four and
            // two lone elements, steps of 9), values one element into a word (v_quad's loop of 4).
            (f16_, [7, 0, 5], 2, 2, 1 + 2 + (2 + 9 + 9 + 9 + 9) + 6 + 128 + 4 + 128 + (1 + 128 * 7 + 2 * 5), 1214),
            // DeepSeek-V2-Lite's shapes, 8 heads: 128 and 16 steps of 18, two value steps.
            (f32_, [512, 64, 512], 8, 1, 1 + 1 + (1 + 128 * 18) + (1 + 16 * 18) + 9 + 64 + 8 + 64 + 2 * (1 + 64 * 9 + 8 * 5), 4487),
            // q8_0, heads of 128: 32 quads of 6.
            (q8_, [128, 0, 128], 2, 1, 1 + 1 + (1 + 32 * 6) + 3 + 64 + 2 + 64 + (1 + 64 * 3 + 2 * 5), 787),
        ];
        for (dtypes, [d_a, d_b, d_v], hb, rpl, by_hand, counted) in cases {
            let got = pass1_iterations_per_tile(dtypes, d_a, d_b, d_v, hb, rpl);
            let what = format!("{dtypes:?} d {d_a} + {d_b}, d_v {d_v}, {hb} heads, {rpl} rows");
            assert!(got >= by_hand, "{what}: counted {got}, {by_hand} by hand");
            assert_eq!(got, counted, "{what}");
        }
    }

    #[test]
    fn the_kernels_subtract_the_query_tables_bias() {
        let rows = crate::kernels::wgsl::ROWS;
        let subtracted = format!("]) - {QUERY_TABLE_BIAS:#010x}u;");
        assert_eq!(rows.matches(&subtracted).count(), 2, "{subtracted}");
        assert_eq!(rows.matches("bitcast<u32>(stats[").count(), 2);
        assert_eq!(QUERY_TABLE_MAX + QUERY_TABLE_BIAS, 0x7f7f_ffff);
    }

    const LAVAPIPE: DeviceFacts = DeviceFacts {
        max_workgroups: 65535,
        max_binding: 128 << 20,
        offset_alignment: 256,
        cpu: true,
        cores: 2,
        subgroup: Some(8),
        int64: true,
        mesa: Some((22, 3)),
        storage_buffers: 16,
        bind_groups: 8,
        workgroup_bytes: 32 << 10,
        choice: KernelChoice::Auto,
        target: None,
    };
    /// Lavapipe of Mesa 25.0: teams of one KV head where no slot is f32.
    const LAVAPIPE_25: DeviceFacts = DeviceFacts {
        mesa: Some(MESA_ONE_KV_HEAD),
        ..LAVAPIPE
    };
    const GPU: DeviceFacts = DeviceFacts {
        max_workgroups: 65535,
        max_binding: 2 << 30,
        offset_alignment: 256,
        cpu: false,
        cores: 16,
        subgroup: Some(32),
        int64: true,
        mesa: None,
        storage_buffers: 8,
        bind_groups: 4,
        workgroup_bytes: 16 << 10,
        choice: KernelChoice::Auto,
        target: None,
    };

    /// The devices (lavapipe of Mesa 22.3 and of 25.0, a GPU) with each kernel forced, and on their
    /// own choice.
    fn devices() -> Vec<DeviceFacts> {
        let mut all = Vec::new();
        for dev in [LAVAPIPE, LAVAPIPE_25, GPU] {
            for choice in [
                KernelChoice::Auto,
                KernelChoice::Tiled,
                KernelChoice::StreamShared,
                KernelChoice::StreamSubgroup,
                KernelChoice::StreamAlone,
            ] {
                all.push(DeviceFacts { choice, ..dev });
            }
        }
        all
    }

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
            dtypes: [dtype; 3],
            scales: [1.0; 3],
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
            v_from_a: false,
            paging: None,
            ragged: None,
        }
    }

    /// `s` over a pool of `n_pages` pages of `page_size` rows: one sequence (`seen` None), or a
    /// ragged batch whose queries see `seen` rows together.
    fn pooled(s: CallShape, page_size: usize, n_pages: usize, seen: Option<usize>) -> CallShape {
        CallShape {
            paging: Some(Paging {
                page_size,
                table_base: 0,
                n_pages,
            }),
            ragged: seen.map(|seen| Ragged { lo: 0, seen }),
            ..s
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
            v_from_a: true,
            ..gqa(dtype, n_q, 16, 1, 512, visible)
        }
    }

    /// The most loop iterations one invocation of either pass runs.
    fn worst_iterations(s: &CallShape, d: &Dispatch) -> usize {
        let pass1 = match d.kernel {
            Pass1::Tiled { batch, rpl, .. } => {
                let rpl = ROWS_PER_INVOCATION[rpl];
                let tiles = d.params.chunk_len as usize / (TILE * rpl);
                tiles
                    * pass1_iterations_per_tile(
                        s.dtypes,
                        s.d_a,
                        s.d_b,
                        s.d_v,
                        HEAD_BATCHES[batch],
                        rpl,
                    )
            }
            // The row loop is the streaming kernel's only loop. One-invocation teams that take
            // blocks of rows through a page table may take one block more than a chunk's rows.
            Pass1::Stream(key) if key.sum == TeamSum::Alone && key.rows != RowMode::Contiguous => {
                d.params.chunk_len as usize + stream::ALONE_BLOCK_ROWS as usize
            }
            Pass1::Stream(_) => d.params.chunk_len as usize,
        };
        let heads_per_workgroup = s.n_heads.div_ceil(d.pass2 as usize);
        pass1
            .max(heads_per_workgroup * (reduce_iterations(d.n_chunks(), s.d_v, d.reduce_lanes) + 1))
    }

    impl Dispatch {
        fn n_chunks(&self) -> usize {
            self.params.n_chunks as usize
        }
    }

    /// Every streaming kernel the planner asks for over a grid of calls validates, its key fields
    /// combined as the planner combines them (stream.rs's tests set each field by hand, and miss
    /// combinations such as teams of several queries with 64-bit loads and the f16 conversion):
    /// GQA with teams of several KV heads and with `d_v` below `d_k` (q8_0 and q4_0 rows that end
    /// inside a vector), MLA over a latent of 64 and a rope key of 32, one query and seven, every
    /// storage type and three mixed pairs, with and without a cap, over contiguous rows, a page
    /// table and a ragged batch, as planned for lavapipe (with and without 64-bit integers),
    /// llvmpipe's OpenGL and a GPU with and without subgroups. Small heads: each kernel costs naga
    /// tens of milliseconds here.
    #[test]
    #[cfg(not(target_arch = "wasm32"))]
    fn every_kernel_the_planner_asks_for_validates() {
        let devices = [
            LAVAPIPE,
            LAVAPIPE_25,
            DeviceFacts {
                int64: false,
                ..LAVAPIPE
            },
            DeviceFacts {
                subgroup: None,
                int64: false,
                ..LAVAPIPE
            },
            GPU,
            // A browser's WebGPU without the subgroups feature.
            DeviceFacts {
                subgroup: None,
                int64: false,
                ..GPU
            },
        ];
        use DType::*;
        let mut types: Vec<[DType; 2]> = DType::STORAGE.iter().map(|&t| [t, t]).collect();
        types.extend([[F16, BF16], [Q8_0, Q4_0], [F8E4M3, F32]]);
        let mut keys = std::collections::HashSet::new();
        let mut planned = 0;
        // (heads, KV heads, d_a, d_b, d_v): GQA, and MLA where d_b > 0.
        for (n_heads, n_kv, d_a, d_b, d_v) in
            [(8, 4, 64, 0, 64), (8, 2, 64, 0, 32), (4, 1, 64, 32, 64)]
        {
            let mla = d_b > 0;
            for [t_a, t_v] in &types {
                // GQA: keys in slots a and b (one slot read as both), values in v. MLA: the
                // latent as slots a and v, the rope key as b.
                let dtypes = if mla {
                    [*t_a, *t_v, *t_a]
                } else {
                    [*t_a, *t_a, *t_v]
                };
                let words = |t: DType, d: usize| t.row_bytes(n_kv * d).unwrap() as usize / 4;
                let (a, v) = (words(dtypes[0], d_a), words(dtypes[2], d_v));
                let b = if mla { words(dtypes[1], d_b) } else { a };
                let s = CallShape {
                    dtypes,
                    d_b,
                    d_v,
                    row_words: [a, b, v],
                    v_from_a: mla,
                    ..gqa(dtypes[0], 1, n_heads, n_kv, d_a, 4096)
                };
                for n_q in [1, 7] {
                    for soft_cap in [0.0, 30.0] {
                        let s = CallShape { n_q, soft_cap, ..s };
                        for s in [s, pooled(s, 16, 256, None), pooled(s, 16, 256, Some(3000))] {
                            for dev in devices {
                                if let Ok(d) = plan(&s, &dev)
                                    && let Pass1::Stream(key) = d.kernel
                                {
                                    keys.insert(key);
                                    planned += 1;
                                }
                            }
                        }
                    }
                }
            }
        }
        for key in &keys {
            stream::tests::validate(key);
        }
        // Every field the planner sets took more than one value.
        let values = |f: &dyn Fn(&StreamKey) -> u32| {
            keys.iter()
                .map(f)
                .collect::<std::collections::HashSet<_>>()
                .len()
        };
        for (name, n) in [
            ("lanes", values(&|k| k.lanes)),
            ("heads", values(&|k| k.heads)),
            ("kvs", values(&|k| k.kvs)),
            ("step_rows", values(&|k| k.step_rows)),
            ("queries", values(&|k| k.queries)),
            ("sum", values(&|k| k.sum as u32)),
            ("rows", values(&|k| k.rows as u32)),
            ("wide", values(&|k| u32::from(k.wide))),
            ("shuffles", values(&|k| u32::from(k.shuffles))),
            ("f16_unpack", values(&|k| u32::from(k.f16_unpack))),
            ("soft_cap", values(&|k| u32::from(k.soft_cap))),
            ("narrow", values(&|k| u32::from(k.narrow.contains(&true)))),
        ] {
            assert!(n > 1, "{name}: one value over {} keys", keys.len());
        }
        assert!(keys.len() > 500, "{} keys of {planned} plans", keys.len());
    }

    /// A CPU adapter's subgroup teams sum by shuffles ([`StreamKey::shuffles`]); GPUs and the other
    /// sums do not. Llama-3-8B's decode on lavapipe (f32 and f16), and two GQA shapes (decode, and
    /// 5 queries of 16-bit heads of 64) on both devices, on their own choice and each kernel forced.
    #[test]
    fn cpu_subgroup_teams_shuffle_their_sums() {
        for dtype in [DType::F32, DType::F16] {
            let d = plan(&gqa(dtype, 1, 32, 8, 128, 4096), &LAVAPIPE).unwrap();
            let Pass1::Stream(key) = d.kernel else {
                panic!("{:?}", d.kernel)
            };
            assert!(key.sum == TeamSum::Subgroup && key.shuffles, "{key:?}");
        }
        let mut shuffled = 0;
        for dev in devices() {
            for shape in [
                gqa(DType::F32, 1, 32, 8, 128, 4096),
                gqa(DType::F16, 5, 8, 2, 64, 300),
            ] {
                let Ok(Dispatch {
                    kernel: Pass1::Stream(key),
                    ..
                }) = plan(&shape, &dev)
                else {
                    continue;
                };
                let want = dev.cpu && key.sum == TeamSum::Subgroup;
                assert_eq!(key.shuffles, want, "{dev:?}: {key:?}");
                shuffled += usize::from(key.shuffles);
            }
        }
        assert!(shuffled >= 2, "{shuffled}");
    }

    /// Teams of several queries ([`StreamKey::queries`]): on CPU adapters with subgroups, for calls
    /// of one cache or one pool sequence, as many of a call's queries (8 or 4) as fit the register
    /// budget beside a whole group of heads (Llama-3-8B f32: 4 x 4 heads x 32 floats + 32 of the
    /// row = 544 of 656), one KV head per team; none for calls of fewer than 4 queries, ragged
    /// batches, the other sums or GPUs. The grid's query dimension counts teams of queries, so a
    /// call of 7 takes two.
    #[test]
    fn cpu_teams_take_several_queries_of_one_sequence() {
        let key = |s: &CallShape, dev: &DeviceFacts| match plan(s, dev).unwrap().kernel {
            Pass1::Stream(k) => (k.queries, k.kvs, k.heads),
            other => panic!("{s:?}: {other:?}"),
        };
        let llama = |dtype, n_q| gqa(dtype, n_q, 32, 8, 128, 4096);
        assert_eq!(key(&llama(DType::F32, 1), &LAVAPIPE), (1, 4, 4));
        assert_eq!(key(&llama(DType::F32, 3), &LAVAPIPE), (1, 4, 4));
        for n_q in [4, 7, 8, 64] {
            assert_eq!(key(&llama(DType::F16, n_q), &LAVAPIPE), (4, 1, 4), "{n_q}");
        }
        // Small heads fit 8 queries (8 x 4 heads x (8 + 8) floats + 16).
        assert_eq!(
            key(&gqa(DType::F32, 8, 32, 8, 64, 4096), &LAVAPIPE),
            (8, 1, 4)
        );
        // None elsewhere: the other sums (even a shape that would fit), GPUs, ragged batches.
        for choice in [KernelChoice::StreamShared, KernelChoice::StreamAlone] {
            let dev = DeviceFacts { choice, ..LAVAPIPE };
            assert_eq!(key(&llama(DType::F32, 8), &dev).0, 1);
            assert_eq!(key(&gqa(DType::F32, 8, 8, 8, 64, 4096), &dev).0, 1);
        }
        assert_eq!(key(&llama(DType::F32, 8), &GPU).0, 1);
        let ragged = pooled(llama(DType::F32, 8), 16, 512, Some(4096));
        assert_eq!(key(&ragged, &LAVAPIPE).0, 1);
        let paged = pooled(llama(DType::F32, 8), 16, 512, None);
        assert_eq!(key(&paged, &LAVAPIPE).0, 4);
        // The shapes of `a_non_finite_row_stays_out_of_the_queries_that_do_not_see_it`: teams of
        // 4 queries (7 of them), one row per iteration for GQA and four for MLA.
        let steps = |s: &CallShape| match plan(s, &LAVAPIPE).unwrap().kernel {
            Pass1::Stream(k) => (k.queries, k.step_rows),
            other => panic!("{s:?}: {other:?}"),
        };
        let windowed = |s: CallShape| CallShape { window: 32, ..s };
        assert_eq!(steps(&windowed(gqa(DType::F32, 7, 4, 4, 64, 65))), (4, 1));
        let small_mla = CallShape {
            d_a: 32,
            d_b: 8,
            d_v: 32,
            row_words: [32, 8, 32],
            v_from_a: true,
            ..gqa(DType::F32, 7, 4, 1, 32, 65)
        };
        assert_eq!(steps(&windowed(small_mla)), (4, 4));
        // DeepSeek-V2-Lite's MLA teams fill the budget with heads (8 of its 16, four rows).
        assert_eq!(key(&mla(DType::F32, 8, 4096), &LAVAPIPE), (1, 1, 8));
        // The shapes of `many_queries_over_the_longest_context_a_slot_holds_see_every_row` on
        // lavapipe (16 queries, 4 heads on one KV head, d = 64, as many rows as a 128 MiB slot
        // holds): teams of 8 queries, whose row loop stays within the loop budget.
        for (dtype, rows) in [(DType::F32, 1 << 19), (DType::F16, 1 << 20)] {
            let s = gqa(dtype, 16, 4, 1, 64, rows);
            let d = plan(&s, &LAVAPIPE).unwrap();
            assert!(
                matches!(d.kernel, Pass1::Stream(k) if k.queries == 8),
                "{d:?}"
            );
            assert!(worst_iterations(&s, &d) < LOOP_BUDGET, "{d:?}");
        }
        let d = plan(&llama(DType::F32, 7), &LAVAPIPE).unwrap();
        let (chunks, teams) = d.pass1;
        assert_eq!(d.pass1_grid(7), (chunks, 2, teams));
        assert_eq!(d.pass1_grid(8), (chunks, 2, teams));
        assert_eq!(d.pass1_grid(9), (chunks, 3, teams));
        let decode = plan(&llama(DType::F32, 1), &LAVAPIPE).unwrap();
        assert_eq!(decode.pass1_grid(7).1, 7);
    }

    /// Which KV heads a team takes and whether its kernel has the logit cap: lavapipe's subgroup
    /// teams take whole groups of up to 8 KV heads within the register budget, and leave the cap out
    /// of calls without one; GPUs and the other kernels keep one KV head and the cap.
    #[test]
    fn cpu_subgroup_teams_take_whole_groups_of_kv_heads() {
        let key = |s: &CallShape, dev: &DeviceFacts| match plan(s, dev).unwrap().kernel {
            Pass1::Stream(k) => (k.kvs, k.heads, k.soft_cap),
            other => panic!("{s:?}: {other:?}"),
        };
        let capped = |mut s: CallShape| {
            s.soft_cap = 30.0;
            s
        };
        let llama = gqa(DType::F32, 1, 32, 8, 128, 4096);
        assert_eq!(key(&llama, &LAVAPIPE), (4, 4, false));
        assert_eq!(key(&capped(llama), &LAVAPIPE), (4, 4, true));
        assert_eq!(key(&llama, &GPU), (1, 4, true));
        // Small heads: 8 KV heads of 64 fit (8 x (2 x (8 + 8) + 16) floats); 2 KV heads take 2.
        assert_eq!(
            key(&gqa(DType::F16, 1, 16, 8, 64, 512), &LAVAPIPE),
            (8, 2, false)
        );
        assert_eq!(
            key(&gqa(DType::F16, 1, 8, 2, 64, 512), &LAVAPIPE),
            (2, 4, false)
        );
        // A group of 32, wider than a team's heads (16 at most): one KV head per team.
        assert_eq!(key(&gqa(DType::F32, 1, 64, 2, 128, 512), &LAVAPIPE).0, 1);
        // MLA has one latent head; OpenGL's one-invocation teams keep the cap's branch.
        assert_eq!(key(&mla(DType::F16, 1, 512), &LAVAPIPE).0, 1);
        let gl = DeviceFacts {
            subgroup: None,
            ..LAVAPIPE
        };
        assert_eq!(key(&llama, &gl), (1, 2, true));
    }

    /// `Attention::prepare` builds the tiled variants of `tiled_rows`: every one of them is the
    /// plan's choice at some context length, and the plan chooses no other. Sixteen heads per
    /// workgroup (DeepSeek's MLA) take one or two rows, never four or eight.
    #[test]
    fn the_tiled_kernel_takes_exactly_the_rows_prepare_builds() {
        let tiled = |dev: DeviceFacts| DeviceFacts {
            choice: KernelChoice::Tiled,
            ..dev
        };
        let mut shapes = vec![mla(DType::F32, 1, 1), mla(DType::F16, 1, 1)];
        for dtype in DType::ALL {
            for &(n_heads, n_kv, d) in &[(32, 8, 128), (64, 2, 128), (4, 1, 64), (16, 16, 256)] {
                shapes.push(gqa(dtype, 1, n_heads, n_kv, d, 1));
            }
        }
        for dev in [tiled(LAVAPIPE), tiled(GPU)] {
            for shape in &shapes {
                let mut chosen = Vec::new();
                let mut batch = None;
                for visible in (0..23).map(|p| 1 << p) {
                    let s = CallShape { visible, ..*shape };
                    // The longest contexts may be more chunks than one query's merge takes.
                    let Ok(p) = plan(&s, &dev) else {
                        assert!(visible > 1 << 16, "{s:?} {dev:?}");
                        continue;
                    };
                    let Pass1::Tiled { batch: b, rpl, .. } = p.kernel else {
                        panic!("{s:?}: not tiled");
                    };
                    batch = Some(b);
                    if !chosen.contains(&rpl) {
                        chosen.push(rpl);
                    }
                }
                chosen.sort_unstable();
                let batch = batch.unwrap();
                let built: Vec<_> = tiled_rows(shape, batch).collect();
                assert_eq!(chosen, built, "{shape:?} {dev:?}");
                if HEAD_BATCHES[batch] == 16 {
                    assert_eq!(built, [0, 1], "{shape:?}");
                }
            }
        }
    }

    /// A GPU's default plans (from the H200's sweeps): GQA of d_v 128 aims for 4,096 workgroups,
    /// two rows per iteration over a contiguous f32 cache and one in f16 or through a page table;
    /// MLA's values of 512 aim for 1,024; both merge with the split reduce, and the tiled kernel
    /// keeps 1,024.
    #[test]
    fn gpu_defaults_follow_the_sweeps() {
        let key = |d: &Dispatch| match d.kernel {
            Pass1::Stream(k) => k,
            Pass1::Tiled { .. } => panic!("{d:?}"),
        };
        let workgroups = |d: &Dispatch| d.pass1.0 as usize * d.pass1.1 as usize;
        for dtype in [DType::F32, DType::F16] {
            let llama = gqa(dtype, 1, 32, 8, 128, 32_768);
            let d = plan(&llama, &GPU).unwrap();
            let rows = if dtype == DType::F32 { 2 } else { 1 };
            assert_eq!((workgroups(&d), key(&d).step_rows), (4096, rows), "{dtype}");
            assert_eq!(d.reduce_lanes, REDUCE_SPLIT_LANES);
            let paged = pooled(llama, 64, 512, None);
            let d = plan(&paged, &GPU).unwrap();
            assert_eq!((workgroups(&d), key(&d).step_rows), (4096, 1), "{dtype}");
            let d = plan(&mla(dtype, 1, 32_768), &GPU).unwrap();
            assert_eq!((workgroups(&d), key(&d).step_rows), (1024, 1), "{dtype}");
            assert_eq!(d.reduce_lanes, REDUCE_SPLIT_LANES);
            let tiled = DeviceFacts {
                choice: KernelChoice::Tiled,
                ..GPU
            };
            let d = plan(&llama, &tiled).unwrap();
            assert_eq!(d.params.n_chunks as usize * 8, 1024, "{dtype}");
            // A device without the split reduce's workgroup memory merges with 64 invocations.
            let small = DeviceFacts {
                workgroup_bytes: REDUCE_SPLIT_BYTES - 1,
                ..GPU
            };
            assert_eq!(plan(&llama, &small).unwrap().reduce_lanes, 64);
        }
    }

    #[test]
    fn any_workgroup_target_plans_what_the_default_plans() {
        let mut shapes = vec![mla(DType::F32, 1, 1), mla(DType::F16, 7, 1)];
        for dtype in [DType::F32, DType::F16, DType::Q4_0] {
            for &(n_q, n_heads, n_kv, d) in &[(1, 32, 8, 128), (64, 32, 8, 128), (1, 4, 1, 64)] {
                shapes.push(gqa(dtype, n_q, n_heads, n_kv, d, 1));
            }
        }
        let targets = [1, 7, 1024, 4096, 16_384, 1 << 20, usize::MAX];
        let mut planned = 0;
        for dev in devices() {
            for shape in &shapes {
                for visible in [1, 17, 4096, 32_768, 131_072, 1 << 20, 1 << 22] {
                    let s = CallShape { visible, ..*shape };
                    let Ok(default) = plan(&s, &dev) else {
                        continue;
                    };
                    planned += 1;
                    let mut last = 0;
                    for target in targets {
                        let p = plan(
                            &s,
                            &DeviceFacts {
                                target: Some(target),
                                ..dev
                            },
                        )
                        .unwrap_or_else(|e| panic!("{target}: {e:?}\n{s:?} {dev:?}"));
                        let chunks = p.n_chunks();
                        assert!(chunks * p.params.chunk_len as usize >= visible);
                        assert!(chunks <= most_chunks(&s, &dev).next_multiple_of(8));
                        // More workgroups never mean fewer chunks.
                        assert!(chunks >= last, "{target}: {chunks} < {last}\n{s:?} {dev:?}");
                        last = chunks;
                    }
                    // Unset, the adapter's default.
                    assert_eq!(
                        plan(
                            &s,
                            &DeviceFacts {
                                target: None,
                                ..dev
                            }
                        )
                        .unwrap()
                        .n_chunks(),
                        default.n_chunks()
                    );
                }
            }
        }
        assert!(planned > 400, "{planned} calls planned");
    }

    #[test]
    fn a_4096_row_decode_is_split_into_chunks() {
        for dev in [LAVAPIPE, GPU] {
            let d = plan(&gqa(DType::F16, 1, 32, 8, 128, 4096), &dev).unwrap();
            assert!(d.n_chunks() > 1, "{dev:?}: {d:?}");
            assert!(d.params.chunk_len as usize * d.n_chunks() >= 4096);
            // Subgroups on both: one workgroup per chunk and team, a team of 4 whole groups of
            // KV heads on the CPU adapter (register budget: 4 x 160 floats), of one on the GPU.
            let kvs = if dev.cpu { 4 } else { 1 };
            assert!(matches!(d.kernel, Pass1::Stream(k) if k.kvs == kvs && k.heads == 4));
            assert_eq!(d.pass1, (d.params.n_chunks, 8 / kvs));
            if dev.cpu {
                // 4 workgroups per host thread: 2 threads, 2 teams, 4 chunks.
                assert_eq!(d.params.n_chunks, 4);
            }
            assert_eq!(d.params.team_width, kvs);
            assert_eq!(d.pairs().count(), 1);
        }
        // DeepSeek's MLA on the CPU adapter: 2 teams of 8 heads that take four rows per
        // iteration, on the same 4 workgroups per host thread.
        let d = plan(&mla(DType::F16, 1, 4096), &LAVAPIPE).unwrap();
        assert!(matches!(d.kernel, Pass1::Stream(k) if k.step_rows == 4 && k.heads == 8));
        assert_eq!(d.pass1, (4, 2));
    }

    /// Lavapipe's GQA teams take one KV head each from Mesa 25.0 on where no slot is f32, several
    /// before it and where the driver does not say its version (Llama-3-8B's decode, every storage
    /// type and a mixed pair with f32 values); nothing else in the plan moves: MLA, chunked
    /// prefill's teams of several queries, OpenGL's one-invocation teams and GPUs plan as before.
    #[test]
    fn lavapipe_from_mesa_25_takes_one_kv_head_per_team() {
        let llama = |[t_k, t_v]: [DType; 2], n_q| {
            let words = |t: DType| t.row_bytes(8 * 128).unwrap() as usize / 4;
            CallShape {
                dtypes: [t_k, t_k, t_v],
                row_words: [words(t_k), words(t_k), words(t_v)],
                ..gqa(t_k, n_q, 32, 8, 128, 4096)
            }
        };
        let mut types: Vec<[DType; 2]> = DType::STORAGE.iter().map(|&t| [t, t]).collect();
        types.push([DType::F16, DType::F32]);
        for pair in types {
            // f32 keeps teams of several KV heads on every Mesa: 4 of them in 8 workgroups, where
            // teams of one take the fixed 32.
            let (one, wgs_one) = if pair.contains(&DType::F32) {
                (4, 8)
            } else {
                (1, 32)
            };
            for (mesa, kvs, wgs) in [
                (Some((22, 3)), 4, 8),
                (Some((24, 3)), 4, 8),
                (None, 4, 8),
                (Some((25, 0)), one, wgs_one),
                (Some((26, 1)), one, wgs_one),
            ] {
                let dev = DeviceFacts { mesa, ..LAVAPIPE };
                let before = DeviceFacts {
                    mesa: Some((22, 3)),
                    ..dev
                };
                let d = plan(&llama(pair, 1), &dev).unwrap();
                let (Pass1::Stream(key), Pass1::Stream(old)) =
                    (d.kernel, plan(&llama(pair, 1), &before).unwrap().kernel)
                else {
                    panic!("{pair:?} {mesa:?}: {d:?}")
                };
                assert_eq!((key.kvs, key.heads), (kvs, 4), "{pair:?} {mesa:?}");
                assert_eq!(d.pass1.0 * d.pass1.1, wgs, "{pair:?} {mesa:?}");
                // The key but for its KV heads is 22.3's.
                assert_eq!(
                    StreamKey {
                        kvs: old.kvs,
                        ..key
                    },
                    old,
                    "{pair:?} {mesa:?}"
                );
                let gl = |d: DeviceFacts| DeviceFacts {
                    subgroup: None,
                    int64: false,
                    ..d
                };
                for (s, what) in [
                    (llama(pair, 1), "decode"),
                    (llama(pair, 8), "8 queries"),
                    (mla(pair[0], 1, 4096), "MLA"),
                    (mla(pair[0], 8, 4096), "MLA, 8 queries"),
                ] {
                    let mut pairs = vec![(gl(dev), gl(before)), (DeviceFacts { mesa, ..GPU }, GPU)];
                    if what != "decode" {
                        pairs.push((dev, before));
                    }
                    for (a, b) in pairs {
                        assert_eq!(
                            format!("{:?}", plan(&s, &a)),
                            format!("{:?}", plan(&s, &b)),
                            "{pair:?} {mesa:?}, {what}"
                        );
                    }
                }
            }
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
                        for dev in devices() {
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
                    for dev in devices() {
                        let s = mla(dtype, n_q, visible);
                        // One-invocation teams do not hold DeepSeek's rows (below).
                        if dev.choice == KernelChoice::StreamAlone {
                            assert!(plan(&s, &dev).is_err());
                            continue;
                        }
                        let p = plan(&s, &dev).unwrap();
                        assert!(worst_iterations(&s, &p) < LOOP_BUDGET, "{s:?}");
                        checked += 1;
                    }
                }
            }
        }
        assert!(checked > 1500, "{checked} plans checked");
    }

    #[test]
    fn cpu_adapters_reduce_with_one_vector_unless_the_chunks_need_more_lanes() {
        let mut fallbacks = 0;
        for dev in devices() {
            // Decode and a 128-sequence batch: few chunks, 8 lanes on a CPU adapter; a GPU splits
            // the chunks between 256.
            let decode = gqa(DType::F16, 1, 32, 8, 128, 4096);
            let batch = CallShape {
                n_q: 128,
                visible: 8192,
                ..pooled(decode, 16, 4096, Some(39_486))
            };
            let lanes = if dev.cpu { 8 } else { REDUCE_SPLIT_LANES };
            for s in [decode, batch, mla(DType::F16, 1, 4096)] {
                let p = match plan(&s, &dev) {
                    Ok(p) => p,
                    Err(e) => {
                        assert_eq!(dev.choice, KernelChoice::StreamAlone, "{s:?}: {e:?}");
                        continue;
                    }
                };
                assert_eq!(p.reduce_lanes, lanes, "{dev:?} {s:?}");
            }
            // One query deep in a long sequence with a short window, beside one at its start: the
            // chunks cover both, too many for 8 lanes to merge 512-element rows within the budget.
            let far = CallShape {
                window: 16,
                paging: batch.paging,
                ragged: Some(Ragged { lo: 0, seen: 17 }),
                ..gqa(DType::F16, 2, 4, 1, 512, 200_001)
            };
            let p = match plan(&far, &dev) {
                Ok(p) => p,
                // One-invocation teams do not hold 512-element heads.
                Err(e) => {
                    assert_eq!(dev.choice, KernelChoice::StreamAlone, "{e:?}");
                    continue;
                }
            };
            let narrow_fits = reduce_iterations(p.n_chunks(), 512, 8) < LOOP_BUDGET - 1;
            let expected = match (dev.cpu, narrow_fits) {
                (true, true) => 8,
                (true, false) => 64,
                (false, _) => REDUCE_SPLIT_LANES,
            };
            assert_eq!(p.reduce_lanes, expected, "{dev:?}: {} chunks", p.n_chunks());
            assert!(worst_iterations(&far, &p) < LOOP_BUDGET);
            fallbacks += usize::from(dev.cpu && !narrow_fits);
        }
        assert!(fallbacks > 0, "no CPU plan needed the wide reduce");
    }

    /// The reduce binds the partial results as 16-byte vectors, so a binding limit that is not
    /// whole vectors (Vulkan and DX12 report 2^31 - 1) is planned in whole vectors. Partial results
    /// of 2^27 - 4 bytes on a limit of 2^27 - 1 were planned as one pair, and the reduce, seeing
    /// one vector fewer than it needed, wrote no output.
    #[test]
    fn scratch_is_planned_in_whole_vectors_of_an_odd_binding_limit() {
        for odd in [(1 << 27) - 1, (1 << 31) - 1] {
            let s = CallShape {
                d_v: 1801,
                row_words: [4, 4, 1801],
                ..gqa(DType::F32, 31, 601, 1, 4, 64)
            };
            let mut planned = 0;
            for dev in devices() {
                let dev = DeviceFacts {
                    max_binding: odd,
                    ..dev
                };
                let Ok(p) = plan(&s, &dev) else { continue };
                let whole = odd - odd % 16;
                assert!(
                    p.part_bytes <= whole && p.stats_bytes <= whole,
                    "{dev:?}: partials {} and stats {} on a limit of {odd}",
                    p.part_bytes,
                    p.stats_bytes
                );
                planned += 1;
            }
            assert!(planned >= 4, "{planned} plans");
        }
    }

    /// A ragged batch's query table shares the stats binding with the partial results: the pairs
    /// leave room for it. Two sequences of 8,192 rows, every row a query of 1,024 one-dimensional
    /// heads, took stats of 2^27 - 32,768 bytes beside a table of 131,072 on a 128 MiB binding.
    #[test]
    fn a_batch_leaves_room_for_its_query_table() {
        let mut planned = 0;
        for dev in devices() {
            let s = pooled(
                gqa(DType::F32, 16_384, 1024, 1, 1, 8192),
                16,
                1024,
                Some(2 * (8192 * 8193 / 2)),
            );
            let Ok(p) = plan(&s, &dev) else { continue };
            let table = QUERY_TABLE_BYTES * s.n_q as u64;
            assert!(
                p.stats_bytes + table <= scratch_binding(&dev)
                    && p.part_bytes <= scratch_binding(&dev),
                "{dev:?}: stats {} + table {table}, partials {}",
                p.stats_bytes,
                p.part_bytes
            );
            planned += 1;
        }
        assert!(planned >= 4, "{planned} plans");
        // A table alone as large as the binding is refused, naming it (a device of 64 KiB bindings).
        let s = pooled(gqa(DType::F32, 8192, 1, 1, 4, 8192), 16, 512, Some(8192));
        let small = DeviceFacts {
            max_binding: 1 << 16,
            ..LAVAPIPE
        };
        let (limit, e) = plan(&s, &small).unwrap_err();
        assert!(e.contains("query table of 65536 bytes"), "{e}");
        assert_eq!(limit, AttentionLimit::QueryTable);
    }

    /// The refusals that say how far a call is past the loop budget name their limit: heads so wide
    /// that one tile of the tiled kernel passes it, and more rows than a device of 8 workgroups per
    /// dimension splits into chunks within it (a streaming kernel's chunks too).
    #[test]
    fn calls_past_the_loop_budget_name_the_limit() {
        let tiled = DeviceFacts {
            choice: KernelChoice::Tiled,
            ..LAVAPIPE
        };
        let wide = gqa(DType::F32, 1, 1, 1, 100_000, 100);
        let (limit, e) = plan(&wide, &tiled).unwrap_err();
        assert_eq!(limit, AttentionLimit::HeadSize, "{e}");
        for choice in [KernelChoice::Tiled, KernelChoice::Auto] {
            let narrow = DeviceFacts {
                max_workgroups: 8,
                choice,
                ..LAVAPIPE
            };
            let long = gqa(DType::F32, 1, 1, 1, 2048, 1 << 20);
            let (limit, e) = plan(&long, &narrow).unwrap_err();
            assert_eq!(limit, AttentionLimit::Rows, "{choice:?}: {e}");
        }
    }

    #[test]
    fn devices_below_attention_s_limits_are_refused_by_name() {
        let shape = gqa(DType::F32, 1, 32, 8, 128, 4096);
        // wgpu's downlevel limits: four storage buffers per stage.
        let few = DeviceFacts {
            storage_buffers: 4,
            ..GPU
        };
        let (limit, e) = plan(&shape, &few).unwrap_err();
        assert!(
            e.contains("8 storage buffers") && e.contains("allows 4"),
            "{e}"
        );
        assert_eq!(limit, AttentionLimit::Bindings);
        // Less workgroup memory than the tiled kernel's: a streamed shape is planned, a shape only
        // the tiled kernel takes (odd dims) is refused.
        let small = DeviceFacts {
            workgroup_bytes: 8 << 10,
            ..GPU
        };
        assert!(matches!(
            plan(&shape, &small).unwrap().kernel,
            Pass1::Stream(_)
        ));
        let odd = gqa(DType::F32, 1, 8, 2, 33, 100);
        let (limit, e) = plan(&odd, &small).unwrap_err();
        assert!(e.contains("10440 bytes of workgroup memory"), "{e}");
        assert_eq!(limit, AttentionLimit::WorkgroupMemory);
        assert!(plan(&odd, &GPU).is_ok());
    }

    #[test]
    fn the_reported_failures_are_now_planned_within_the_budget() {
        // 16 queries over 16,384 rows (one workgroup used to walk it all) and MLA with 16 queries over
        // 2,048 rows, DeepSeek-V2-Lite shapes.
        for dev in devices() {
            let s = gqa(DType::F32, 16, 32, 8, 128, 16_384);
            let p = plan(&s, &dev).unwrap();
            // The tiled kernel loops many times per row; the streaming one once.
            if let Pass1::Tiled { .. } = p.kernel {
                assert!(p.n_chunks() > 1);
            }
            assert!(worst_iterations(&s, &p) < LOOP_BUDGET);
            let s = mla(DType::F16, 16, 2048);
            if dev.choice == KernelChoice::StreamAlone {
                continue;
            }
            let p = plan(&s, &dev).unwrap();
            assert!(worst_iterations(&s, &p) < LOOP_BUDGET);
        }
    }

    #[test]
    fn the_kernel_follows_the_shape_and_the_choice() {
        let llama = gqa(DType::F16, 1, 32, 8, 128, 4096);
        let stream = |d: Dispatch| match d.kernel {
            Pass1::Stream(key) => Some(key),
            Pass1::Tiled { .. } => None,
        };
        // Auto: subgroups where the device has them, one team per KV head with its whole group.
        let key = stream(plan(&llama, &LAVAPIPE).unwrap()).unwrap();
        assert_eq!((key.sum, key.lanes, key.heads), (TeamSum::Subgroup, 8, 4));
        // A CPU adapter loads 64-bit words where the device has 64-bit integers; a GPU keeps
        // 32-bit words.
        assert!(key.wide);
        let no_int64 = DeviceFacts {
            int64: false,
            ..LAVAPIPE
        };
        assert!(!stream(plan(&llama, &no_int64).unwrap()).unwrap().wide);
        assert!(!stream(plan(&llama, &GPU).unwrap()).unwrap().wide);
        // A CPU adapter without subgroups: one-invocation teams of two heads (the register
        // budget). Its 16 teams (8 KV heads x 2 head batches) fill two workgroups of 8 per chunk.
        let no_subgroups = DeviceFacts {
            subgroup: None,
            ..LAVAPIPE
        };
        let d = plan(&llama, &no_subgroups).unwrap();
        let key = stream(d).unwrap();
        assert_eq!((key.sum, key.lanes, key.heads), (TeamSum::Alone, 1, 2));
        assert_eq!((d.params.team_width, d.pass1), (8, (d.params.n_chunks, 2)));
        // Fewer teams than 8 share a workgroup with more chunks: 2 teams (MHA over 2 KV heads) take
        // 4 chunks each, 3 teams 8 chunks each.
        for (n_kv, width) in [(2, 2), (3, 1)] {
            let d = plan(&gqa(DType::F16, 1, n_kv, n_kv, 128, 4096), &no_subgroups).unwrap();
            let per = ALONE_TEAMS as usize / width;
            assert_eq!(d.params.team_width as usize, width);
            assert_eq!(d.n_chunks() % per, 0);
            assert_eq!(
                d.pass1,
                ((d.n_chunks() / per) as u32, (n_kv / width) as u32)
            );
        }
        let key = stream(plan(&llama, &GPU).unwrap()).unwrap();
        assert_eq!((key.sum, key.lanes), (TeamSum::Subgroup, 32));
        let gpu_without = DeviceFacts {
            subgroup: None,
            ..GPU
        };
        let key = stream(plan(&llama, &gpu_without).unwrap()).unwrap();
        assert_eq!((key.sum, key.lanes), (TeamSum::Shared, 32));
        // DeepSeek's MLA needs more registers than one invocation may hold: workgroup-memory sums.
        let key = stream(plan(&mla(DType::F16, 1, 4096), &no_subgroups).unwrap()).unwrap();
        assert_eq!((key.sum, key.lanes), (TeamSum::Shared, 8));
        // Two of its heads per team of 8 lanes on a CPU adapter (LANE_FLOATS_SHARED_CPU), f32 and
        // f16 alike; on a GPU without subgroups, teams of 32 lanes keep LANE_FLOATS_SHARED's 8 (f32)
        // and 4 (f16, whose rope key of 64 takes a whole 8-element vector on each of 8 lanes).
        for (dtype, on_gpu) in [(DType::F32, 8), (DType::F16, 4)] {
            let key = stream(plan(&mla(dtype, 1, 4096), &no_subgroups).unwrap()).unwrap();
            assert_eq!(key.heads, 2, "{dtype:?}");
            let key = stream(plan(&mla(dtype, 1, 4096), &gpu_without).unwrap()).unwrap();
            assert_eq!(
                (key.sum, key.lanes, key.heads),
                (TeamSum::Shared, 32, on_gpu)
            );
        }
        let forced = DeviceFacts {
            choice: KernelChoice::StreamAlone,
            ..no_subgroups
        };
        assert!(plan(&mla(DType::F16, 1, 4096), &forced).is_err());
        // MLA takes its values from the latent it scores.
        let key = stream(plan(&mla(DType::BF16, 1, 4096), &LAVAPIPE).unwrap()).unwrap();
        assert!(key.v_from_a && key.d_b == 64);
        // On a CPU adapter, four rows per iteration and eight of its 16 heads per team:
        // 8 x (72 + 64) + 4 x 72 registers per lane; the same for its quantized rows
        // (8 x (80 + 64) + 4 x 80, the whole budget). A GPU's teams of 32 lanes keep one row per
        // iteration and as many heads as LANE_FLOATS_SHARED holds, as the workgroup-memory
        // kernel's do: 4 of 16-bit rows (4 x (24 + 16) + 24 = 184 floats; 8 would be 344), 8 of
        // f32 (308).
        assert_eq!((key.heads, key.step_rows), (8, 4));
        for (dtype, heads) in [(DType::BF16, 4), (DType::F16, 4), (DType::F32, 8)] {
            let key = stream(plan(&mla(dtype, 1, 4096), &GPU).unwrap()).unwrap();
            assert_eq!(
                (key.heads, key.step_rows, key.lanes),
                (heads, 1, 32),
                "{dtype}"
            );
            let floats =
                stream::lane_floats([dtype; 3], 32, heads as usize, [512, 64, 512], true, 1);
            assert!(floats <= LANE_FLOATS_SHARED, "{dtype}: {floats}");
        }
        for dtype in DType::QUANTIZED {
            let words = |e: usize| dtype.row_bytes(e).unwrap() as usize / 4;
            let s = CallShape {
                dtypes: [dtype; 3],
                row_words: [words(512), words(64), words(512)],
                ..mla(DType::F16, 1, 4096)
            };
            let key = stream(plan(&s, &LAVAPIPE).unwrap()).unwrap();
            assert_eq!((key.heads, key.step_rows), (8, 4), "{dtype}");
            let floats = stream::lane_floats(s.dtypes, 8, 8, [512, 64, 512], true, 4);
            assert_eq!(floats, LANE_FLOATS_MLA_CPU, "{dtype}");
        }
        // Subgroups of 4 lanes: four rows would leave 2 heads per team (4 x (144 + 128) + 4 x
        // 144 = 1,664 floats for 4), two rows keep 4 (1,376).
        let narrow = DeviceFacts {
            subgroup: Some(4),
            ..LAVAPIPE
        };
        for dtype in DType::ALL {
            let key = stream(plan(&mla(dtype, 1, 4096), &narrow).unwrap()).unwrap();
            assert_eq!((key.heads, key.step_rows, key.lanes), (4, 2, 4), "{dtype}");
        }
        // f16 through `unpack2x16float` in the subgroup kernels of CPU adapters only: OpenGL's
        // kernels (workgroup memory, one invocation) and GPUs keep the integer conversion.
        let f16_unpack = |dev: &DeviceFacts| {
            let d = plan(&llama, dev).unwrap();
            (stream(d).unwrap().f16_unpack, d.kernel)
        };
        assert!(f16_unpack(&LAVAPIPE).0);
        assert!(!f16_unpack(&GPU).0);
        for choice in [KernelChoice::StreamShared, KernelChoice::StreamAlone] {
            let (unpack, kernel) = f16_unpack(&DeviceFacts { choice, ..LAVAPIPE });
            assert!(!unpack, "{kernel:?}");
        }
        // A head of 6 elements is not a whole number of vectors: the tiled kernel, or a refusal
        // when a streaming kernel is forced.
        let odd = gqa(DType::F32, 1, 4, 2, 6, 100);
        assert!(stream(plan(&odd, &LAVAPIPE).unwrap()).is_none());
        for choice in [
            KernelChoice::StreamShared,
            KernelChoice::StreamSubgroup,
            KernelChoice::StreamAlone,
        ] {
            let forced = DeviceFacts { choice, ..LAVAPIPE };
            let (limit, e) = plan(&odd, &forced).unwrap_err();
            assert!(e.contains("one vector of its slot"), "{e}");
            assert_eq!(limit, AttentionLimit::Kernel);
        }
        // K and V of different types: each slice in vectors of its own type. V of 8 f16 (one 16-byte
        // vector) streams beside q8_0 keys; V of 8 q8_0 elements (half a vector) does not.
        let mixed = CallShape {
            dtypes: [DType::Q8_0, DType::Q8_0, DType::F16],
            d_v: 8,
            row_words: [2 * 136 / 4, 2 * 136 / 4, 2 * 8 / 2],
            ..gqa(DType::Q8_0, 1, 8, 2, 128, 4096)
        };
        let key = stream(plan(&mixed, &LAVAPIPE).unwrap()).unwrap();
        assert_eq!(key.dtypes, mixed.dtypes);
        let half_vector = CallShape {
            dtypes: [DType::F16, DType::F16, DType::F8E4M3],
            row_words: [2 * 128 / 2, 2 * 128 / 2, 2 * 8 / 4],
            ..mixed
        };
        assert!(stream(plan(&half_vector, &LAVAPIPE).unwrap()).is_none());
        let forced = DeviceFacts {
            choice: KernelChoice::StreamSubgroup,
            ..no_subgroups
        };
        let (limit, e) = plan(&llama, &forced).unwrap_err();
        assert!(
            e.contains("SUBGROUP") && limit == AttentionLimit::Kernel,
            "{e}"
        );
        let tiled = DeviceFacts {
            choice: KernelChoice::Tiled,
            ..LAVAPIPE
        };
        assert!(stream(plan(&llama, &tiled).unwrap()).is_none());
    }

    #[test]
    fn queries_whose_partials_overflow_one_binding_are_split_into_pairs() {
        // 4096 queries of 32 heads x 128 over 512k rows, and MLA chunked prefill at 128k.
        // (The streaming kernel's longer chunks keep that MLA call in one pair.)
        let tiled = DeviceFacts {
            choice: KernelChoice::Tiled,
            ..LAVAPIPE
        };
        for (s, dev) in [
            (gqa(DType::F32, 4096, 32, 8, 128, 524_288), LAVAPIPE),
            (gqa(DType::F32, 4096, 32, 8, 128, 524_288), tiled),
            (mla(DType::F32, 64, 131_072), tiled),
        ] {
            let d = plan(&s, &dev).unwrap();
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
