//! The row-streaming attention kernel (pass 1), generated per shape. Pure: WGSL text from a
//! [`StreamKey`], no wgpu object.
//!
//! One workgroup is one *team* of `lanes` invocations; it takes one chunk of the visible rows, one
//! KV head and `heads` of the query heads that share it, for one query (on CPU adapters with
//! subgroups, `kvs` consecutive KV heads with all of their query heads, [`StreamKey::kvs`], or for
//! a call of several queries of one sequence `queries` of them with one KV head's query heads,
//! [`StreamKey::queries`]). The lanes split every row between them in 16-byte loads (`vec4<u32>`:
//! four f32, eight 16-bit, sixteen q8_0 or fp8 elements; q4_0 in 8-byte loads of sixteen, so that a
//! head of 128 still spans eight lanes; the block types also load the vector holding that vector's
//! scale; on CPU adapters with 64-bit integers the same bytes as two 64-bit words,
//! [`StreamKey::wide`]), lane `l` taking the vectors `l, l + lanes, l + 2 lanes, ...` of the head's
//! slice (in 64-bit words, f32 and 16-bit slices whose steps pair up take two adjacent vectors per
//! load instead: `2l, 2l + 1, 2 lanes + 2l, ...`), so each lane keeps only its own elements of the
//! queries and of the output in registers. Per row, each lane's partial dot products are summed
//! over the team (`subgroupAdd` where the adapter has subgroups of exactly `lanes` invocations, on
//! CPU adapters `log2(lanes)` steps of `subgroupShuffleXor` instead, [`StreamKey::shuffles`];
//! else through workgroup memory with one barrier per row; or not at all, where a team is one
//! invocation reading whole rows and a workgroup holds [`ALONE_TEAMS`] of them, side by side on one
//! row's KV heads where there are enough: [`TeamSum::Alone`], for CPU adapters without subgroups),
//! and an online softmax folds the row's values into the accumulators, rescaling only when a head's
//! maximum grows. MLA takes its values from the latent vectors it has just loaded for the scores.
//!
//! Every loop over elements and heads is unrolled in the generated text: the only loop left walks the
//! chunk's rows, so an invocation runs one loop iteration per row, or per several rows where the
//! key says so ([`StreamKey::step_rows`]: four for MLA on CPU adapters with subgroups, whose
//! spilled registers then serve four rows per load, and two for GQA over a contiguous f32 cache on
//! GPUs with subgroups, which then wait on the loads of two rows at once; the planner keeps chunks
//! within the software adapters' loop budget). The partial results have the layout of
//! `shaders/attention_partial.wgsl`, so `shaders/attention_reduce.wgsl` merges either kernel's. A
//! call of one chunk whose output has that layout (`[n_q, n_heads, d_v]`, contiguous, at the start
//! of its binding) binds it in their place: pass 1 writes the normalised output, and no reduce runs
//! (`AttnParams::direct`).

use std::fmt::Write as _;

use super::plan::RowMode;
use crate::codec::DType;

/// How the lanes of a team add up their partial dot products.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum TeamSum {
    /// `subgroupAdd`, or steps of `subgroupShuffleXor` ([`StreamKey::shuffles`]): the adapter's
    /// subgroups have exactly `lanes` invocations.
    Subgroup,
    /// Workgroup memory and one barrier per row: any adapter.
    Shared,
    /// No sum: a team is one invocation, which reads whole rows, and a workgroup is
    /// [`ALONE_TEAMS`] invocations: `p.team_width` teams (KV head x head batch, 8 where they are a
    /// multiple of 8) side by side on the same rows, each on `8 / team_width` chunks. No barrier
    /// and no cross-lane traffic: for CPU adapters, where a workgroup is one SIMD vector and a
    /// barrier per row cost about half of the kernel's time on llvmpipe.
    Alone,
}

/// Products per statement of a generated dot product.
const TERMS: usize = 16;

/// Invocations (each a team) in one workgroup of the [`TeamSum::Alone`] kernel: one SIMD vector of
/// llvmpipe and lavapipe.
pub(crate) const ALONE_TEAMS: u32 = 8;

/// Rows of the blocks that one-invocation teams take in turn through a page table, where a team
/// takes several chunks (invocation `t` of the `n` on a team's chunks takes the blocks `t, t + n,
/// ...` of their rows): a lane crosses a page at most once per block instead of every few rows, and
/// still takes at most one block more than a chunk's rows (the planner's loop budget). 8 was the
/// fastest of 4, 8 and whole 16-row pages on GL (docs/benchmarks.md).
pub(crate) const ALONE_BLOCK_ROWS: u32 = 8;

impl StreamKey {
    /// Invocations per workgroup.
    pub(crate) fn workgroup_size(&self) -> u32 {
        match self.sum {
            TeamSum::Alone => ALONE_TEAMS,
            _ => self.lanes,
        }
    }

    /// The team's (pair, query, head) triples. Its query heads are `heads` for each of its `kvs` KV
    /// heads, consecutive from `h0`; its queries `queries` consecutive ones from `qi`, each with the
    /// same heads. Pair `t = qq * th + h` (`th` heads per query) is query `qi + qq`'s head `h0 + h`,
    /// and its registers are named by `t`.
    fn pairs(self) -> impl Iterator<Item = (u32, u32, u32)> {
        let th = self.heads * self.kvs;
        (0..self.queries * th).map(move |t| (t, t / th, t % th))
    }
}

/// Everything a generated kernel is specialised for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct StreamKey {
    /// Storage types of slots a, b and v (each slot's vectors are read and unpacked as its own).
    pub dtypes: [DType; 3],
    /// Invocations per team.
    pub lanes: u32,
    /// Query heads per team and KV head (dividing the group).
    pub heads: u32,
    /// Consecutive KV heads per team, each with all of its group's query heads where more than one
    /// ([`TeamSum::Subgroup`] on CPU adapters; on lavapipe from Mesa 25.0 on where a slot is
    /// f32): the team's lanes then read a run of whole heads of each row side by side, instead of
    /// one head's slice at a row's stride.
    pub kvs: u32,
    pub d_a: u32,
    pub d_b: u32,
    pub d_v: u32,
    /// Values are the score slot's elements (MLA): slot v is slot a and `d_v == d_a`.
    pub v_from_a: bool,
    /// The kernel has the logit soft-cap: a branch on `p.soft_cap`. Without it, it serves only
    /// calls without a cap (the planner leaves it out of lavapipe's kernels for such calls: on a
    /// CPU adapter both ways of a branch run, masked, and the unused cap's `tanh` cost 6-25% of
    /// GQA decode there).
    pub soft_cap: bool,
    /// Rows of one loop iteration (1, 2 or 4: `r` and `r + 1, ...` where the chunk has them):
    /// each query element and accumulator a lane loads from its spilled registers serves every
    /// row's products, and the rows' loads are in flight together ([`TeamSum::Subgroup`] only: the
    /// planner asks for 4 for MLA on CPU adapters, where every register is memory,
    /// `plan::MLA_CPU_STEP_ROWS`, and 2 for GQA over a contiguous f32 cache on GPUs,
    /// `plan::GPU_STEP_ROWS`; 4 ran slower there).
    pub step_rows: u32,
    /// Consecutive queries per team (1, 4 or 8; more than 1 only with [`TeamSum::Subgroup`], for
    /// calls of one cache or one pool sequence, whose queries are the last rows in order, and with
    /// one KV head per team): each row a team loads serves the scores and values of every query it
    /// holds, so chunked prefill and verification read the rows once per team of queries instead
    /// of once per query. A query's rows past its own (causal) or before its window are left out
    /// of its softmax and its values.
    pub queries: u32,
    pub sum: TeamSum,
    /// With [`TeamSum::Subgroup`] over a power-of-two `lanes`: the team's sums are `log2(lanes)`
    /// steps of `subgroupShuffleXor`, each lane adding its partner's partial sum, instead of one
    /// `subgroupAdd` (every lane ends with the same bits, since addition commutes). For CPU
    /// adapters: lavapipe runs a `subgroupAdd` as a loop over the lanes, and Llama-3-8B's decode
    /// took 0.84-0.85 (f32) and 0.86-0.93 (f16) of its time with the steps at 4k
    /// (docs/benchmarks.md). GPUs keep `subgroupAdd` (the steps not measured there).
    pub shuffles: bool,
    /// f16 elements are converted with `unpack2x16float` instead of the exact integer rebias
    /// (`f16x4`), and fp8 ones too, two bytes of a word at once as f16 codes (`Gen::fp8_halves`):
    /// both ways read every finite code exactly and the NaN codes an append stores as NaN on the
    /// adapters tested (`attention_reads_every_stored_code_exactly`, `fp8_nan_codes_read_as_nan`,
    /// and `fp8_nan_codes_in_keys_make_their_scores_nan` in keys, MLA's latent and its rope key).
    /// e5m2's infinity codes, which no append stores, are an f16's own. For CPU
    /// adapters with subgroups: on lavapipe Llama-3-8B's f16 decode at 4k took about 0.87 of its
    /// time with it, and DeepSeek-V2-Lite's 0.88-0.94; e5m2 took 0.81-0.85 (GQA) and about 0.94
    /// (MLA), e4m3 0.77-1.01 (GQA) and about 0.95 (MLA). On llvmpipe's OpenGL it made GQA over
    /// f16 slower (1.18 of its time), and GPUs keep the integer path until one has measured it
    /// (docs/benchmarks.md). Block scales keep the integer path.
    pub f16_unpack: bool,
    /// The slots' vectors are bound and loaded as 64-bit words (`vec2<u64>`, q4_0's 8 bytes as one
    /// `u64`; f32 and 16-bit slices of whole pairs of steps two vectors at once, `vec4<u64>`) and
    /// split into 32-bit words after the load (CPU adapters with `wgpu::Features::SHADER_INT64`): a
    /// software adapter loads a storage vector component by component, lane by lane, so this halves
    /// its loads, and the pairs halve the lane loops.
    pub wide: bool,
    /// How the kernel finds a query's rows.
    pub rows: RowMode,
    /// Slots a, b and v whose rows are not whole 16-byte vectors (block-quantized rows whose scales
    /// end inside one, such as DeepSeek's q8_0 `k_pe` of 68 bytes): bound as words, read in
    /// vectors of [`NARROW_VEC`] elements.
    pub narrow: [bool; 3],
}

/// Elements in one vector (one load of [`unit_words`] words) of `dtype` storage (of the values, for
/// the block types).
pub(crate) fn per_vec(dtype: DType) -> usize {
    match dtype {
        DType::F32 => 4,
        DType::F16 | DType::BF16 => 8,
        DType::Q8_0 | DType::F8E4M3 | DType::F8E5M2 | DType::Q4_0 => 16,
    }
}

/// Words in one vector of [`per_vec`] elements: 4 (16 bytes), or 2 for q4_0, whose 16 bytes would
/// hold 32 elements and leave half of an 8-lane team idle on a head of 128 (a slice that fills every
/// lane with 32 takes [`WIDE_Q4`]).
pub(crate) fn unit_words(dtype: DType) -> u32 {
    if dtype == DType::Q4_0 { 2 } else { 4 }
}

/// The WGSL type of a vector of `words` words.
fn words_type(words: u32) -> &'static str {
    match words {
        1 => "u32",
        2 => "vec2<u32>",
        _ => "vec4<u32>",
    }
}

/// One slice of a row (a head's `d` elements) as the lanes see it.
#[derive(Clone, Copy)]
struct Slice {
    /// Which slot: "a", "b" or "v".
    slot: &'static str,
    /// The slot's storage type.
    dtype: DType,
    /// Vectors in the slice.
    vecs: u32,
    lanes: u32,
    /// Elements in one vector: [`per_vec`], [`NARROW_VEC`] in a slot read as words, or
    /// [`WIDE_Q4`].
    unit: u32,
    /// Read as words (see [`StreamKey::narrow`]).
    narrow: bool,
    /// Loaded as 64-bit words (see [`StreamKey::wide`]; not a narrow slot).
    wide: bool,
    /// Two steps per load (wide f32 and 16-bit slices of whole pairs of steps): the slot is bound
    /// as `vec4<u64>`, and lane `l` takes vectors `2l` and `2l + 1` of each `2 lanes`. A software
    /// adapter's load is a loop over the SIMD lanes whose per-lane overhead (the lane's mask, address
    /// and bounds) then serves 32 bytes instead of 16: on lavapipe Llama-3-8B's decode took 0.85-0.95
    /// of its time (docs/benchmarks.md).
    pair: bool,
}

/// Elements in one q4_0 vector where a head's slice is whole 16-byte vectors of 32 for every lane
/// (DeepSeek's latent of 512: two steps of 8 lanes): one block per vector, half the loads of
/// 8-byte vectors of 16, and a quarter of the vectors of scales.
const WIDE_Q4: u32 = 32;

/// Elements in one vector of a block-quantized slot read as words (rows that are not whole 16-byte
/// vectors): q8_0's 8 in two words, q4_0's 8 in one. Twice as many lanes share such a row as would
/// with 16, each with half the loads: on a CPU adapter every load is a loop over the SIMD lanes,
/// and DeepSeek's 64-element q8_0 `k_pe` took five on each of 4 lanes.
const NARROW_VEC: u32 = 8;

impl Slice {
    /// Elements in one vector.
    fn u(&self) -> u32 {
        self.unit
    }

    /// The WGSL type of the slot's binding.
    fn binding_type(&self) -> &'static str {
        if self.pair {
            return "vec4<u64>";
        }
        match (self.narrow, self.wide, self.words()) {
            (true, _, _) => "u32",
            (_, true, 2) => "u64",
            (_, true, _) => "vec2<u64>",
            (_, false, words) => words_type(words),
        }
    }

    /// The slice's vector that this lane takes in step `j` (WGSL, in `lane`).
    fn vec_of(&self, j: u32) -> String {
        if self.pair {
            format!("2u * lane + {}u", (j - j % 2) * self.lanes + j % 2)
        } else {
            format!("lane + {}u", j * self.lanes)
        }
    }

    /// Vectors per load: 2 in a [`Slice::pair`].
    fn per_load(&self) -> u32 {
        if self.pair { 2 } else { 1 }
    }

    /// Loads that cover the slice: the stride of one KV head in the binding's elements.
    fn loads(&self) -> u32 {
        self.vecs / self.per_load()
    }

    /// 32-bit words in one element of the binding (one load).
    fn load_words(&self) -> u32 {
        self.words() * self.per_load()
    }

    /// The first load of step `j` (of a pair's two steps), from the lanes' base: lanes take
    /// consecutive loads.
    fn step_load(&self, j: u32) -> u32 {
        j / self.per_load() * self.lanes
    }

    /// Vector `at` of the slot (WGSL), as 32-bit words.
    fn read(&self, at: &str) -> String {
        if self.wide {
            format!("words{}(slot_{}[{at}])", self.words(), self.slot)
        } else {
            format!("slot_{}[{at}]", self.slot)
        }
    }

    /// For the block types: the words of one vector of scales (a narrow slot wraps its scale word in
    /// one), and the value vectors that share it.
    fn scales(&self) -> Option<(u32, u32)> {
        self.dtype.block()?;
        let words = if self.narrow {
            unit_words(self.dtype)
        } else {
            self.words()
        };
        // Two f16 scales per word, one per block of 32 elements.
        Some((words, words * 64 / self.unit))
    }

    /// The block (of the row's values) that value vector `vi` (WGSL) lies in.
    fn block_of(&self, vi: &str) -> String {
        match 32 / self.unit {
            1 => vi.to_string(),
            n => format!("({vi} / {n}u)"),
        }
    }

    /// Words in one vector.
    fn words(&self) -> u32 {
        let bits = match self.dtype {
            DType::F32 => 32,
            DType::F16 | DType::BF16 => 16,
            DType::Q8_0 | DType::F8E4M3 | DType::F8E5M2 => 8,
            DType::Q4_0 => 4,
        };
        self.unit * bits / 32
    }

    /// f32 vectors per vector of storage: part `c` holds elements `c, P + c, 2P + c, 3P + c` of it
    /// (`P` parts).
    fn n_parts(&self) -> u32 {
        self.u() / 4
    }

    /// Register names of the f32 vectors of step `j`: one for f32, the even and odd elements for
    /// 16-bit storage, one per byte (q8_0, fp8) or nibble (q4_0) of a word.
    fn parts(&self, name: &str, j: u32) -> Vec<String> {
        match self.n_parts() {
            1 => vec![format!("{name}{j}")],
            2 => vec![format!("{name}{j}e"), format!("{name}{j}o")],
            n => (0..n).map(|c| format!("{name}{j}_{c}")).collect(),
        }
    }

    /// Steps of the lanes over the slice (the last may be partial).
    fn steps(&self) -> u32 {
        self.vecs.div_ceil(self.lanes)
    }

    /// Lanes that hold a vector in the last step, when fewer than all.
    fn last_lanes(&self) -> Option<u32> {
        let rem = self.vecs % self.lanes;
        (rem != 0).then_some(rem)
    }
}

/// The WGSL function `name` of four words `arg`: the f16 in half `half` of each (`x` the low half,
/// `y` the high one) as f32, through `unpack2x16float` ([`StreamKey::f16_unpack`]).
fn f16_halves_fn(name: &str, arg: &str, half: &str) -> String {
    let parts = ["x", "y", "z", "w"].map(|c| format!("unpack2x16float({arg}.{c}).{half}"));
    format!(
        "fn {name}({arg}: vec4<u32>) -> vec4<f32> {{ return vec4<f32>({}); }}",
        parts.join(", ")
    )
}

/// Byte `c` of each of the four words `w` of an fp8 vector as f32, through the functions of
/// `Gen::fp8_halves` ([`StreamKey::f16_unpack`]).
fn fp8_part(dtype: DType, c: u32) -> String {
    let name = if dtype == DType::F8E5M2 {
        "e5m2"
    } else {
        "e4m3"
    };
    let half = if c < 2 { "lo" } else { "hi" };
    let bytes = if c.is_multiple_of(2) { "02" } else { "13" };
    let part = format!("f16_{half}({name}_{bytes}(w))");
    if dtype == DType::F8E5M2 {
        part
    } else {
        format!("{part} * 256.0")
    }
}

/// The statements that unpack one vector of an f32 or 16-bit slice, its 32-bit words `words`
/// (WGSL), into its registers `names` (16-bit: through a `let` named `w`).
fn plain(s: &Slice, names: &[String], words: &str, w: &str) -> String {
    match s.dtype {
        DType::F32 => format!("{} = bitcast<vec4<f32>>({words}); ", names[0]),
        dtype => {
            let t = if dtype == DType::F16 { "f16" } else { "bf16" };
            format!(
                "let {w} = {words}; {} = even_{t}({w}); {} = odd_{t}({w}); ",
                names[0], names[1]
            )
        }
    }
}

/// Registers one lane of a team holds (query elements, accumulators and the elements of the `rows`
/// rows of a loop iteration), per the planner's budget.
pub(crate) fn lane_floats(
    dtypes: [DType; 3],
    lanes: usize,
    heads: usize,
    dims: [usize; 3],
    v_from_a: bool,
    rows: usize,
) -> usize {
    let [a, b, v] = [0, 1, 2].map(|i| {
        let u = per_vec(dtypes[i]);
        (dims[i] / u).div_ceil(lanes) * u
    });
    // Saturating: on wasm32 heads of 2^31 elements pass usize (no kernel takes them).
    let row = a
        .saturating_add(b)
        .saturating_add(if v_from_a { 0 } else { v });
    heads
        .saturating_mul(a.saturating_add(b).saturating_add(v))
        .saturating_add(rows.saturating_mul(row))
}

/// The WGSL of pass 1 for `key`, after `prelude` (dtype codes and `AttnParams`).
pub(crate) fn source(key: &StreamKey, prelude: &str, rows: &str) -> String {
    let mut g = Gen {
        out: String::with_capacity(16 << 10),
        key: *key,
    };
    if key.rows == RowMode::Ragged && key.sum == TeamSum::Subgroup {
        // A batch's query row is read from storage (the query table in `stats`), which the
        // uniformity analysis cannot prove uniform, though every lane of a workgroup reads the
        // same entry, written before the dispatch: the subgroup sums below run in uniform control
        // flow all the same. Taking the row through workgroupUniformLoad instead made llvmpipe
        // compile the whole kernel for barriers, about 20% slower per row.
        g.out.push_str("diagnostic(off, subgroup_uniformity);\n");
    }
    g.out.push_str(prelude);
    g.out.push_str(rows);
    g.all();
    g.out
}

/// The bindings of pass 1 after the slots, as `shaders/attention_partial.wgsl` declares them, but
/// the partial results in 16-byte vectors (one store for four of a lane's outputs).
const BINDINGS: &str = "\
@group(0) @binding(3) var<storage, read> table: array<u32>;
@group(1) @binding(0) var<storage, read> q_a: array<f32>;
@group(1) @binding(1) var<storage, read> q_b: array<f32>;
@group(1) @binding(2) var<storage, read_write> stats: array<f32>;
@group(1) @binding(3) var<storage, read_write> part: array<vec4<f32>>;
@group(2) @binding(0) var<uniform> p: AttnParams;
";

struct Gen {
    out: String,
    key: StreamKey,
}

/// Writes the loads of one slice of a row: (slice, its first vector, the row stride's name, the
/// registers' tag, the row's index: `sr`, or `sr{i}` for row i of [`StreamKey::step_rows`]).
type LoadRow<'a> = dyn Fn(&mut Gen, &Slice, &str, &str, &str, &str) + 'a;

/// Appends a formatted line.
macro_rules! line {
    ($g:expr, $($arg:tt)*) => {{
        let _ = writeln!($g.out, $($arg)*);
    }};
}

impl Gen {
    fn slice(&self, i: usize, d: u32) -> Slice {
        let dtype = self.key.dtypes[i];
        let (lanes, narrow) = (self.key.lanes, self.key.narrow[i]);
        let unit = if narrow {
            NARROW_VEC
        } else if dtype == DType::Q4_0 && d > 0 && d.is_multiple_of(WIDE_Q4 * lanes) {
            WIDE_Q4
        } else {
            per_vec(dtype) as u32
        };
        let wide = self.key.wide && !narrow;
        let vecs = d / unit;
        Slice {
            slot: ["a", "b", "v"][i],
            dtype,
            vecs,
            lanes,
            unit,
            narrow,
            wide,
            // Whole pairs of steps only: a last, partial step would leave lanes without a pair.
            pair: wide
                && matches!(dtype, DType::F32 | DType::F16 | DType::BF16)
                && vecs > 0
                && vecs.is_multiple_of(2 * lanes),
        }
    }

    fn all(&mut self) {
        let k = self.key;
        let (qt, pairs) = (k.queries, move || k.pairs());
        debug_assert!(
            qt == 1 || (k.rows != RowMode::Ragged && k.sum == TeamSum::Subgroup && k.kvs == 1),
            "{k:?}"
        );
        let a = self.slice(0, k.d_a);
        let b = self.slice(1, k.d_b);
        let v = self.slice(2, k.d_v);
        // MLA's values are its latent's registers: one slot, read one way (the planner's keys).
        debug_assert!(!k.v_from_a || k.narrow[2] == k.narrow[0], "{k:?}");
        debug_assert!(k.step_rows == 1 || k.sum == TeamSum::Subgroup, "{k:?}");
        line!(self, "// Generated by src/attention/stream.rs for {k:?}.");
        line!(self, "const LANES: u32 = {}u;", k.lanes);
        line!(self, "const HT: u32 = {}u;", k.heads);
        line!(self, "const KVS: u32 = {}u;", k.kvs);
        if qt > 1 {
            line!(self, "const QT: u32 = {qt}u;");
        }
        line!(self, "const NEG: f32 = -3.4028234e38;");
        line!(self, "const ROWS: u32 = {}u;", k.rows.code());
        if k.rows == RowMode::Ragged && k.sum == TeamSum::Shared {
            line!(self, "var<workgroup> query_row: vec2<u32>;");
        }
        // The slots, read as 16-byte vectors (narrow ones as words).
        for (i, s) in [&a, &b, &v].into_iter().enumerate() {
            line!(
                self,
                "@group(0) @binding({i}) var<storage, read> slot_{}: array<{}>;",
                s.slot,
                s.binding_type()
            );
        }
        self.out.push_str(BINDINGS);
        if k.sum == TeamSum::Shared {
            // Double-buffered by row parity: a lane may write row r + 1's sums while another still
            // reads row r's, never row r - 1's (both passed row r's barrier).
            line!(
                self,
                "var<workgroup> sums: array<f32, {}>;",
                2 * k.heads * k.lanes
            );
        }
        self.unpack(&a, &b, &v);
        self.in_bounds(&a, &b, &v);
        line!(self, "@compute @workgroup_size({})", k.workgroup_size());
        if k.sum == TeamSum::Alone {
            // Each invocation is a team of one lane. A workgroup holds `p.team_width` teams (KV head
            // x head batch) side by side, each on `per` chunks: invocation i is team
            // `i % team_width` of the workgroup's, on its chunk `i / team_width`.
            line!(
                self,
                "fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) i: u32) {{"
            );
            line!(self, "    let lane = 0u;");
            line!(self, "    let width = p.team_width;");
            line!(self, "    let per = {ALONE_TEAMS}u / width;");
            line!(self, "    let sub = i / width;");
            line!(self, "    let chunk = wg.x * per + sub;");
            line!(self, "    let kvb = wg.z * width + i % width;");
        } else {
            line!(
                self,
                "fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lane: u32) {{"
            );
            // Grid (chunks, queries, teams), as in shaders/attention_partial.wgsl.
            line!(self, "    let chunk = wg.x;");
        }
        // The team: its KV head and head batch.
        let team = if k.sum == TeamSum::Alone {
            "kvb"
        } else {
            "wg.z"
        };
        line!(self, "    let kv = {team} / max(p.n_batches, 1u) * KVS;");
        line!(self, "    let batch = {team} % max(p.n_batches, 1u);");
        if qt > 1 {
            line!(self, "    let local = wg.y * QT;");
        } else {
            line!(self, "    let local = wg.y;");
        }
        line!(self, "    let qi = p.q_first + local;");
        line!(
            self,
            "    if chunk >= p.n_chunks || kv >= p.n_kv || local >= p.q_count || !in_bounds() {{ return; }}"
        );
        line!(self, "    let h0 = kv * p.group + batch * HT;");
        if qt > 1 {
            // The team's queries that the call has: `qi .. qi + nq`.
            line!(self, "    let nq = min(QT, p.q_count - local);");
        }
        if k.rows == RowMode::Ragged {
            // The query's own row and first page-table entry, read from the query table once and
            // shared, so that the row loop stays in uniform control flow (shaders/shared/rows.wgsl).
            // Only here: the barrier it takes makes Mesa's llvmpipe run the whole kernel slower.
            if k.sum != TeamSum::Shared {
                // Read by every lane (see `source`: no barrier in this kernel).
                line!(
                    self,
                    "    let own = vec2<u32>(query_last(qi), query_table(qi));"
                );
            } else {
                line!(
                    self,
                    "    if lane == 0u {{ query_row = vec2<u32>(query_last(qi), query_table(qi)); }}"
                );
                line!(self, "    let own = workgroupUniformLoad(&query_row);");
            }
            line!(self, "    let last = own.x;");
            line!(self, "    let tb = own.y;");
            line!(self, "    if !query_fits(last, tb) {{ return; }}");
        } else {
            // From uniforms alone (query_last would be non-uniform to the analysis: its batch branch
            // reads storage).
            line!(self, "    let last = p.visible - p.n_q + qi;");
            line!(self, "    let tb = p.table_base;");
        }
        line!(self, "    var first = 0u;");
        line!(
            self,
            "    if p.window > 0u && last + 1u > p.window {{ first = last + 1u - p.window; }}"
        );
        if k.sum == TeamSum::Alone {
            // A team's `per` chunks share their rows, interleaved, so that a short sequence still
            // keeps every lane busy: this invocation takes rows `c_start + sub + per i`, or, through
            // a page table, the blocks of ALONE_BLOCK_ROWS rows `sub + per i` (row r is in block
            // r / ALONE_BLOCK_ROWS), whose rows rarely cross a page. With one chunk (`per` 1) that
            // is every row of it in turn.
            line!(
                self,
                "    let c_start = p.lo + (chunk - sub) * p.chunk_len;"
            );
            line!(self, "    let lo_row = max(c_start, first);");
            line!(
                self,
                "    let end = min(min(p.visible, c_start + per * p.chunk_len), last + 1u);"
            );
            if k.rows == RowMode::Contiguous {
                line!(
                    self,
                    "    let start = lo_row + (sub + per - (lo_row - c_start) % per) % per;"
                );
            } else {
                line!(self, "    let b0 = lo_row / {ALONE_BLOCK_ROWS}u;");
                line!(
                    self,
                    "    let start = max(lo_row, (b0 + (sub + per - b0 % per) % per) * {ALONE_BLOCK_ROWS}u);"
                );
            }
        } else {
            line!(self, "    let c_start = p.lo + chunk * p.chunk_len;");
            line!(self, "    let start = max(c_start, first);");
            // Up to the last query's own row (`last` is the first query's).
            let seen = if qt > 1 { "nq" } else { "1u" };
            line!(
                self,
                "    let end = min(min(p.visible, c_start + p.chunk_len), last + {seen});"
            );
        }
        line!(
            self,
            "    let out0 = (chunk * p.q_count + local) * p.n_heads + h0;"
        );
        if k.sum == TeamSum::Alone {
            // An invocation that takes no row (a short sequence's chunks past its end) writes an
            // empty result, which the reduce skips, and loads no query (no barrier follows). One
            // that writes the output itself (`p.direct`, one chunk) goes on and writes zeros.
            line!(self, "    if start >= end && p.direct == 0u {{");
            for (_, _, h) in pairs() {
                line!(self, "        stats[2u * (out0 + {h}u)] = NEG;");
                line!(self, "        stats[2u * (out0 + {h}u) + 1u] = 0.0;");
            }
            line!(self, "        return;");
            line!(self, "    }}");
        }
        // The lane's query elements.
        for (s, q) in [(&a, "q_a"), (&b, "q_b")] {
            if s.vecs == 0 {
                continue;
            }
            let view = if q == "q_a" { "p.view_a" } else { "p.view_b" };
            line!(self, "    let {q}_se = {view}.w;");
            for (t, qq, h) in pairs() {
                let query = if qq == 0 {
                    "qi".to_string()
                } else {
                    format!("qi + {qq}u")
                };
                line!(
                    self,
                    "    let {q}{t}_base = view_at({view}, {query}, h0 + {h}u, 0u);"
                );
                for j in 0..s.steps() {
                    let names = s.parts(&format!("{q}{t}_"), j);
                    let guard = self.guard(s, j);
                    // A query the call does not have is left 0 (its results are not written).
                    let guard = if qq == 0 {
                        guard
                    } else {
                        format!("{qq}u < nq && {guard}")
                    };
                    let (parts, u) = (s.n_parts(), s.u());
                    for (c, name) in names.iter().enumerate() {
                        let e = |i: u32| -> String {
                            let i = parts * i + c as u32;
                            format!(
                                "{q}[{q}{t}_base + (({}) * {u}u + {i}u) * {q}_se]",
                                s.vec_of(j)
                            )
                        };
                        line!(self, "    var {name} = vec4<f32>(0.0);");
                        line!(
                            self,
                            "    if {guard} {{ {name} = vec4<f32>({}, {}, {}, {}); }}",
                            e(0),
                            e(1),
                            e(2),
                            e(3)
                        );
                    }
                }
            }
        }
        // Running max and sum per head and query, and the lane's accumulators.
        for (t, _, _) in pairs() {
            line!(self, "    var m{t} = NEG;");
            line!(self, "    var l{t} = 0.0;");
            for j in 0..v.steps() {
                for name in v.parts(&format!("o{t}_"), j) {
                    line!(self, "    var {name} = vec4<f32>(0.0);");
                }
            }
        }
        line!(self, "    let ua = kv * {}u + lane;", a.loads());
        line!(self, "    let ub = kv * {}u + lane;", b.loads());
        line!(self, "    let uv = kv * {}u + lane;", v.loads());
        // Row strides in vectors (narrow slots: in words), and, for the block types, the first
        // vector (narrow: word) of a row's scales, after its values.
        for s in [&a, &b, &v] {
            let (unit, values) = if s.narrow {
                (String::new(), s.words() * s.vecs)
            } else {
                (format!(" / {}u", s.load_words()), s.vecs)
            };
            line!(self, "    let rv{} = p.row_words_{}{unit};", s.slot, s.slot);
            if s.scales().is_some() {
                line!(self, "    let sv{} = p.n_kv * {values}u;", s.slot);
            }
        }
        if k.sum == TeamSum::Shared {
            line!(self, "    var par = 0u;");
        }
        if k.rows != RowMode::Contiguous {
            // A page's rows are consecutive in the pool: its table entry is read once, at its
            // first row, and the stored row is an offset from there (wrapping u32 arithmetic).
            line!(self, "    var page_next = start;");
            line!(self, "    var page_base = 0u;");
        }
        let step = match (k.sum, k.rows) {
            (TeamSum::Alone, RowMode::Contiguous) => "r += per".into(),
            // At the end of a block the invocation moves on to its next one, per - 1 blocks on.
            (TeamSum::Alone, _) => format!(
                "r = select(r + 1u, r + 1u + (per - 1u) * {ALONE_BLOCK_ROWS}u, (r + 1u) % {ALONE_BLOCK_ROWS}u == 0u)"
            ),
            _ if k.step_rows > 1 => format!("r += {}u", k.step_rows),
            _ => "r++".into(),
        };
        line!(self, "    for (var r = start; r < end; {step}) {{");
        self.row(&a, &b, &v);
        line!(self, "    }}");
        // Results: (max, sum) per head from lane 0, each lane's share of the unnormalised output
        // (normalised where it is the output: `p.direct`).
        // Pair t's results: query qq's are `qq * n_heads` after the first query's, and only
        // the queries the call has write theirs.
        let out = |qq: u32, h: u32| match qq {
            0 => format!("out0 + {h}u"),
            _ => format!("out0 + {qq}u * p.n_heads + {h}u"),
        };
        let has = |qq: u32| match qq {
            0 => String::new(),
            _ => format!("{qq}u < nq && "),
        };
        line!(self, "    if lane == 0u {{");
        for (t, qq, h) in pairs() {
            let o = out(qq, h);
            let (m, l) = (
                format!("stats[2u * ({o})] = m{t};"),
                format!("stats[2u * ({o}) + 1u] = l{t};"),
            );
            match qq {
                0 => {
                    line!(self, "        {m}");
                    line!(self, "        {l}");
                }
                _ => line!(self, "        if {qq}u < nq {{ {m} {l} }}"),
            }
        }
        line!(self, "    }}");
        for (t, qq, h) in pairs() {
            // Where this call's one chunk is the whole result (`p.direct`), the output itself, as
            // the reduce would write it (its one weight is exp(0) = 1): 0 where no row was seen.
            line!(
                self,
                "    let inv{t} = select(1.0, select(0.0, 1.0 / l{t}, l{t} > 0.0), p.direct != 0u);"
            );
            line!(self, "    let o{t}_base = ({}) * {}u;", out(qq, h), k.d_v);
            for j in 0..v.steps() {
                let guard = format!("{}{}", has(qq), self.guard(&v, j));
                // In vectors of 4: d_v and u are multiples of 4 in every streaming shape.
                let at = format!("(o{t}_base + ({}) * {}u) / 4u", v.vec_of(j), v.u());
                let names = v.parts(&format!("o{t}_"), j);
                let parts = v.n_parts();
                let mut body = String::new();
                // A scaled fp8 slot's values are its numbers times the scale: once, on the sums.
                let scale = if v.dtype.is_fp8() {
                    " * p.slot_scales.z"
                } else {
                    ""
                };
                let elem = |i: u32| {
                    let (name, c) = (&names[(i % parts) as usize], i / parts);
                    format!("{name}[{c}]{scale} * inv{t}")
                };
                for g in 0..v.u() / 4 {
                    let [e0, e1, e2, e3] = [0, 1, 2, 3].map(|i| elem(4 * g + i));
                    let _ = write!(
                        body,
                        "part[{at} + {g}u] = vec4<f32>({e0}, {e1}, {e2}, {e3}); "
                    );
                }
                line!(self, "    if {guard} {{ {body}}}");
            }
        }
        line!(self, "}}");
    }

    /// The condition under which this lane holds a vector in step `j` of slice `s`.
    fn guard(&self, s: &Slice, j: u32) -> String {
        match s.last_lanes() {
            Some(rem) if j + 1 == s.steps() => format!("lane < {rem}u"),
            _ => "true".into(),
        }
    }

    /// Exact conversions of 16-bit and quantized storage (the parts of a 16-byte vector), as the CPU
    /// twin decodes them: once for each storage type the slots read (their names say the type, so
    /// that K and V of different types each get theirs).
    fn unpack(&mut self, a: &Slice, b: &Slice, v: &Slice) {
        // 64-bit words split into 32-bit ones, low word first (little-endian, as stored).
        for s in [a, b, v] {
            if !s.wide || s.vecs == 0 || self.out.contains(&format!("fn words{}(", s.words())) {
                continue;
            }
            if s.words() == 2 {
                line!(
                    self,
                    "fn words2(w: u64) -> vec2<u32> {{ return vec2<u32>(u32(w), u32(w >> 32u)); }}"
                );
            } else {
                line!(
                    self,
                    "fn words4(w: vec2<u64>) -> vec4<u32> {{ return vec4<u32>(u32(w.x), u32(w.x >> 32u), u32(w.y), u32(w.y >> 32u)); }}"
                );
            }
        }
        let mut types: Vec<DType> = Vec::new();
        for s in [a, b, v] {
            if s.vecs > 0 && !types.contains(&s.dtype) {
                types.push(s.dtype);
            }
        }
        for dtype in types {
            self.unpack_type(dtype);
        }
        // A block's f16 scale: half `hi` of word `word` of a vector of scales (exact), once per
        // width of the scale vectors the slots read.
        for s in [a, b, v] {
            let Some((words, _)) = s.scales().filter(|_| s.vecs > 0) else {
                continue;
            };
            if self.out.contains(&format!("fn scale_of{words}(")) {
                continue;
            }
            line!(
                self,
                "fn scale_of{words}(s: {}, word: u32, hi: u32) -> f32 {{",
                words_type(words)
            );
            line!(self, "    let h = (s[word] >> (16u * hi)) & 0xffffu;");
            line!(self, "    return f16x4(vec4<u32>(h)).x;");
            line!(self, "}}");
        }
    }

    fn unpack_type(&mut self, dtype: DType) {
        match dtype {
            DType::F32 => {}
            // Their f16 scales (`scale_of`, in `unpack`).
            DType::Q8_0 | DType::Q4_0 => {
                self.rebias_x4("f16x4", 0x7fff, 13, 112, 0x400, 0x7c00, 15)
            }
            // Through the adapter's f16 conversion: two bytes of each word at once, as the halves
            // of two f16 codes.
            DType::F8E4M3 | DType::F8E5M2 if self.key.f16_unpack => self.fp8_halves(dtype),
            // e4m3: 0x7f (with either sign) is NaN. e5m2, the top byte of an f16: 0x7c is infinity,
            // 0x7d-0x7f NaN.
            DType::F8E4M3 => self.rebias_x4("e4m3x4", 0x7f, 20, 120, 8, 0x7f, 7),
            DType::F8E5M2 => self.rebias_x4("e5m2x4", 0x7f, 21, 112, 4, 0x7c, 7),
            DType::BF16 => {
                line!(
                    self,
                    "fn even_bf16(w: vec4<u32>) -> vec4<f32> {{ return bitcast<vec4<f32>>(w << vec4<u32>(16u)); }}"
                );
                line!(
                    self,
                    "fn odd_bf16(w: vec4<u32>) -> vec4<f32> {{ return bitcast<vec4<f32>>(w & vec4<u32>(0xffff0000u)); }}"
                );
            }
            // The adapter's conversion (no shader-f16 needed).
            DType::F16 if self.key.f16_unpack => {
                line!(self, "{}", f16_halves_fn("even_f16", "w", "x"));
                line!(self, "{}", f16_halves_fn("odd_f16", "w", "y"));
            }
            DType::F16 => {
                // Exact for every f16 (subnormals, infinities and NaN included), no shader-f16 needed.
                self.rebias_x4("f16x4", 0x7fff, 13, 112, 0x400, 0x7c00, 15);
                line!(
                    self,
                    "fn even_f16(w: vec4<u32>) -> vec4<f32> {{ return f16x4(w & vec4<u32>(0xffffu)); }}"
                );
                line!(
                    self,
                    "fn odd_f16(w: vec4<u32>) -> vec4<f32> {{ return f16x4(w >> vec4<u32>(16u)); }}"
                );
            }
        }
    }

    /// The fp8 functions of [`StreamKey::f16_unpack`]: `{e4m3,e5m2}_02(w)` and `_13(w)` turn bytes 0
    /// and 2 (1 and 3) of each of four words into two f16 codes per word, and `f16_lo` / `f16_hi`
    /// convert the low / high halves, so that byte c of the words is `f16_lo(_02(w))` for c = 0,
    /// `f16_lo(_13(w))` for 1, `f16_hi(_02(w))` for 2 and `f16_hi(_13(w))` for 3 ([`fp8_part`]).
    /// e5m2 is the top byte of an f16, infinities and NaN included. An e4m3 code's sign, exponent
    /// and mantissa go to f16's bits 15, 10-13 and 7-9: an f16 of 2^-8 times its value (exact,
    /// subnormals included: both formats' subnormals are their mantissa times the smallest
    /// normal's exponent), which [`fp8_part`] multiplies by 256; its NaN code (magnitude 0x7f, the
    /// one whose magnitude plus one reaches bit 7) also gets f16's top exponent bit, which makes it
    /// an f16 NaN.
    fn fp8_halves(&mut self, dtype: DType) {
        if !self.out.contains("fn f16_lo(") {
            line!(self, "{}", f16_halves_fn("f16_lo", "h", "x"));
            line!(self, "{}", f16_halves_fn("f16_hi", "h", "y"));
        }
        if dtype == DType::F8E5M2 {
            line!(
                self,
                "fn e5m2_02(w: vec4<u32>) -> vec4<u32> {{ return (w << vec4<u32>(8u)) & vec4<u32>(0xff00ff00u); }}"
            );
            line!(
                self,
                "fn e5m2_13(w: vec4<u32>) -> vec4<u32> {{ return w & vec4<u32>(0xff00ff00u); }}"
            );
            return;
        }
        line!(self, "fn e4m3_f16(x: vec4<u32>) -> vec4<u32> {{");
        line!(self, "    let m = x & vec4<u32>(0x007f007fu);");
        line!(
            self,
            "    let nan = (m + vec4<u32>(0x00010001u)) & vec4<u32>(0x00800080u);"
        );
        line!(
            self,
            "    return ((m | nan) << vec4<u32>(7u)) | ((x & vec4<u32>(0x00800080u)) << vec4<u32>(8u));"
        );
        line!(self, "}}");
        line!(
            self,
            "fn e4m3_02(w: vec4<u32>) -> vec4<u32> {{ return e4m3_f16(w); }}"
        );
        line!(
            self,
            "fn e4m3_13(w: vec4<u32>) -> vec4<u32> {{ return e4m3_f16(w >> vec4<u32>(8u)); }}"
        );
    }

    /// An exact unpacking of four small floats (f16 or fp8, one per component: sign at bit
    /// `sign_bit`, magnitude under `mask`) into f32. The magnitude's exponent and mantissa move to
    /// f32's places (mantissa at bit `shift`) and the exponent is rebiased by `rebias`; codes from
    /// `special` up (infinity, NaN) get the rebias twice, which lands them on f32's all-ones exponent.
    /// A subnormal code (below `normal`, mantissa m) comes out as 2^-e0 (1 + m) with e0 the smallest
    /// normal exponent, so 2 (x - 2^-e0) is its exact value. About a dozen operations per vector,
    /// against about twenty for the branches of a plain conversion; software adapters are bound by
    /// arithmetic, and there this made MLA over f16 and fp8 about a tenth faster.
    #[allow(clippy::too_many_arguments)]
    fn rebias_x4(
        &mut self,
        name: &str,
        mask: u32,
        shift: u32,
        rebias: u32,
        normal: u32,
        special: u32,
        sign_bit: u32,
    ) {
        // Once per kernel: f16 values and block scales share `f16x4`.
        if self.out.contains(&format!("fn {name}(")) {
            return;
        }
        // 2^-e0 as f32 bits: the rebiased exponent of a subnormal code, mantissa zero.
        let low = f64::from(f32::from_bits(rebias << 23));
        line!(self, "fn {name}(b: vec4<u32>) -> vec4<f32> {{");
        line!(self, "    let em = b & vec4<u32>({mask:#x}u);");
        line!(
            self,
            "    let x = bitcast<vec4<f32>>((em << vec4<u32>({shift}u)) + select(vec4<u32>({rebias}u << 23u), vec4<u32>({}u << 23u), em >= vec4<u32>({special:#x}u)));",
            2 * rebias
        );
        line!(
            self,
            "    let mag = select(x, (x - vec4<f32>({low:e})) * 2.0, em < vec4<u32>({normal:#x}u));"
        );
        line!(
            self,
            "    return bitcast<vec4<f32>>(bitcast<vec4<u32>>(mag) | ((b >> vec4<u32>({sign_bit}u)) << vec4<u32>(31u)));"
        );
        line!(self, "}}");
    }

    fn in_bounds(&mut self, a: &Slice, b: &Slice, v: &Slice) {
        let k = self.key;
        line!(
            self,
            "// Every index this dispatch can touch is inside its binding, and the call has the"
        );
        line!(
            self,
            "// shape this kernel was generated for; checked once, on uniform values."
        );
        line!(self, "fn in_bounds() -> bool {{");
        line!(self, "    let parts = p.n_chunks * p.q_count * p.n_heads;");
        line!(
            self,
            "    return p.d_a == {}u && p.d_b == {}u && p.d_v == {}u && p.group % HT == 0u && p.n_batches * HT == p.group",
            k.d_a,
            k.d_b,
            k.d_v
        );
        line!(
            self,
            "        && queries_fit(parts) && p.n_kv * p.group == p.n_heads"
        );
        if !k.soft_cap {
            line!(self, "        && !(p.soft_cap > 0.0)");
        }
        if k.kvs > 1 {
            // Whole groups of consecutive KV heads: the team's query heads are `h0 ..`.
            line!(self, "        && p.n_kv % KVS == 0u && p.n_batches == 1u");
        }
        if k.sum == TeamSum::Alone {
            line!(
                self,
                "        && (p.team_width == 1u || p.team_width == 2u || p.team_width == 4u || p.team_width == 8u)"
            );
        }
        line!(
            self,
            "        && p.q_count >= 1u && p.q_first < p.n_q && p.q_count <= p.n_q - p.q_first"
        );
        line!(
            self,
            "        && view_fits(p.view_a, p.n_q, p.n_heads, p.d_a, arrayLength(&q_a))"
        );
        line!(
            self,
            "        && view_fits(p.view_b, p.n_q, p.n_heads, p.d_b, arrayLength(&q_b))"
        );
        for s in [a, b, v] {
            let rw = format!("p.row_words_{}", s.slot);
            let uw = s.load_words();
            if s.narrow {
                // Words: the values, then one f16 scale per 32 elements.
                line!(
                    self,
                    "        && p.n_kv * {}u + (p.n_kv * {}u + 63u) / 64u <= {rw} && rows_fit({rw}, arrayLength(&slot_{}))",
                    s.words() * s.vecs,
                    s.vecs * s.u(),
                    s.slot
                );
                continue;
            }
            // The block types' scales follow the values: one vector per `per` value vectors.
            let scales = match s.scales() {
                Some((_, per)) => format!(" + (p.n_kv * {}u + {}u) / {per}u", s.vecs, per - 1),
                None => String::new(),
            };
            line!(
                self,
                "        && {rw} % {uw}u == 0u && p.n_kv * {}u{scales} <= {rw} / {uw}u && rows_fit({rw} / {uw}u, arrayLength(&slot_{}))",
                s.loads(),
                s.slot
            );
        }
        line!(
            self,
            "        && parts * 2u <= arrayLength(&stats) && parts * (p.d_v / 4u) <= arrayLength(&part);"
        );
        line!(self, "}}");
    }

    /// Row `row` (WGSL: `r` or `r + 1u`) of the chunk as `name`, its row in the slots: the row
    /// itself, or through the page table, whose entry is read once per page (where `guard`, a
    /// condition followed by `&&`, holds).
    fn stored_row(&mut self, name: &str, row: &str, guard: &str) {
        if self.key.rows == RowMode::Contiguous {
            line!(self, "        let {name} = {row};");
            return;
        }
        let operand = if row == "r" {
            row.to_string()
        } else {
            format!("({row})")
        };
        // (`>=`: one-invocation teams step over rows.)
        line!(self, "        if {guard}{row} >= page_next {{");
        line!(
            self,
            "            page_base = stored({row}, tb) - {operand};"
        );
        line!(
            self,
            "            page_next = ({operand} / p.page_size + 1u) * p.page_size;"
        );
        line!(self, "        }}");
        line!(self, "        let {name} = page_base + {row};");
    }

    /// The body of the row loop for row `r`: the lane's loads of the row, its partial dot products,
    /// their sums over the team, the online softmax (rescaling only when a head's maximum grows) and
    /// the values.
    fn row(&mut self, a: &Slice, b: &Slice, v: &Slice) {
        let k = self.key;
        self.stored_row("sr", "r", "");
        for i in 1..k.step_rows {
            // Row i of the iteration, where the chunk has one (uniform: every lane's `r` and
            // `end`). Its loads are guarded by `has{i}`, and its weights are 0 without it.
            line!(self, "        let has{i} = r + {i}u < end;");
            self.stored_row(
                &format!("sr{i}"),
                &format!("r + {i}u"),
                &format!("has{i} && "),
            );
        }
        let load = |g: &mut Gen, s: &Slice, base: &str, stride: &str, tag: &str, sr: &str| {
            // Row i > 0 of the iteration, `sr{i}`, is loaded only where the chunk has it.
            let row = sr.strip_prefix("sr").filter(|i| !i.is_empty());
            let has = row.map_or(String::new(), |i| format!(" && has{i}"));
            let narrow = s.narrow;
            // Scales shared by the team: when a scale vector covers whole steps of the team and
            // each head's row starts on one, step j's lanes all take scale vector
            // `base / per + j * lanes / per`, loaded once for the steps that share it.
            let shared_scales = s.scales().map(|(_, per)| per).filter(|&per| {
                !narrow && per.is_multiple_of(k.lanes) && s.vecs.is_multiple_of(per)
            });
            if let Some(per) = shared_scales {
                // Unguarded: without row i, the first row's scales (its values are not loaded).
                let rs = match row {
                    None => sr.to_string(),
                    Some(i) => format!("select(sr, sr{i}, has{i})"),
                };
                for c in 0..s.steps().div_ceil(per / k.lanes) {
                    line!(
                        g,
                        "        let sc{}{tag}_{c} = {};",
                        s.slot,
                        s.read(&format!(
                            "{rs} * {stride} + sv{} + {base} / {per}u + {c}u",
                            s.slot
                        ))
                    );
                }
            }
            if s.pair {
                // Not a block type: one load of 32 bytes takes steps j and j + 1.
                for j in (0..s.steps()).step_by(2) {
                    let names = [j, j + 1].map(|j| s.parts(&format!("x{}{tag}", s.slot), j));
                    for n in names.iter().flatten() {
                        line!(g, "        var {n} = vec4<f32>(0.0);");
                    }
                    let guard = format!("{}{has}", g.guard(s, j));
                    let at = format!("{sr} * {stride} + {base} + {}u", s.step_load(j));
                    line!(
                        g,
                        "        if {guard} {{ let w2 = slot_{}[{at}]; {}{}}}",
                        s.slot,
                        plain(s, &names[0], "words4(w2.xy)", "w0"),
                        plain(s, &names[1], "words4(w2.zw)", "w1")
                    );
                }
                return;
            }
            for j in 0..s.steps() {
                let guard = format!("{}{has}", g.guard(s, j));
                let names = s.parts(&format!("x{}{tag}", s.slot), j);
                for n in &names {
                    line!(g, "        var {n} = vec4<f32>(0.0);");
                }
                let at = format!("{sr} * {stride} + {base} + {}u", s.step_load(j));
                let src = format!("slot_{}", s.slot);
                if s.dtype.is_quantized() {
                    let vi = format!("({base} + {}u)", j * k.lanes);
                    // A narrow vector (8 elements): q8_0's two words, q4_0's one.
                    let mut body = if narrow && s.words() == 1 {
                        format!("let w = {src}[{sr} * {stride} + {vi}]; ")
                    } else if narrow {
                        format!(
                            "let i = {sr} * {stride} + {vi} * 2u; let w = vec2<u32>({src}[i], {src}[i + 1u]); "
                        )
                    } else {
                        format!("let w = {}; ", s.read(&at))
                    };
                    if let Some((uw, per)) = s.scales() {
                        // Value vector `vi` of the row lies in block `blk`, whose scale is half
                        // `hi` of scale word `sw` (counted from the row's first scale).
                        let blk = s.block_of(&vi);
                        let (sw, hi) = (format!("{blk} / 2u"), format!("{blk} % 2u"));
                        let scale = if narrow {
                            format!(
                                "scale_of{uw}({}({src}[{sr} * {stride} + sv{} + {sw}]), 0u, {hi})",
                                words_type(uw),
                                s.slot
                            )
                        } else if shared_scales.is_some() {
                            format!(
                                "scale_of{uw}(sc{}{tag}_{}, ({sw}) % {uw}u, {hi})",
                                s.slot,
                                j * k.lanes / per
                            )
                        } else {
                            format!(
                                "scale_of{uw}({}, ({sw}) % {uw}u, {hi})",
                                s.read(&format!("{sr} * {stride} + sv{} + {vi} / {per}u", s.slot))
                            )
                        };
                        let _ = write!(body, "let d = {scale}; ");
                    }
                    for (c, n) in names.iter().enumerate() {
                        let c = c as u32;
                        let part = match s.dtype {
                            // Narrow: elements c, 2 + c (word 0) and 4 + c, 6 + c (word 1).
                            DType::Q8_0 if narrow => format!(
                                "vec4<f32>(bitcast<vec4<i32>>(vec4<u32>(w.x, w.x, w.y, w.y) << vec4<u32>({}u, {}u, {}u, {}u)) >> vec4<u32>(24u)) * d",
                                24 - 8 * c,
                                8 - 8 * c,
                                24 - 8 * c,
                                8 - 8 * c
                            ),
                            // Narrow: elements c, 2 + c, 4 + c, 6 + c of the word.
                            DType::Q4_0 if narrow => format!(
                                "(vec4<f32>((vec4<u32>(w) >> vec4<u32>({}u, {}u, {}u, {}u)) & vec4<u32>(0xfu)) - vec4<f32>(8.0)) * d",
                                4 * c,
                                4 * c + 8,
                                4 * c + 16,
                                4 * c + 24
                            ),
                            DType::Q8_0 => format!(
                                "vec4<f32>(bitcast<vec4<i32>>(w << vec4<u32>({}u)) >> vec4<u32>(24u)) * d",
                                24 - 8 * c
                            ),
                            // Wide: elements c, 8 + c, 16 + c, 24 + c, nibble c of each word.
                            DType::Q4_0 if s.unit == WIDE_Q4 => format!(
                                "(vec4<f32>((w >> vec4<u32>({}u)) & vec4<u32>(0xfu)) - vec4<f32>(8.0)) * d",
                                4 * c
                            ),
                            // Elements c, 4 + c (word 0) and 8 + c, 12 + c (word 1).
                            DType::Q4_0 => format!(
                                "(vec4<f32>((vec4<u32>(w.x, w.x, w.y, w.y) >> vec4<u32>({}u, {}u, {}u, {}u)) & vec4<u32>(0xfu)) - vec4<f32>(8.0)) * d",
                                4 * c,
                                4 * c + 16,
                                4 * c,
                                4 * c + 16
                            ),
                            _ if k.f16_unpack => fp8_part(s.dtype, c),
                            DType::F8E5M2 => {
                                format!("e5m2x4((w >> vec4<u32>({}u)) & vec4<u32>(0xffu))", 8 * c)
                            }
                            _ => format!("e4m3x4((w >> vec4<u32>({}u)) & vec4<u32>(0xffu))", 8 * c),
                        };
                        let _ = write!(body, "{n} = {part}; ");
                    }
                    line!(g, "        if {guard} {{ {body}}}");
                } else {
                    line!(
                        g,
                        "        if {guard} {{ {}}}",
                        plain(s, &names, &s.read(&at), "w")
                    );
                }
            }
        };
        // Which of the iteration's rows each of the team's queries sees: its own row and those
        // before it, within its window (the first query's rows are `last` and before).
        // (A team of one query needs none: its rows end at its own.)
        let masked = if k.queries > 1 { k.queries } else { 0 };
        for qq in 0..masked {
            for i in 0..k.step_rows {
                let (row, x) = match i {
                    0 => ("r".to_string(), String::new()),
                    _ => (format!("(r + {i}u)"), format!("_{i}")),
                };
                // (A query the call does not have needs no mask: its results are not written.)
                let mut cond = Vec::new();
                if i > 0 {
                    cond.push(format!("has{i}"));
                }
                cond.push(format!("{row} <= last + {qq}u"));
                cond.push(format!(
                    "(p.window == 0u || last + {qq}u - {row} < p.window)"
                ));
                line!(self, "        let vq{qq}{x} = {};", cond.join(" && "));
            }
        }
        // A team of several KV heads takes each of them in turn.
        debug_assert!(k.kvs == 1 || k.sum == TeamSum::Subgroup, "{k:?}");
        for kk in 0..k.kvs {
            self.row_head(a, b, v, kk, &load);
        }
    }

    /// KV head `kk` of the team's part of the row body: the loads of its slices (its vectors from
    /// `ua + kk * vecs`, registers tagged `k{kk}_`), then its `heads` query heads. With
    /// [`StreamKey::step_rows`], of every row: row i's registers tagged `r{i}_` and its scalars
    /// suffixed `_{i}`, each query vector's and accumulator's products in adjacent statements.
    fn row_head(&mut self, a: &Slice, b: &Slice, v: &Slice, kk: u32, load: &LoadRow) {
        let k = self.key;
        // A one-invocation team holds whole rows: it loads the values after the scores, so that
        // the row's keys and values are not live at once (fewer registers, and a cold compile on
        // Mesa's GL took seconds less).
        let late_v = k.sum == TeamSum::Alone && !k.v_from_a;
        let tag = match kk {
            0 => String::new(),
            _ => format!("k{kk}_"),
        };
        // (row index, register tag, scalar suffix) of each row the iteration takes.
        let mut rows = vec![("sr".to_string(), tag.clone(), String::new())];
        for i in 1..k.step_rows {
            rows.push((format!("sr{i}"), format!("{tag}r{i}_"), format!("_{i}")));
        }
        let base = |u: &str, s: &Slice| match kk {
            0 => u.to_string(),
            _ => format!("({u} + {}u)", kk * s.loads()),
        };
        // The (pair, query) of each head of this KV head, for each of the team's queries.
        let heads: Vec<(u32, u32)> = k
            .pairs()
            .filter(|&(_, _, h)| h / k.heads == kk)
            .map(|(t, qq, _)| (t, qq))
            .collect();
        let load_v = |g: &mut Gen| {
            for (sr, tag, _) in &rows {
                load(g, v, &base("uv", v), "rvv", tag, sr);
            }
        };
        for (sr, tag, _) in &rows {
            load(self, a, &base("ua", a), "rva", tag, sr);
            load(self, b, &base("ub", b), "rvb", tag, sr);
        }
        if !k.v_from_a && !late_v {
            load_v(self);
        }
        for &(h, _) in &heads {
            let mut sums = vec![Vec::new(); rows.len()];
            for (s, q, c) in [(a, "q_a", "x"), (b, "q_b", "y")] {
                // Each row's products, in the same order.
                let terms: Vec<Vec<String>> = rows
                    .iter()
                    .map(|(_, tag, _)| {
                        let mut terms = Vec::new();
                        for j in 0..s.steps() {
                            let qs = s.parts(&format!("{q}{h}_"), j);
                            let xs = s.parts(&format!("x{}{tag}", s.slot), j);
                            for (qn, xn) in qs.iter().zip(&xs) {
                                terms.push(format!("dot({qn}, {xn})"));
                            }
                        }
                        terms
                    })
                    .collect();
                if terms[0].is_empty() {
                    continue;
                }
                // In statements of at most `TERMS` products, left to right as one sum: naga walks
                // an expression recursively, and a whole row's (144 products for MLA in f32 on
                // one-invocation teams) overflowed a debug build's thread stack. Several rows take
                // one product each per statement, alternating, so that a query vector's uses are
                // adjacent.
                let per = if k.step_rows > 1 { 1 } else { TERMS };
                let n = terms[0].len().div_ceil(per);
                for i in 0..n {
                    for (r, (_, _, x)) in rows.iter().enumerate() {
                        let t = format!("t{}{h}{x}", s.slot);
                        let part =
                            terms[r][i * per..((i + 1) * per).min(terms[r].len())].join(" + ");
                        if i == 0 {
                            line!(self, "        var {t} = {part};");
                        } else {
                            line!(self, "        {t} = {t} + {part};");
                        }
                    }
                }
                for (r, (_, _, x)) in rows.iter().enumerate() {
                    let t = format!("t{}{h}{x}", s.slot);
                    // fp8 numbers times the slot's scale are its values: the scale multiplies the
                    // sum.
                    if s.dtype.is_fp8() {
                        sums[r].push(format!("{t} * p.slot_scales.{c}"));
                    } else {
                        sums[r].push(t);
                    }
                }
            }
            for (r, (_, _, x)) in rows.iter().enumerate() {
                line!(self, "        var s{h}{x} = {};", sums[r].join(" + "));
            }
        }
        match k.sum {
            TeamSum::Subgroup => {
                for &(h, _) in &heads {
                    for (_, _, x) in &rows {
                        if k.shuffles {
                            debug_assert!(k.lanes.is_power_of_two(), "{k:?}");
                            let mut step = 1;
                            while step < k.lanes {
                                line!(
                                    self,
                                    "        s{h}{x} += subgroupShuffleXor(s{h}{x}, {step}u);"
                                );
                                step *= 2;
                            }
                        } else {
                            line!(self, "        s{h}{x} = subgroupAdd(s{h}{x});");
                        }
                    }
                }
            }
            TeamSum::Alone => {}
            TeamSum::Shared => {
                debug_assert!(k.step_rows == 1, "{k:?}");
                line!(self, "        let sb = par * {}u;", k.heads * k.lanes);
                for &(h, _) in &heads {
                    line!(self, "        sums[sb + {}u + lane] = s{h};", h * k.lanes);
                }
                line!(self, "        workgroupBarrier();");
                for &(h, _) in &heads {
                    let terms: Vec<String> = (0..k.lanes)
                        .map(|l| format!("sums[sb + {}u]", h * k.lanes + l))
                        .collect();
                    line!(self, "        s{h} = {};", terms.join(" + "));
                }
                line!(self, "        par ^= 1u;");
            }
        }
        let xv = |tag: &str| format!("{}{tag}", if k.v_from_a { "xa" } else { "xv" });
        for &(h, qq) in &heads {
            for (_, _, x) in &rows {
                line!(self, "        s{h}{x} *= p.scale;");
                if k.soft_cap {
                    line!(
                        self,
                        "        if p.soft_cap > 0.0 {{ s{h}{x} = p.soft_cap * tanh_safe(s{h}{x} / p.soft_cap); }}"
                    );
                }
            }
            // The iteration's largest score: row i's only where the chunk has it (and, for a team
            // of several queries, where the query sees it: `vq`, which holds `has` too).
            let masked = k.queries > 1;
            let seen = |i: u32| match (masked, i) {
                (true, 0) => format!("vq{qq}"),
                (true, _) => format!("vq{qq}_{i}"),
                (false, _) => format!("has{i}"),
            };
            let top = if k.step_rows > 1 || masked {
                if masked {
                    line!(self, "        var mx{h} = select(NEG, s{h}, {});", seen(0));
                } else {
                    line!(self, "        var mx{h} = s{h};");
                }
                for i in 1..k.step_rows {
                    line!(
                        self,
                        "        mx{h} = select(mx{h}, max(mx{h}, s{h}_{i}), {});",
                        seen(i)
                    );
                }
                format!("mx{h}")
            } else {
                format!("s{h}")
            };
            line!(self, "        if {top} > m{h} {{");
            line!(self, "            let c = exp(m{h} - {top});");
            line!(self, "            m{h} = {top};");
            line!(self, "            l{h} *= c;");
            for j in 0..v.steps() {
                for name in v.parts(&format!("o{h}_"), j) {
                    line!(self, "            {name} *= c;");
                }
            }
            line!(self, "        }}");
            if masked {
                // Exactly 0 for a row the query does not see.
                line!(
                    self,
                    "        let e{h} = select(0.0, exp(s{h} - m{h}), {});",
                    seen(0)
                );
            } else {
                line!(self, "        let e{h} = exp(s{h} - m{h});");
            }
            line!(self, "        l{h} += e{h};");
            for i in 1..k.step_rows {
                // Exactly 0 without row i, whose registers are then 0 too.
                line!(
                    self,
                    "        let e{h}_{i} = select(0.0, exp(s{h}_{i} - m{h}), {});",
                    seen(i)
                );
                line!(self, "        l{h} += e{h}_{i};");
            }
            if !late_v {
                self.accumulate(v, &rows, &xv, (h, qq));
            }
        }
        if late_v {
            load_v(self);
            for &(h, qq) in &heads {
                self.accumulate(v, &rows, &xv, (h, qq));
            }
        }
    }

    /// Pair `h`'s accumulators take the rows' values (`xv` of each row's tag) times their weights,
    /// each accumulator's products in adjacent statements. In a team of several queries, only the
    /// rows query `qq` sees (`vq`): a weight of 0 would not keep an infinite or NaN value of a row
    /// the query does not see out of its output (0 x inf is NaN), and the team has loaded that row
    /// for its other queries. One row per iteration: a branch, the same for the whole team; more:
    /// each row's value selected.
    fn accumulate(
        &mut self,
        v: &Slice,
        rows: &[(String, String, String)],
        xv: &dyn Fn(&str) -> String,
        (h, qq): (u32, u32),
    ) {
        let masked = self.key.queries > 1;
        let branch = masked && rows.len() == 1;
        if branch {
            line!(self, "        if vq{qq} {{");
        }
        for j in 0..v.steps() {
            let os = v.parts(&format!("o{h}_"), j);
            let xs: Vec<Vec<String>> = rows
                .iter()
                .map(|(_, tag, _)| v.parts(&xv(tag), j))
                .collect();
            for (i, o) in os.iter().enumerate() {
                for ((_, _, x), xs) in rows.iter().zip(&xs) {
                    let value = if masked && !branch {
                        format!("select(vec4<f32>(0.0), {}, vq{qq}{x})", xs[i])
                    } else {
                        xs[i].clone()
                    };
                    line!(self, "        {o} = fma(vec4<f32>(e{h}{x}), {value}, {o});");
                }
            }
        }
        if branch {
            line!(self, "        }}");
        }
    }
}

#[cfg(all(test, not(target_arch = "wasm32")))]
pub(super) mod tests {
    use super::*;
    use crate::attention::plan;
    use crate::kernels::wgsl::{PRELUDE, ROWS};

    /// naga parses and validates the kernel of `key`, or the test fails with its message.
    pub(crate) fn validate(key: &StreamKey) {
        let text = source(key, PRELUDE, ROWS);
        let module = naga::front::wgsl::parse_str(&text)
            .unwrap_or_else(|e| panic!("{key:?}: {}", e.emit_to_string(&text)));
        naga::valid::Validator::new(
            naga::valid::ValidationFlags::all(),
            naga::valid::Capabilities::all(),
        )
        .validate(&module)
        .unwrap_or_else(|e| panic!("{key:?}: {}", e.emit_to_string(&text)));
    }

    /// naga parses and validates every kernel the planner can ask for over a grid of shapes: both
    /// sums, every lane count and head batch within the planner's register budget, f32 and 16-bit
    /// storage, partial last steps, GQA and MLA.
    #[test]
    fn every_generated_kernel_validates() {
        let mut checked = 0;
        for dtype in DType::STORAGE {
            let u = per_vec(dtype) as u32;
            for (sum, lane_counts, most) in [
                (
                    TeamSum::Subgroup,
                    &[4, 8, 16, 32, 64][..],
                    plan::LANE_FLOATS,
                ),
                (TeamSum::Shared, &[4, 8, 16, 32, 64][..], plan::LANE_FLOATS),
                (TeamSum::Alone, &[1][..], plan::LANE_FLOATS_ALONE),
            ] {
                for &lanes in lane_counts {
                    for heads in [1, 2, 4, 8, 16] {
                        for (d_a, d_b, d_v, v_from_a) in [
                            (128, 0, 128, false),
                            (64, 0, 96, false),
                            (3 * u, 0, u, false),
                            (512, 64, 512, true),
                            (u, u, u, true),
                        ] {
                            let floats = lane_floats(
                                [dtype; 3],
                                lanes as usize,
                                heads as usize,
                                [d_a, d_b, d_v].map(|d| d as usize),
                                v_from_a,
                                1,
                            );
                            if floats > most {
                                continue;
                            }
                            // Slots read as words, for the block types at one lane count (the
                            // loads do not depend on it; validating every count took a minute).
                            // MLA's values are its latent (v narrow when a is).
                            let narrows: &[[bool; 3]] = match dtype.block() {
                                Some(_) if lanes <= 8 && v_from_a => {
                                    &[[false; 3], [false, true, false], [true, true, true]]
                                }
                                Some(_) if lanes <= 8 => {
                                    &[[false; 3], [true, true, false], [false, false, true]]
                                }
                                _ => &[[false; 3]],
                            };
                            for (rows, &narrow) in
                                [RowMode::Contiguous, RowMode::Paged, RowMode::Ragged]
                                    .into_iter()
                                    .flat_map(|r| narrows.iter().map(move |n| (r, n)))
                            {
                                let key = StreamKey {
                                    dtypes: [dtype; 3],
                                    lanes,
                                    heads,
                                    kvs: 1,
                                    d_a,
                                    d_b,
                                    d_v,
                                    v_from_a,
                                    soft_cap: rows == RowMode::Paged,
                                    step_rows: 1,
                                    queries: 1,
                                    // 64-bit loads for two of the three row modes.
                                    wide: rows != RowMode::Paged,
                                    sum,
                                    // Shuffled sums for two of the three, at every lane count.
                                    shuffles: sum == TeamSum::Subgroup
                                        && rows != RowMode::Contiguous,
                                    rows,
                                    f16_unpack: rows == RowMode::Ragged,
                                    narrow,
                                };
                                validate(&key);
                                checked += 1;
                            }
                        }
                    }
                }
            }
        }
        assert!(checked > 1900, "{checked} kernels");
    }

    /// Teams of several KV heads ([`StreamKey::kvs`]) for every storage type and row mode, with
    /// partial last steps, narrow rows and a block type's shared scale vectors among them.
    #[test]
    fn kernels_of_several_kv_heads_validate() {
        let mut checked = 0;
        for dtype in DType::STORAGE {
            for (kvs, heads, d_k, d_v) in [(2, 1, 128, 64), (4, 4, 128, 128), (8, 2, 96, 32)] {
                for (rows, wide) in [RowMode::Contiguous, RowMode::Paged, RowMode::Ragged]
                    .into_iter()
                    .flat_map(|r| [(r, false), (r, true)])
                {
                    let narrow = [dtype.block().is_some() && rows == RowMode::Ragged; 3];
                    let key = StreamKey {
                        dtypes: [dtype, DType::F32, dtype],
                        lanes: 8,
                        heads,
                        kvs,
                        d_a: d_k,
                        d_b: 0,
                        d_v,
                        v_from_a: false,
                        soft_cap: rows == RowMode::Contiguous,
                        step_rows: 1,
                        queries: 1,
                        wide,
                        sum: TeamSum::Subgroup,
                        shuffles: wide,
                        rows,
                        f16_unpack: wide,
                        narrow,
                    };
                    if (0..3).all(|i| [d_k, 0, d_v][i] % per_vec(key.dtypes[i]) as u32 == 0) {
                        validate(&key);
                        checked += 1;
                    }
                }
            }
        }
        assert!(checked >= 90, "{checked} kernels");
    }

    /// Shuffled sums ([`StreamKey::shuffles`]) take `log2(lanes)` steps of `subgroupShuffleXor` per
    /// score (masks 1, 2, 4, ...) and no `subgroupAdd`; the others one `subgroupAdd` each. Both
    /// validate.
    #[test]
    fn shuffled_sums_take_a_step_per_halving() {
        for (lanes, masks) in [(8, &[1, 2, 4][..]), (32, &[1, 2, 4, 8, 16][..])] {
            for (heads, step_rows) in [(4, 1), (2, 2)] {
                for shuffles in [false, true] {
                    let key = StreamKey {
                        dtypes: [DType::F32; 3],
                        lanes,
                        heads,
                        kvs: 1,
                        d_a: 128,
                        d_b: 0,
                        d_v: 128,
                        v_from_a: false,
                        soft_cap: false,
                        step_rows,
                        queries: 1,
                        wide: false,
                        sum: TeamSum::Subgroup,
                        shuffles,
                        rows: RowMode::Contiguous,
                        f16_unpack: false,
                        narrow: [false; 3],
                    };
                    let text = source(&key, PRELUDE, ROWS);
                    let scores = (heads * step_rows) as usize;
                    let (adds, xors) = (
                        text.matches("subgroupAdd(").count(),
                        text.matches("subgroupShuffleXor(").count(),
                    );
                    if shuffles {
                        assert_eq!((adds, xors), (0, scores * masks.len()), "{key:?}");
                        for mask in masks {
                            let step = format!("s0 += subgroupShuffleXor(s0, {mask}u);");
                            assert!(text.contains(&step), "{key:?}: no `{step}`");
                        }
                    } else {
                        assert_eq!((adds, xors), (scores, 0), "{key:?}");
                    }
                    validate(&key);
                }
            }
        }
    }

    /// 64-bit kernels take two steps per load where an f32 or 16-bit slice has whole pairs of them
    /// (the slot bound as `vec4<u64>`), and one step per load where it has not, or holds a block or
    /// fp8 type; 32-bit kernels load no 64-bit word. Every one validates.
    #[test]
    fn whole_pairs_of_steps_take_one_load() {
        let key = |dtype, d, wide| StreamKey {
            dtypes: [dtype; 3],
            lanes: 8,
            heads: 4,
            kvs: 1,
            d_a: d,
            d_b: 0,
            d_v: d,
            v_from_a: false,
            soft_cap: false,
            step_rows: 1,
            queries: 1,
            wide,
            sum: TeamSum::Subgroup,
            shuffles: wide,
            rows: RowMode::Contiguous,
            f16_unpack: false,
            narrow: [false; 3],
        };
        // (storage, head size, the slots' binding in 64-bit words): steps of 8 lanes.
        for (dtype, d, binding) in [
            (DType::F32, 128, "vec4<u64>"), // 32 vectors: two pairs of steps
            (DType::F32, 64, "vec4<u64>"),  // one pair
            (DType::F32, 32, "vec2<u64>"),  // one step
            (DType::F32, 96, "vec2<u64>"),  // three steps
            (DType::F16, 128, "vec4<u64>"),
            (DType::BF16, 256, "vec4<u64>"),
            (DType::F16, 64, "vec2<u64>"),
            (DType::Q8_0, 256, "vec2<u64>"),
            (DType::F8E4M3, 256, "vec2<u64>"),
            (DType::Q4_0, 256, "vec2<u64>"),
        ] {
            let wide = key(dtype, d, true);
            let text = source(&wide, PRELUDE, ROWS);
            for slot in ["a", "v"] {
                let decl = format!("var<storage, read> slot_{slot}: array<{binding}>;");
                assert!(text.contains(&decl), "{wide:?}: no `{decl}`");
            }
            validate(&wide);
            let narrow = key(dtype, d, false);
            assert!(
                !source(&narrow, PRELUDE, ROWS).contains("u64"),
                "{narrow:?}"
            );
            validate(&narrow);
        }
    }

    /// Kernels that take several rows per iteration ([`StreamKey::step_rows`]): MLA as the planner
    /// asks for it on CPU adapters (8 heads, within its budget, four rows) and with two rows, GQA
    /// with teams of several KV heads (two rows), and GQA in GPU teams (one KV head, 32 lanes) of
    /// four rows, the generator's general case, for every storage type and row mode, narrow rows, shared scale
    /// vectors and the cap among them.
    #[test]
    fn kernels_of_several_rows_validate() {
        let mut checked = 0;
        for dtype in DType::STORAGE {
            let u = per_vec(dtype) as u32;
            for (kvs, heads, d_a, d_b, d_v, v_from_a, lanes, step_rows) in [
                (1, 8, 512, 64, 512, true, 8, 4),
                (1, 2, u, u, u, true, 8, 2),
                (4, 4, 128, 0, 128, false, 8, 2),
                (2, 1, 3 * u, 0, u, false, 8, 2),
                (1, 4, 128, 0, 128, false, 32, 4),
            ] {
                let dims = [d_a, d_b, d_v].map(|d| d as usize);
                let floats = lane_floats(
                    [dtype; 3],
                    lanes as usize,
                    heads as usize,
                    dims,
                    v_from_a,
                    step_rows as usize,
                );
                assert!(
                    floats * kvs as usize <= plan::LANE_FLOATS_MLA_CPU,
                    "{floats}"
                );
                for (rows, wide) in [RowMode::Contiguous, RowMode::Paged, RowMode::Ragged]
                    .into_iter()
                    .flat_map(|r| [(r, false), (r, true)])
                {
                    let narrow = [dtype.block().is_some() && rows == RowMode::Ragged; 3];
                    let key = StreamKey {
                        dtypes: [dtype; 3],
                        lanes,
                        heads,
                        kvs,
                        d_a,
                        d_b,
                        d_v,
                        v_from_a,
                        soft_cap: rows != RowMode::Contiguous,
                        step_rows,
                        queries: 1,
                        wide,
                        sum: TeamSum::Subgroup,
                        shuffles: wide,
                        rows,
                        f16_unpack: !wide,
                        narrow,
                    };
                    validate(&key);
                    checked += 1;
                }
            }
        }
        assert_eq!(checked, 210);
    }

    /// Teams of several queries ([`StreamKey::queries`], subgroup sums) for every storage type,
    /// both row modes they serve, one, two and four rows per iteration (MLA), narrow rows and the cap
    /// among them; each leaves out the values of rows a query does not see, and the same key with
    /// one query per team has no mask.
    #[test]
    fn kernels_of_several_queries_validate() {
        let mut checked = 0;
        for dtype in DType::STORAGE {
            let u = per_vec(dtype) as u32;
            for (queries, heads, d_a, d_b, d_v, v_from_a, step_rows) in [
                (4, 4, 128, 0, 128, false, 1),
                (8, 1, 3 * u, 0, u, false, 1),
                (8, 2, 64, 0, 32, false, 1),
                (4, 4, u, u, u, true, 2),
                (4, 4, u, u, u, true, 4),
            ] {
                for (rows, wide) in [RowMode::Contiguous, RowMode::Paged]
                    .into_iter()
                    .flat_map(|r| [(r, false), (r, true)])
                {
                    if (0..3).any(|i| [d_a, d_b, d_v][i] % per_vec(dtype) as u32 != 0) {
                        continue;
                    }
                    let narrow = [dtype.block().is_some() && rows == RowMode::Paged; 3];
                    let key = StreamKey {
                        dtypes: [dtype; 3],
                        lanes: 8,
                        heads,
                        kvs: 1,
                        d_a,
                        d_b,
                        d_v,
                        v_from_a,
                        soft_cap: wide,
                        step_rows,
                        queries,
                        wide,
                        sum: TeamSum::Subgroup,
                        shuffles: wide,
                        rows,
                        f16_unpack: !wide,
                        narrow,
                    };
                    let text = source(&key, PRELUDE, ROWS);
                    assert!(
                        text.contains(&format!("const QT: u32 = {queries}u;")),
                        "{key:?}"
                    );
                    // Values of rows a query does not see are left out, not weighted by 0.
                    let left_out = match key.step_rows {
                        1 => "if vq0 {",
                        _ => "select(vec4<f32>(0.0), ",
                    };
                    assert!(text.contains(left_out), "{key:?}");
                    // One query per team: no masks.
                    let single = source(&StreamKey { queries: 1, ..key }, PRELUDE, ROWS);
                    assert!(!single.contains("vq0") && !single.contains("QT"), "{key:?}");
                    validate(&key);
                    checked += 1;
                }
            }
        }
        assert_eq!(checked, 140);
    }

    /// Slots of different types side by side: each type's unpacking is declared once (f16 and bf16,
    /// q8_0's 16-byte and q4_0's 8-byte scale vectors together), and vectors of different widths
    /// share the lanes.
    #[test]
    fn kernels_of_mixed_storage_validate() {
        use DType::*;
        let mut checked = 0;
        for dtypes in [
            [Q8_0, Q8_0, Q4_0],
            [Q4_0, Q4_0, Q8_0],
            [F16, F16, BF16],
            [BF16, BF16, F8E4M3],
            [F32, F32, Q4_0],
            [F8E4M3, F8E4M3, F16],
            [Q4_0, F16, Q4_0],
            [BF16, F8E4M3, BF16],
            [F8E5M2, F8E5M2, F8E4M3],
            [Q4_0, F8E5M2, Q4_0],
            [Q8_0, Q4_0, Q8_0],
            [F32, Q8_0, F32],
        ] {
            let mla = dtypes[0] == dtypes[2] && dtypes[1] != dtypes[0];
            let (d_a, d_b, d_v) = if mla { (512, 64, 512) } else { (128, 0, 64) };
            for sum in [TeamSum::Subgroup, TeamSum::Shared, TeamSum::Alone] {
                for (rows, wide) in [RowMode::Contiguous, RowMode::Ragged]
                    .into_iter()
                    .flat_map(|r| [(r, false), (r, true)])
                {
                    let narrow = dtypes.map(|t| t.block().is_some() && rows == RowMode::Ragged);
                    let key = StreamKey {
                        dtypes,
                        lanes: if sum == TeamSum::Alone { 1 } else { 8 },
                        heads: 2,
                        kvs: 1,
                        d_a,
                        d_b,
                        d_v,
                        v_from_a: mla,
                        soft_cap: false,
                        // As the planner asks on CPU adapters.
                        step_rows: if mla && sum == TeamSum::Subgroup {
                            4
                        } else {
                            1
                        },
                        queries: 1,
                        wide,
                        sum,
                        shuffles: sum == TeamSum::Subgroup && wide,
                        rows,
                        f16_unpack: sum == TeamSum::Subgroup && !wide,
                        narrow,
                    };
                    validate(&key);
                    checked += 1;
                }
            }
        }
        assert_eq!(checked, 144);
    }
}
