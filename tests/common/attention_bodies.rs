//! GQA / MHA and MLA attention on the GPU against the plain-Rust twins in `kvgpu::reference`, for
//! every storage type: one async body per scenario, run natively by `tests/attention.rs` and in the
//! browser by `tests/web.rs`. Outputs are held to [`TOL`](super::TOL): the twins read back the values
//! the cache actually stores (or an independent CPU model of them), so 16-bit storage is compared
//! exactly like f32.

use super::{
    append_both, append_random, assert_close, cache_on, f32_buffer, output, read_f32, values,
};
use kvgpu::reference::{self, CpuCache};
use kvgpu::wgpu;
use kvgpu::*;

/// A one-layer cache with `visible` rows: `visible - n_q` committed, then `n_q` appended this step.
fn filled(
    g: &Gpu,
    layer: LayerSpec,
    dtype: DType,
    visible: usize,
    n_q: usize,
    seed: u64,
) -> KvCache {
    let mut c = cache_on(
        g,
        CacheSpec::new(vec![layer], dtype, visible.max(8)).unwrap(),
    );
    if visible > n_q {
        append_random(&mut c, 0, visible - n_q, seed);
        c.advance(visible - n_q).unwrap();
    }
    append_random(&mut c, 0, n_q, seed + 1);
    assert_eq!(c.visible(0).unwrap(), visible);
    c
}

/// Every pass-1 kernel this adapter can run: the tiled kernel and the streaming kernel with lanes
/// summing through workgroup memory or teams of one invocation everywhere, the streaming kernel
/// summing across subgroups where the device has subgroups of one size. Lavapipe has them
/// (subgroups of 8), so the Vulkan run of CI always tests all four; OpenGL and the browser (wgpu's
/// WebGPU backend does not offer subgroups) have none, which is said, and the refusal is tested.
pub fn kernels(g: &Gpu) -> Vec<KernelChoice> {
    let info = g.adapter.get_info();
    let subgroups = g.device.features().contains(wgpu::Features::SUBGROUP)
        && info.subgroup_min_size == info.subgroup_max_size;
    if info.backend == wgpu::Backend::Vulkan && info.name.contains("llvmpipe") {
        assert!(subgroups, "lavapipe offers subgroups of 8: {info:?}");
    }
    let mut all = vec![
        KernelChoice::Tiled,
        KernelChoice::StreamShared,
        KernelChoice::StreamAlone,
    ];
    if subgroups {
        all.push(KernelChoice::StreamSubgroup);
    } else {
        super::skipped(&format!(
            "KernelChoice::StreamSubgroup ({:?} has no subgroups of one size); its refusal is \
             tested instead",
            info.backend
        ));
    }
    all
}

/// The streaming kernels among `kernels` (all but the tiled one).
fn streaming_of(kernels: &[KernelChoice]) -> Vec<KernelChoice> {
    kernels
        .iter()
        .copied()
        .filter(|&k| k != KernelChoice::Tiled)
        .collect()
}

/// Whether the streaming kernels take `layer` of `spec`: every slot's innermost dimension whole
/// vectors of its storage (4 f32, 8 16-bit, 16 q8_0, q4_0 or fp8 elements) and rows of whole vectors
/// (q8_0 and q4_0 rows, whose scales may end inside one, are read as words then).
pub fn streamable_layer(spec: &CacheSpec, layer: usize) -> bool {
    spec.layers()[layer]
        .slots
        .iter()
        .enumerate()
        .all(|(s, slot)| {
            let dtype = spec.slot_dtype(layer, s).unwrap();
            let per_vec = match dtype {
                DType::F32 => 4,
                DType::Q8_0 | DType::F8E4M3 | DType::F8E5M2 | DType::Q4_0 => 16,
                _ => 8,
            };
            slot.trailing.last().is_some_and(|d| d % per_vec == 0)
                && (dtype.block().is_some() || spec.row_bytes(layer, s).is_ok_and(|b| b % 16 == 0))
        })
}

/// Registers one invocation of the one-invocation-team kernel may hold: the planner's budget
/// (`LANE_FLOATS_ALONE` in src/attention/plan.rs), mirrored here so the tests know which shapes
/// [`KernelChoice::StreamAlone`] refuses.
const ALONE_FLOATS: usize = 800;

/// Whether a forced `kernel` takes `layer` of `spec` (the streaming kernels: whole vectors; the
/// one-invocation teams also one head's queries, outputs and row within [`ALONE_FLOATS`]).
pub fn kernel_takes(kernel: KernelChoice, spec: &CacheSpec, layer: usize) -> bool {
    if kernel == KernelChoice::Tiled || kernel == KernelChoice::Auto {
        return true;
    }
    if !streamable_layer(spec, layer) {
        return false;
    }
    let slots = &spec.layers()[layer].slots;
    if slots.len() < 2 {
        return true;
    }
    let d = |i: usize| slots[i].trailing.last().copied().unwrap_or(0);
    let floats = if slots[0].name == "compressed_kv" {
        // MLA: queries and outputs over the latent and rope key, the row once.
        (2 * d(0) + d(1)) + (d(0) + d(1))
    } else {
        2 * (d(0) + d(1))
    };
    kernel != KernelChoice::StreamAlone || floats <= ALONE_FLOATS
}

/// `layer` with its first two slots (K and V, or MLA's latent and rope key) stored as `types`.
pub fn stored_as(mut layer: LayerSpec, types: [DType; 2]) -> LayerSpec {
    for (slot, dtype) in layer.slots.iter_mut().zip(types) {
        slot.dtype = Some(dtype);
    }
    layer
}

/// K and V storage for case `i` of a test over `types`: each type for both, but f16 and bf16, where
/// both are asked for, in one layer, one as K and the other as V, swapped from case to case. The
/// two differ only in how a vector is unpacked, so over a test's cases each is read both ways, with
/// half the kernels of a layer per type (on a cold OpenGL cache every kernel costs seconds).
pub fn storage_pairs(types: &[DType], i: usize) -> Vec<[DType; 2]> {
    use DType::{BF16, F16};
    let both = types.contains(&F16) && types.contains(&BF16);
    let mixed = if i.is_multiple_of(2) {
        [F16, BF16]
    } else {
        [BF16, F16]
    };
    types
        .iter()
        .filter_map(|&t| match t {
            F16 if both => Some(mixed),
            BF16 if both => None,
            t => Some([t, t]),
        })
        .collect()
}

/// Whether one call under `att`'s kernel ran: a forced streaming kernel refuses a shape it cannot
/// take, which is asserted to be that refusal, with nothing written.
async fn ran(
    g: &Gpu,
    result: Result<()>,
    att: &Attention,
    c: &KvCache,
    out: &wgpu::Buffer,
) -> bool {
    if !kernel_takes(att.kernel(), c.spec(), 0) {
        let e = result.unwrap_err();
        assert!(
            matches!(
                &e,
                Error::AttentionRequest {
                    problem: AttentionProblem::DeviceLimit {
                        limit: AttentionLimit::Kernel,
                        ..
                    },
                    ..
                }
            ),
            "{e}"
        );
        let untouched = read_f32(g, out).await.iter().all(|&x| x == -7.0);
        assert!(untouched, "a refused call wrote");
        return false;
    }
    result.unwrap();
    true
}

#[derive(Clone, Copy, Debug)]
struct Gqa {
    n_kv: usize,
    group: usize,
    d_k: usize,
    d_v: usize,
    visible: usize,
    n_q: usize,
    window: Option<usize>,
    soft_cap: Option<f32>,
}

/// Runs one GQA case on the GPU and against the twin; returns the worst scaled error.
async fn check_gqa(g: &Gpu, att: &mut Attention, case: Gqa, types: [DType; 2], seed: u64) -> f32 {
    let layer = stored_as(LayerSpec::kv(case.n_kv, case.d_k, case.d_v), types);
    check_gqa_in(g, att, case, layer, seed).await
}

/// The storage of a layer's slots, for messages: `[(type, scale)]`.
fn storage_of(layer: &LayerSpec) -> Vec<(Option<DType>, Option<f32>)> {
    layer.slots.iter().map(|s| (s.dtype, s.scale)).collect()
}

/// [`check_gqa`] over `layer` (K and V of `case`'s shapes, stored as their specs say).
async fn check_gqa_in(g: &Gpu, att: &mut Attention, case: Gqa, layer: LayerSpec, seed: u64) -> f32 {
    let types = storage_of(&layer);
    let dtype = layer.slots[0].dtype.unwrap_or(DType::F32);
    let c = filled(g, layer, dtype, case.visible, case.n_q, seed);
    let n_heads = case.n_kv * case.group;
    let q = values(seed + 99, case.n_q * n_heads * case.d_k);
    let qb = f32_buffer(&g.device, &q).await;
    let out = output(&g.device, case.n_q * n_heads * case.d_v).await;
    let options = AttentionOptions {
        window: case.window,
        soft_cap: case.soft_cap,
        scale: None,
    };
    let result = att.gqa(
        &c,
        0,
        Queries::new(&qb, case.n_q, n_heads, case.d_k),
        &out,
        &options,
    );
    if !ran(g, result, att, &c, &out).await {
        return 0.0;
    }
    let want = reference::attention_gqa(
        &q,
        [case.n_q, n_heads, case.d_k],
        &c.read_f32_async(0, 0).await.unwrap(),
        &c.read_f32_async(0, 1).await.unwrap(),
        case.n_kv,
        case.d_v,
        &options,
    );
    assert_close(
        &read_f32(g, &out).await,
        &want,
        &format!("{types:?} {case:?} {:?}", att.kernel()),
    )
}

pub async fn gqa_matches_the_reference_for_every_dtype(g: &Gpu) {
    let mut att = Attention::with_kernels(super::kernels_for(g));
    #[rustfmt::skip]
    let cases = [
        // MHA, a single visible row.
        Gqa { n_kv: 2, group: 1, d_k: 64, d_v: 64, visible: 1, n_q: 1, window: None, soft_cap: None },
        // d_v differs from d_k.
        Gqa { n_kv: 2, group: 4, d_k: 128, d_v: 64, visible: 2, n_q: 1, window: None, soft_cap: None },
        Gqa { n_kv: 1, group: 8, d_k: 128, d_v: 128, visible: 63, n_q: 7, window: None, soft_cap: Some(30.0) },
        Gqa { n_kv: 2, group: 4, d_k: 128, d_v: 128, visible: 64, n_q: 1, window: Some(16), soft_cap: None },
        Gqa { n_kv: 4, group: 1, d_k: 64, d_v: 64, visible: 65, n_q: 7, window: Some(32), soft_cap: Some(20.0) },
        Gqa { n_kv: 2, group: 4, d_k: 128, d_v: 128, visible: 1000, n_q: 7, window: None, soft_cap: None },
        // A group wider than one workgroup's 16 heads.
        Gqa { n_kv: 1, group: 20, d_k: 64, d_v: 64, visible: 100, n_q: 2, window: None, soft_cap: Some(5.0) },
        // Odd head dims: 16-bit heads that start in the middle of a word.
        Gqa { n_kv: 3, group: 2, d_k: 33, d_v: 17, visible: 70, n_q: 3, window: Some(9), soft_cap: None },
        // Enough workgroups per chunk that one chunk holds tiles of 8 rows per invocation, the last tile
        // partial (on CPU adapters), with a window and with odd 16-bit dims.
        Gqa { n_kv: 8, group: 4, d_k: 64, d_v: 64, visible: 600, n_q: 2, window: Some(550), soft_cap: None },
        Gqa { n_kv: 8, group: 2, d_k: 33, d_v: 17, visible: 700, n_q: 3, window: None, soft_cap: Some(30.0) },
        // The window's ends: each query's own row alone, and a window past every row (cases 4 and 3
        // otherwise, and their storage).
        Gqa { n_kv: 4, group: 1, d_k: 64, d_v: 64, visible: 65, n_q: 7, window: Some(1), soft_cap: Some(20.0) },
        Gqa { n_kv: 2, group: 4, d_k: 128, d_v: 128, visible: 64, n_q: 1, window: Some(100_000), soft_cap: None },
    ];
    for kernel in kernels(g) {
        att.set_kernel(kernel);
        // f32, and f16 with bf16 (see `storage_pairs`).
        let mut worst = [0f32; 2];
        for (i, &case) in cases.iter().enumerate() {
            for (w, types) in worst.iter_mut().zip(storage_pairs(&DType::ALL, i)) {
                *w = w.max(check_gqa(g, &mut att, case, types, 10 + i as u64).await);
            }
        }
        let [w32, w16] = worst;
        note!("{kernel:?}: worst scaled error {w32:e} (f32), {w16:e} (f16 and bf16)");
    }
    gqa_prefill_and_decode_match_an_independent_model(g).await;
}

/// The plans a GPU gets (grids of 1,024-4,096 workgroups, 32-lane teams summing through workgroup
/// memory, GQA's subgroup teams two rows per iteration, the split reduce of 256 invocations per
/// head and 32 output elements), run here on whatever adapter the suite has: GQA and MLA over
/// several chunks, with window and soft-cap, every kernel, f32 and f16, against the twins; then GQA
/// in f32 under the least and the largest workgroup targets an app can set, the largest also over
/// more chunks than the reduce has invocations.
pub async fn gpu_plans_match_the_reference(g: &Gpu) {
    let mut att = Attention::with_kernels(super::kernels_for(g));
    att.plan_as_for_a_gpu(true);
    let mla_types = [DType::F32, DType::F16];
    check_kernels(
        g,
        &mut att,
        &kernels(g),
        &PLAN_CASES,
        &DType::ALL,
        PLAN_MLA,
        &mla_types,
        70,
        "as for a GPU",
    )
    .await;
    // Heads of 80 (as Phi-2's): the GPU merge's last block of 32 output elements is a partial one.
    // Values of 17 elements (`gqa_matches`' case 7, over 4 chunks), which the merge cannot read in
    // 16-byte vectors. Groups of 6 heads, in 3 head batches. On the tiled kernel alone (a
    // streaming kernel compiles one per shape: seconds on a cold OpenGL).
    let heads_of_80 = Gqa {
        d_k: 80,
        d_v: 80,
        ..PLAN_CASES[0]
    };
    #[rustfmt::skip]
    let values_of_17 = Gqa { n_kv: 3, group: 2, d_k: 33, d_v: 17, visible: 200, n_q: 3, window: None, soft_cap: None };
    // Groups of 6 query heads: the tiled kernel's workgroups take 2 of them, 3 per KV head.
    #[rustfmt::skip]
    let groups_of_6 = Gqa { n_kv: 2, group: 6, d_k: 64, d_v: 64, visible: 100, n_q: 2, window: None, soft_cap: None };
    check_kernels(
        g,
        &mut att,
        &[KernelChoice::Tiled],
        &[heads_of_80, values_of_17, groups_of_6],
        &[DType::F32],
        PLAN_MLA,
        &[],
        75,
        "as for a GPU, heads of 80",
    )
    .await;
    // An app's workgroup targets, GQA in f32: more than any call can take (chunks of the fewest
    // rows) on every kernel, and one workgroup per team (chunks as long as the loop budget allows)
    // on the streaming kernels. (The tiled kernel takes more rows per invocation for longer chunks:
    // that would be variants no other test here compiles, seconds each on a cold OpenGL. MLA's
    // chunks are planned by the same code, checked for every target by the unit tests.)
    let all = kernels(g);
    let streaming = streaming_of(&all);
    // At the largest target a longer call too, whose 16-row chunks outnumber the GPU reduce's 256
    // invocations, so that each takes several for the (max, sum).
    let mut long_cases = PLAN_CASES.to_vec();
    long_cases.push(Gqa {
        visible: 4500,
        ..PLAN_CASES[0]
    });
    for (target, kernels, cases) in [
        (usize::MAX, &all, &long_cases[..]),
        (1, &streaming, &PLAN_CASES[..]),
    ] {
        att.set_target_workgroups(std::num::NonZeroUsize::new(target));
        let what = format!("as for a GPU, aiming for {target} workgroups");
        let f32 = [DType::F32];
        check_kernels(g, &mut att, kernels, cases, &f32, PLAN_MLA, &[], 80, &what).await;
    }
}

/// [`gpu_plans_match_the_reference`]'s calls over q8_0, q4_0 and fp8 storage (run with the quantized
/// suite): the plans a real GPU takes for them, every kernel of the adapter, GQA and DeepSeek's MLA,
/// against the twins. Real GPUs ran them only on the H200 visits before.
pub async fn quantized_gpu_plans_match_the_reference(g: &Gpu) {
    let mut att = Attention::with_kernels(super::kernels_for(g));
    att.plan_as_for_a_gpu(true);
    check_kernels(
        g,
        &mut att,
        &kernels(g),
        &PLAN_CASES,
        &DType::QUANTIZED,
        PLAN_MLA,
        &DType::QUANTIZED,
        70,
        "quantized, as for a GPU",
    )
    .await;
}

/// One query buffer and one output view over two calls, on every kernel of a fresh `Attention`: a
/// window of one row (one chunk), then the whole context in as many chunks as it takes, whose
/// partial results need a larger scratch. The second call's bind groups, cached for the same views
/// by the first, must bind the grown scratch (an output at element 1 is never written in place).
pub async fn views_bound_before_the_scratch_grew_are_bound_again(g: &Gpu) {
    let (n_kv, group, d) = (2, 4, 128);
    let n_heads = n_kv * group;
    let c = filled(g, LayerSpec::kv(n_kv, d, d), DType::F32, 1000, 1, 21);
    let (k, v) = (
        c.read_f32_async(0, 0).await.unwrap(),
        c.read_f32_async(0, 1).await.unwrap(),
    );
    let q = values(22, n_heads * d);
    let qb = f32_buffer(&g.device, &q).await;
    let out = output(&g.device, 1 + n_heads * d).await;
    for kernel in kernels(g) {
        let mut att = Attention::with_kernels(super::kernels_for(g));
        att.set_kernel(kernel);
        att.set_target_workgroups(std::num::NonZeroUsize::new(usize::MAX));
        let mut scratch = 0;
        for window in [Some(1), None] {
            let options = AttentionOptions {
                window,
                ..AttentionOptions::default()
            };
            let queries = Queries::new(&qb, 1, n_heads, d);
            att.gqa(&c, 0, queries, Output::new(&out).at(1), &options)
                .unwrap();
            assert!(
                att.scratch_bytes() > scratch,
                "{kernel:?}: the scratch did not grow"
            );
            scratch = att.scratch_bytes();
            let want = reference::attention_gqa(&q, [1, n_heads, d], &k, &v, n_kv, d, &options);
            let got = read_f32(g, &out).await;
            assert_close(&got[1..], &want, &format!("{kernel:?}, window {window:?}"));
        }
    }
}

/// The GQA calls of the tests of other plans than the adapter's own: over several chunks, one with
/// window and soft-cap.
#[rustfmt::skip]
const PLAN_CASES: [Gqa; 2] = [
    Gqa { n_kv: 2, group: 4, d_k: 128, d_v: 128, visible: 1000, n_q: 1, window: None, soft_cap: None },
    Gqa { n_kv: 2, group: 4, d_k: 128, d_v: 128, visible: 700, n_q: 7, window: Some(300), soft_cap: Some(30.0) },
];

/// DeepSeek-V2-Lite's MLA call of those tests.
const PLAN_MLA: Mla = Mla {
    n_heads: 16,
    visible: 600,
    n_q: 2,
    window: None,
    soft_cap: None,
};

/// The subgroup kernels a CPU adapter runs on a device without 64-bit integers, which load 32-bit
/// words: on lavapipe, which has them (`Gpu` asks for them), every other test of this suite runs the
/// kernels of 64-bit loads. GQA with teams of 2 KV heads (of one over 16-bit and narrower storage
/// on Mesa 25.0's lavapipe), DeepSeek's MLA with four rows per iteration, every storage type,
/// against the twins.
pub async fn cpu_plans_of_32_bit_loads_match_the_reference(g: &Gpu) {
    let info = g.adapter.get_info();
    if info.backend == wgpu::Backend::Vulkan && info.name.contains("llvmpipe") {
        // Otherwise no adapter of CI would run the kernels of 64-bit loads.
        assert!(
            g.device.features().contains(wgpu::Features::SHADER_INT64),
            "lavapipe offers 64-bit integers: {info:?}"
        );
    }
    if !g.device.features().contains(wgpu::Features::SHADER_INT64)
        || !kernels(g).contains(&KernelChoice::StreamSubgroup)
    {
        super::skipped(&format!(
            "{:?} has no 64-bit integers or no subgroups, so the kernels of this suite load \
             32-bit words already",
            info.backend
        ));
        return;
    }
    let mut att = Attention::with_kernels(super::kernels_for(g));
    att.plan_without_int64(true);
    check_kernels(
        g,
        &mut att,
        &[KernelChoice::StreamSubgroup],
        &PLAN_CASES,
        &DType::STORAGE,
        PLAN_MLA,
        &DType::STORAGE,
        90,
        "with 32-bit loads",
    )
    .await;
}

/// Lavapipe's GQA teams of one KV head (Mesa 25.0 on, where no slot is f32) and of several
/// (before it): this machine's lavapipe runs one kind in every other test of this suite, and this
/// test plans as for the other Mesa (`Attention::plan_as_for_mesa`). Decode over 1,000 rows, and
/// over 700 with a window and a soft-cap, for every storage type (f32 and the pairs with an f32
/// slot plan the same on both), against the twins; first, that the switch changes the kernel.
pub async fn plans_of_the_other_mesa_match_the_reference(g: &Gpu) {
    let info = g.adapter.get_info();
    if info.device_type != wgpu::DeviceType::Cpu
        || !kernels(g).contains(&KernelChoice::StreamSubgroup)
    {
        super::skipped(&format!(
            "{:?} is not a CPU adapter with subgroups, whose teams are the same on every Mesa",
            info.backend
        ));
        return;
    }
    let mut att = Attention::with_kernels(super::kernels_for(g));
    // The version the library read from the driver; the planner's line is Mesa 25.0.
    let own = att.plan_as_for_mesa(None);
    let (other, teams) = match own {
        Some(v) if v >= (25, 0) => ((22, 3), "several KV heads"),
        _ => ((25, 0), "one KV head"),
    };
    // In a registry of its own, the other Mesa's decode kernel for 2 KV heads of 128 in f16 is one
    // pipeline more than the adapter's own plan built.
    let spec = CacheSpec::new(vec![LayerSpec::kv(2, 128, 128)], DType::F16, 16).unwrap();
    let c = cache_on(g, spec);
    let mut fresh = Attention::new(&g.device, &g.queue).unwrap();
    fresh.set_kernel(KernelChoice::StreamSubgroup);
    assert!(fresh.prepare(&c, 8).unwrap() > 0);
    assert_eq!(fresh.plan_as_for_mesa(Some(other)), own);
    assert_eq!(
        fresh.prepare(&c, 8).unwrap(),
        1,
        "as for Mesa {other:?}, from {own:?}"
    );
    att.plan_as_for_mesa(Some(other));
    #[rustfmt::skip]
    let cases = [
        PLAN_CASES[0],
        Gqa { n_kv: 2, group: 4, d_k: 128, d_v: 128, visible: 700, n_q: 1, window: Some(300), soft_cap: Some(30.0) },
    ];
    check_kernels(
        g,
        &mut att,
        &[KernelChoice::StreamSubgroup],
        &cases,
        &DType::STORAGE,
        PLAN_MLA,
        &[],
        95,
        &format!("as for Mesa {}.{} (teams of {teams})", other.0, other.1),
    )
    .await;
}

/// The GQA `cases` for `gqa_types` (as [`storage_pairs`] pairs them) and `mla` for each of
/// `mla_types`, on each of `kernels` (every kernel of the adapter: [`kernels`]), against the twins
/// (seeds from `seed`).
#[allow(clippy::too_many_arguments)]
async fn check_kernels(
    g: &Gpu,
    att: &mut Attention,
    kernels: &[KernelChoice],
    cases: &[Gqa],
    gqa_types: &[DType],
    mla: Mla,
    mla_types: &[DType],
    seed: u64,
    what: &str,
) {
    for &kernel in kernels {
        att.set_kernel(kernel);
        let mut worst = 0f32;
        for (i, &case) in cases.iter().enumerate() {
            for pair in storage_pairs(gqa_types, i) {
                worst = worst.max(check_gqa(g, att, case, pair, seed + i as u64).await);
            }
        }
        for &dtype in mla_types {
            worst = worst.max(check_mla(g, att, mla, [dtype; 2], seed + 10).await);
        }
        note!("{kernel:?} {what}: worst scaled error {worst:e}");
    }
}

/// GQA and MLA over q8_0, q4_0 and fp8 storage against the twins over the dequantized read-back, on
/// every kernel of the adapter (where the forced streaming kernels refuse a shape, `ran` asserts it
/// should), then a prefill and decode steps against an independent CPU model. The twins see the
/// values the cache keeps, so the tolerance is the same as for f32; what quantization itself costs
/// in accuracy is measured by the bench (docs/benchmarks.md).
pub async fn quantized_storage_matches_the_reference(g: &Gpu) {
    let mut att = Attention::with_kernels(super::kernels_for(g));
    #[rustfmt::skip]
    let cases = [
        Gqa { n_kv: 2, group: 1, d_k: 64, d_v: 64, visible: 1, n_q: 1, window: None, soft_cap: None },
        Gqa { n_kv: 2, group: 4, d_k: 128, d_v: 64, visible: 2, n_q: 1, window: None, soft_cap: None },
        Gqa { n_kv: 1, group: 8, d_k: 64, d_v: 32, visible: 63, n_q: 7, window: None, soft_cap: Some(30.0) },
        Gqa { n_kv: 4, group: 1, d_k: 64, d_v: 64, visible: 65, n_q: 7, window: Some(32), soft_cap: Some(20.0) },
        Gqa { n_kv: 2, group: 4, d_k: 128, d_v: 128, visible: 1000, n_q: 7, window: None, soft_cap: None },
        Gqa { n_kv: 8, group: 4, d_k: 64, d_v: 32, visible: 600, n_q: 2, window: Some(550), soft_cap: None },
    ];
    // fp8 takes any width: odd head dims that start inside a word.
    #[rustfmt::skip]
    let odd = Gqa { n_kv: 3, group: 2, d_k: 33, d_v: 17, visible: 70, n_q: 3, window: Some(9), soft_cap: None };
    #[rustfmt::skip]
    let mla = [
        Mla { n_heads: 16, visible: 1, n_q: 1, window: None, soft_cap: None },
        Mla { n_heads: 4, visible: 65, n_q: 7, window: Some(20), soft_cap: Some(30.0) },
        Mla { n_heads: 16, visible: 1000, n_q: 1, window: None, soft_cap: Some(50.0) },
    ];
    for kernel in kernels(g) {
        att.set_kernel(kernel);
        for dtype in DType::QUANTIZED {
            // A forced streaming kernel refuses head dimensions that are not whole 16-byte vectors
            // (asserted by `ran`); rows of 2 KV heads of 64 (q8_0: 136 bytes) are read as words.
            let mut worst = 0f32;
            for (i, &case) in cases.iter().enumerate() {
                worst = worst.max(check_gqa(g, &mut att, case, [dtype; 2], 110 + i as u64).await);
            }
            if dtype.is_fp8() {
                worst = worst.max(check_gqa(g, &mut att, odd, [dtype; 2], 120).await);
            }
            for (i, &case) in mla.iter().enumerate() {
                worst = worst.max(check_mla(g, &mut att, case, [dtype; 2], 130 + i as u64).await);
            }
            note!("{dtype} {kernel:?}: worst scaled error {worst:e}");
        }
    }
    for dtype in DType::QUANTIZED {
        gqa_prefill_and_decode(g, [dtype; 2], [4, 2, 32, 64], 140).await;
    }
}

/// K and V (MLA: latent and rope key) in different storage types, as llama.cpp's `--cache-type-k` /
/// `--cache-type-v` allow: GQA and MLA against the twins over the read-back, on every kernel of the
/// adapter, for pairs that mix the families (block, byte, 16-bit and f32 slots, vectors of different
/// widths side by side), then a prefill and decode steps against an independent CPU model.
pub async fn mixed_storage_matches_the_reference(g: &Gpu) {
    use DType::*;
    let mut att = Attention::with_kernels(super::kernels_for(g));
    #[rustfmt::skip]
    let gqa = [
        Gqa { n_kv: 2, group: 4, d_k: 128, d_v: 64, visible: 2, n_q: 1, window: None, soft_cap: None },
        Gqa { n_kv: 1, group: 8, d_k: 64, d_v: 32, visible: 63, n_q: 7, window: None, soft_cap: Some(30.0) },
        Gqa { n_kv: 2, group: 4, d_k: 128, d_v: 128, visible: 1000, n_q: 3, window: Some(700), soft_cap: None },
    ];
    #[rustfmt::skip]
    let mla = [
        Mla { n_heads: 4, visible: 65, n_q: 7, window: Some(20), soft_cap: Some(30.0) },
        Mla { n_heads: 16, visible: 1000, n_q: 1, window: None, soft_cap: None },
    ];
    let gqa_pairs = [
        [Q8_0, Q4_0],
        [F16, Q8_0],
        [Q4_0, F8E4M3],
        [F8E4M3, BF16],
        [F32, Q4_0],
    ];
    let mla_pairs = [[Q4_0, F16], [Q8_0, F32], [F8E4M3, Q8_0], [BF16, F8E4M3]];
    for kernel in kernels(g) {
        att.set_kernel(kernel);
        let mut worst = 0f32;
        for (p, &types) in gqa_pairs.iter().enumerate() {
            for (i, &case) in gqa.iter().enumerate() {
                let seed = 150 + (p * 8 + i) as u64;
                worst = worst.max(check_gqa(g, &mut att, case, types, seed).await);
            }
        }
        for (p, &types) in mla_pairs.iter().enumerate() {
            for (i, &case) in mla.iter().enumerate() {
                let seed = 200 + (p * 8 + i) as u64;
                worst = worst.max(check_mla(g, &mut att, case, types, seed).await);
            }
        }
        // fp8 scaled per slot (values of 2 stored as numbers up to 500 saturate at 448: the twins see
        // what the cache holds, read back times the scale).
        let scaled = |layer: LayerSpec, scales: [f32; 2]| {
            let mut layer = stored_as(layer, [F8E4M3; 2]);
            for (slot, scale) in layer.slots.iter_mut().zip(scales) {
                slot.scale = Some(scale);
            }
            layer
        };
        for (i, &case) in gqa.iter().enumerate() {
            let layer = scaled(LayerSpec::kv(case.n_kv, case.d_k, case.d_v), [0.004, 0.05]);
            worst = worst.max(check_gqa_in(g, &mut att, case, layer, 260 + i as u64).await);
        }
        for (i, &case) in mla.iter().enumerate() {
            let layer = scaled(LayerSpec::mla(512, 64), [0.02, 3.0]);
            worst = worst.max(check_mla_in(g, &mut att, case, layer, 270 + i as u64).await);
        }
        // Heads of 33 and 17 fp8 elements, which the tiled kernel reads element by element where a
        // head starts inside a word: scaled there too (the streaming kernels refuse the shape).
        if kernel == KernelChoice::Tiled {
            #[rustfmt::skip]
            let odd = Gqa { n_kv: 3, group: 2, d_k: 33, d_v: 17, visible: 70, n_q: 3, window: Some(9), soft_cap: None };
            let layer = scaled(LayerSpec::kv(3, 33, 17), [0.004, 0.05]);
            worst = worst.max(check_gqa_in(g, &mut att, odd, layer, 280).await);
        }
        note!("mixed storage {kernel:?}: worst scaled error {worst:e}");
    }
    gqa_prefill_and_decode(g, [Q8_0, Q4_0], [4, 2, 32, 64], 240).await;
    gqa_prefill_and_decode(g, [BF16, F8E4M3], [4, 2, 32, 64], 250).await;
}

/// Two layers, a prefill of 9 tokens (queries of the last 9 rows, causal) then 3 decode steps of one
/// token, attention on every layer at every step against the twin over an independent CPU model of
/// the cache (not its read-back), so what the cache stores is checked too.
async fn gqa_prefill_and_decode_match_an_independent_model(g: &Gpu) {
    for dtype in DType::ALL {
        gqa_prefill_and_decode(g, [dtype; 2], [4, 2, 8, 6], 40).await;
    }
}

/// The steps of [`gqa_prefill_and_decode_match_an_independent_model`] for K and V stored as `types`
/// and `[n_heads, n_kv, d_k, d_v]`.
async fn gqa_prefill_and_decode(g: &Gpu, types: [DType; 2], dims: [usize; 4], seed: u64) {
    let [n_heads, n_kv, d_k, d_v] = dims;
    let layer = stored_as(LayerSpec::kv(n_kv, d_k, d_v), types);
    let spec = CacheSpec::uniform(2, layer, types[0], 32).unwrap();
    let (mut c, mut m) = (cache_on(g, spec.clone()), CpuCache::new(&spec));
    let mut att = Attention::for_cache(&c);
    let mut worst = 0.0f32;
    for (step, n_q) in [9usize, 1, 1, 1].into_iter().enumerate() {
        for l in 0..2 {
            append_both(&mut c, &mut m, l, n_q, seed + (step * 2 + l) as u64);
        }
        for l in 0..2 {
            let q = values(seed + 50 + (step * 2 + l) as u64, n_q * n_heads * d_k);
            let q_buf = f32_buffer(&g.device, &q).await;
            let out = output(&g.device, n_q * n_heads * d_v).await;
            let options = AttentionOptions::default();
            att.gqa(
                &c,
                l,
                Queries::new(&q_buf, n_q, n_heads, d_k),
                &out,
                &options,
            )
            .unwrap();
            let visible = c.visible(l).unwrap();
            let (k, v) = (m.read_f32(l, 0, visible), m.read_f32(l, 1, visible));
            let want =
                reference::attention_gqa(&q, [n_q, n_heads, d_k], &k, &v, n_kv, d_v, &options);
            let what = format!("{types:?} step {step} layer {l}");
            worst = worst.max(assert_close(&read_f32(g, &out).await, &want, &what));
        }
        c.advance(n_q).unwrap();
    }
    note!("{types:?}: GQA prefill and decode, worst scaled error {worst:e}");
}

pub async fn attention_over_4096_rows_splits_the_sequence(g: &Gpu) {
    over_4096_rows(g, &DType::ALL).await;
}

/// [`attention_over_4096_rows_splits_the_sequence`] over q8_0, q4_0 and fp8 storage (run with the
/// quantized suite).
pub async fn quantized_attention_over_4096_rows_splits_the_sequence(g: &Gpu) {
    over_4096_rows(g, &DType::QUANTIZED).await;
}

/// Soft-caps of 1,000 and 10,000 (scores far below the cap: tanh's argument between 1e-4 and
/// 0.1), every kernel, f32 and f16: `tanh_safe` computed (1 - t) / (1 + t) there, whose
/// cancellation cost the score about cap x 1.5e-8 (a scaled error of 1.4e-5 at 1,000 and 2e-4
/// at 10,000). It takes an odd polynomial below 0.125 now. Also the smallest cap a call accepts,
/// `f32::MIN_POSITIVE` (tanh's arguments near 1e38, and infinite for scores above about 4).
pub async fn large_soft_caps_keep_their_precision(g: &Gpu) {
    let mut att = Attention::with_kernels(super::kernels_for(g));
    for kernel in kernels(g) {
        att.set_kernel(kernel);
        for (i, cap) in [1.0e3, 1.0e4, f32::MIN_POSITIVE].into_iter().enumerate() {
            #[rustfmt::skip]
            let case = Gqa { n_kv: 2, group: 4, d_k: 128, d_v: 128, visible: 64, n_q: 1, window: None, soft_cap: Some(cap) };
            for types in storage_pairs(&DType::ALL, i) {
                let worst = check_gqa(g, &mut att, case, types, 80).await;
                note!("{kernel:?} soft-cap {cap:e} {types:?}: worst scaled error {worst:e}");
            }
        }
    }
}

/// An infinity or a NaN in one KV head's row stays in that head: the heads beside it match the twin.
/// Heads of 33 and 17 elements share a word of 16-bit storage with their neighbours, and the tiled
/// kernel read whole words, multiplying the neighbour's half by a zero query element: 0 x inf is
/// NaN, so one head's infinity made the next head's scores NaN. Here every KV head but one holds an
/// infinity at the start and a NaN at the end of one row's key and value, and the clean head is
/// checked (the others' outputs are NaN in the twin, and no kernel promises what it gives
/// instead), each head in turn: with heads of 33, head 0 ends and head 1 starts inside a word, and
/// the neighbour's half of that word is non-finite. Heads of 33 / 17 (the tiled kernel alone takes
/// them) and of 64 (every kernel, the streaming ones reading several KV heads' rows as one run on
/// lavapipe).
pub async fn a_non_finite_element_stays_in_its_head(g: &Gpu) {
    let mut att = Attention::with_kernels(super::kernels_for(g));
    // `gqa_matches`' cases 7 (without its window) and 4, and their storage (their pipelines).
    #[rustfmt::skip]
    let cases = [
        (7, Gqa { n_kv: 3, group: 2, d_k: 33, d_v: 17, visible: 70, n_q: 3, window: None, soft_cap: None }),
        (4, Gqa { n_kv: 4, group: 1, d_k: 64, d_v: 64, visible: 65, n_q: 7, window: Some(32), soft_cap: Some(20.0) }),
    ];
    for kernel in kernels(g) {
        att.set_kernel(kernel);
        let mut checks = 0;
        for (i, case) in cases {
            for types in storage_pairs(&DType::ALL, i) {
                for clean in 0..case.n_kv {
                    let ran = non_finite_beside(g, &mut att, case, types, clean).await;
                    checks += usize::from(ran);
                }
            }
        }
        // Every kernel takes the aligned heads (f32, and f16 with bf16).
        assert!(checks >= 2, "{kernel:?}: {checks} checks ran");
    }
}

/// A row holding infinities and NaN in its keys and values changes only the outputs of the queries
/// that see it, as in the twin: not those of earlier queries (causal), nor of later ones whose window
/// starts past it, though a team of several queries (lavapipe) loads the row for all of them (0 x inf
/// is NaN: its values are left out for them, not weighted by 0), and the outputs of the queries that
/// see it are non-finite. 7 queries (teams of 4 and 3) over 65 rows with a window of 32, on every
/// kernel: the row of query 3 (queries 0 to 2 clean), then the first row of query 0's window
/// (queries 1 to 6 clean). GQA (one row per loop iteration) and MLA of 4 heads (four rows per
/// iteration on lavapipe, where the values of the rows after the first are selected).
pub async fn a_non_finite_row_stays_out_of_the_queries_that_do_not_see_it(g: &Gpu) {
    let mut att = Attention::with_kernels(super::kernels_for(g));
    let (rows, n_q, n_heads, window) = (65, 7, 4, 32);
    let last0 = rows - n_q;
    let options = AttentionOptions {
        window: Some(window),
        soft_cap: Some(20.0),
        scale: None,
    };
    // GQA: `gqa_matches`' case 4 in f32 (its pipelines); MLA: `prepare`'s layer of 32 + 8.
    let (d, r, p) = (64, 32, 8);
    for kernel in kernels(g) {
        att.set_kernel(kernel);
        for (poisoned, clean) in [(last0 + 3, 0..3), (last0 + 1 - window, 1..n_q)] {
            let poison = |data: &mut [f32], width: usize| {
                let row = &mut data[poisoned * width..(poisoned + 1) * width];
                for (i, x) in row.iter_mut().enumerate() {
                    *x = if i % 2 == 0 { f32::INFINITY } else { f32::NAN };
                }
            };
            let what = format!("{kernel:?}, row {poisoned} non-finite");
            // GQA over 4 KV heads of 64, every one poisoned.
            let (mut k, mut v) = (values(44, rows * 4 * d), values(45, rows * 4 * d));
            poison(&mut k, 4 * d);
            poison(&mut v, 4 * d);
            let spec = CacheSpec::new(vec![LayerSpec::kv(4, d, d)], DType::F32, rows).unwrap();
            let mut c = cache_on(g, spec);
            let shape = [rows, 4, d];
            let slabs = [HostSlab::f32(&k, &shape), HostSlab::f32(&v, &shape)];
            c.append(0, &slabs).unwrap();
            let q = values(46, n_q * n_heads * d);
            let qb = f32_buffer(&g.device, &q).await;
            let out = output(&g.device, n_q * n_heads * d).await;
            let queries = Queries::new(&qb, n_q, n_heads, d);
            let result = att.gqa(&c, 0, queries, &out, &options);
            assert!(ran(g, result, &att, &c, &out).await, "{kernel:?}");
            let want = reference::attention_gqa(&q, [n_q, n_heads, d], &k, &v, 4, d, &options);
            let got = read_f32(g, &out).await;
            only_the_queries_that_see_it(&got, &want, &clean, &format!("GQA, {what}"));
            // MLA: the latent and the rope row.
            let (mut latent, mut rope) = (values(47, rows * r), values(48, rows * p));
            poison(&mut latent, r);
            poison(&mut rope, p);
            let spec = CacheSpec::new(vec![LayerSpec::mla(r, p)], DType::F32, rows).unwrap();
            let mut c = cache_on(g, spec);
            let shapes = [[rows, r], [rows, p]];
            let slabs = [
                HostSlab::f32(&latent, &shapes[0]),
                HostSlab::f32(&rope, &shapes[1]),
            ];
            c.append(0, &slabs).unwrap();
            let (ql, qr) = (values(49, n_q * n_heads * r), values(50, n_q * n_heads * p));
            let (qlb, qrb) = (
                f32_buffer(&g.device, &ql).await,
                f32_buffer(&g.device, &qr).await,
            );
            let out = output(&g.device, n_q * n_heads * r).await;
            let queries = MlaQueries {
                latent: Queries::new(&qlb, n_q, n_heads, r),
                rope: Queries::new(&qrb, n_q, n_heads, p),
            };
            let result = att.mla(&c, 0, queries, &out, &options);
            assert!(ran(g, result, &att, &c, &out).await, "{kernel:?}");
            let want =
                reference::attention_mla(&ql, &qr, [n_q, n_heads, r], &latent, &rope, p, &options);
            let got = read_f32(g, &out).await;
            only_the_queries_that_see_it(&got, &want, &clean, &format!("MLA, {what}"));
        }
    }
}

/// [`a_non_finite_row_stays_out_of_the_queries_that_do_not_see_it`]'s check of outputs of 7
/// queries: the `clean` ones match the twin, the others are non-finite in both.
fn only_the_queries_that_see_it(
    got: &[f32],
    want: &[f32],
    clean: &std::ops::Range<usize>,
    what: &str,
) {
    let per_query = got.len() / 7;
    let of = |x: &[f32], q: usize| x[q * per_query..(q + 1) * per_query].to_vec();
    for q in 0..7 {
        if clean.contains(&q) {
            assert_close(&of(got, q), &of(want, q), &format!("{what}, query {q}"));
        } else {
            let seen = [of(got, q), of(want, q)];
            let all_non_finite = seen.iter().flatten().all(|x| !x.is_finite());
            assert!(all_non_finite, "{what}, query {q} sees the row: {seen:?}");
        }
    }
}

/// One check of [`a_non_finite_element_stays_in_its_head`], KV head `clean` the clean one; whether
/// the kernel took the shape.
async fn non_finite_beside(
    g: &Gpu,
    att: &mut Attention,
    case: Gqa,
    types: [DType; 2],
    clean: usize,
) -> bool {
    let n_heads = case.n_kv * case.group;
    let (rows, n_q) = (case.visible, case.n_q);
    let mut k = values(41, rows * case.n_kv * case.d_k);
    let mut v = values(42, rows * case.n_kv * case.d_v);
    // Row 60 (seen by the queries at rows 60 and later), every KV head but `clean`: its first and
    // last elements.
    for (data, d) in [(&mut k, case.d_k), (&mut v, case.d_v)] {
        for kv in (0..case.n_kv).filter(|&kv| kv != clean) {
            let head = (60 * case.n_kv + kv) * d;
            data[head] = f32::INFINITY;
            data[head + d - 1] = f32::NAN;
        }
    }
    let q = values(43, n_q * n_heads * case.d_k);
    let qb = f32_buffer(&g.device, &q).await;
    let options = AttentionOptions {
        window: case.window,
        soft_cap: case.soft_cap,
        scale: None,
    };
    let layer = stored_as(LayerSpec::kv(case.n_kv, case.d_k, case.d_v), types);
    let mut c = cache_on(g, CacheSpec::new(vec![layer], types[0], rows).unwrap());
    for (from, to) in [(0, rows - n_q), (rows - n_q, rows)] {
        let shapes = [
            [to - from, case.n_kv, case.d_k],
            [to - from, case.n_kv, case.d_v],
        ];
        let (k_row, v_row) = (case.n_kv * case.d_k, case.n_kv * case.d_v);
        let slabs = [
            HostSlab::f32(&k[from * k_row..to * k_row], &shapes[0]),
            HostSlab::f32(&v[from * v_row..to * v_row], &shapes[1]),
        ];
        c.append(0, &slabs).unwrap();
        if from == 0 {
            c.advance(to).unwrap();
        }
    }
    let out = output(&g.device, n_q * n_heads * case.d_v).await;
    let queries = Queries::new(&qb, n_q, n_heads, case.d_k);
    let result = att.gqa(&c, 0, queries, &out, &options);
    if !ran(g, result, att, &c, &out).await {
        return false;
    }
    let want = reference::attention_gqa(
        &q,
        [n_q, n_heads, case.d_k],
        &c.read_f32_async(0, 0).await.unwrap(),
        &c.read_f32_async(0, 1).await.unwrap(),
        case.n_kv,
        case.d_v,
        &options,
    );
    let checked: Vec<usize> = (0..n_heads).filter(|h| h / case.group == clean).collect();
    let heads_of = |x: &[f32]| -> Vec<f32> {
        x.chunks(case.d_v)
            .enumerate()
            .filter(|(i, _)| checked.contains(&(i % n_heads)))
            .flat_map(|(_, h)| h.iter().copied())
            .collect()
    };
    let got = read_f32(g, &out).await;
    let what = format!(
        "{types:?} {:?}, heads of {} / {}, KV head {clean} of {} clean, the others holding inf and \
         NaN",
        att.kernel(),
        case.d_k,
        case.d_v,
        case.n_kv
    );
    let worst = assert_close(&heads_of(&got), &heads_of(&want), &what);
    note!("{what}: worst scaled error {worst:e}");
    true
}

/// A NaN that a query head reads, in its query or in a key row it sees, makes every element of that
/// head's output NaN, as in the twin; the other heads match the twin. On every kernel: under the
/// adapter's own plan (on CPU adapters their merge pass, `main`), and under a GPU's over chunks of
/// the fewest rows (its merge pass, `split`) and over one chunk (the streaming kernels write it
/// directly). The merge pass took a chunk whose sum was NaN for one that saw no rows and skipped it:
/// a head's output was then the softmax over its other chunks (finite and plausible), or 0 without
/// any.
pub async fn a_nan_a_head_reads_makes_its_output_nan(g: &Gpu) {
    let mut att = Attention::with_kernels(super::kernels_for(g));
    // `gqa_matches`' case 5 (7 queries) under the adapter's plan, and `gpu_plans_match`' first
    // call (1 query) under a GPU's: their pipelines.
    let case = PLAN_CASES[0];
    let n_heads = case.n_kv * case.group;
    let (rows, d_k, d_v) = (case.visible, case.d_k, case.d_v);
    let mut k = values(61, rows * case.n_kv * d_k);
    let v = values(62, rows * case.n_kv * d_v);
    // Row 500 of KV head 1: query heads 4 to 7 of every query read it.
    k[(500 * case.n_kv + 1) * d_k + 5] = f32::NAN;
    let spec = CacheSpec::new(vec![LayerSpec::kv(case.n_kv, d_k, d_v)], DType::F32, rows).unwrap();
    let mut c = cache_on(g, spec);
    let shapes = [[rows, case.n_kv, d_k], [rows, case.n_kv, d_v]];
    let slabs = [HostSlab::f32(&k, &shapes[0]), HostSlab::f32(&v, &shapes[1])];
    c.append(0, &slabs).unwrap();
    c.advance(rows).unwrap();
    let options = AttentionOptions::default();
    let all = kernels(g);
    let streaming = streaming_of(&all);
    let mut checks = 0;
    for (gpu_plan, target, n_q, kernels) in [
        (false, None, 7, &all),
        (true, Some(usize::MAX), 1, &all),
        (true, Some(1), 1, &streaming),
    ] {
        att.plan_as_for_a_gpu(gpu_plan);
        att.set_target_workgroups(target.and_then(std::num::NonZeroUsize::new));
        // And query head 2 (of KV head 0) of the last query.
        let mut q = values(63, n_q * n_heads * d_k);
        q[((n_q - 1) * n_heads + 2) * d_k + 7] = f32::NAN;
        let nan_head = |qi: usize, h: usize| (qi == n_q - 1 && h == 2) || h / case.group == 1;
        let qb = f32_buffer(&g.device, &q).await;
        let want =
            reference::attention_gqa(&q, [n_q, n_heads, d_k], &k, &v, case.n_kv, d_v, &options);
        let dims = [n_heads, d_v];
        assert_nan_heads(&want, &want, dims, nan_head, "the twin");
        for &kernel in kernels {
            att.set_kernel(kernel);
            let out = output(&g.device, n_q * n_heads * d_v).await;
            let queries = Queries::new(&qb, n_q, n_heads, d_k);
            let result = att.gqa(&c, 0, queries, &out, &options);
            if !ran(g, result, &att, &c, &out).await {
                continue;
            }
            let what = format!("{kernel:?}, as for a GPU {gpu_plan}, aiming for {target:?}");
            assert_nan_heads(&read_f32(g, &out).await, &want, dims, nan_head, &what);
            checks += 1;
        }
    }
    assert!(checks >= 3, "{checks} checks ran");
}

/// fp8 keys whose heads do not start on a word (d_k not a multiple of 4) take the tiled kernel's
/// element-by-element loads, four loop iterations per row per step more than whole words: with
/// heads of 9,990 over 512 rows, a tile planned as if every load were whole ran past the 65,535
/// iterations Mesa's software adapters allow one invocation, which stop silently (a scaled error
/// of 0.29). The planner counts those loads; heads of 9,992 (whole words) are the control.
pub async fn wide_unaligned_fp8_heads_stay_within_the_loop_budget(g: &Gpu) {
    let mut att = Attention::with_kernels(super::kernels_for(g));
    att.set_kernel(KernelChoice::Tiled);
    for d_k in [9990, 9992] {
        #[rustfmt::skip]
        let case = Gqa { n_kv: 2, group: 1, d_k, d_v: 4, visible: 512, n_q: 8, window: None, soft_cap: None };
        let worst = check_gqa(g, &mut att, case, [DType::F8E4M3; 2], 70).await;
        note!("fp8 e4m3 heads of {d_k} over 512 rows: worst scaled error {worst:e}");
    }
}

/// GQA (one query, and seven with a window and soft-cap) and MLA over 4,096 rows, every kernel of the
/// adapter, for each of `types`.
async fn over_4096_rows(g: &Gpu, types: &[DType]) {
    let mut att = Attention::with_kernels(super::kernels_for(g));
    // The shapes and storage of cases 2 and 3 of `gqa_matches_the_reference_for_every_dtype` (even
    // and odd: the same `storage_pairs`): the suite's tests share one kernel registry, and a new
    // kernel costs seconds of shader compiles on a cold OpenGL cache.
    #[rustfmt::skip]
    let cases = [
        Gqa { n_kv: 1, group: 8, d_k: 128, d_v: 128, visible: 4096, n_q: 1, window: None, soft_cap: None },
        Gqa { n_kv: 2, group: 4, d_k: 128, d_v: 128, visible: 4096, n_q: 7, window: Some(1000), soft_cap: Some(50.0) },
    ];
    let mla = Mla {
        n_heads: 16,
        visible: 4096,
        n_q: 1,
        window: None,
        soft_cap: None,
    };
    check_kernels(
        g,
        &mut att,
        &kernels(g),
        &cases,
        types,
        mla,
        types,
        40,
        "over 4,096 rows",
    )
    .await;
}

#[derive(Clone, Copy, Debug)]
struct Mla {
    n_heads: usize,
    visible: usize,
    n_q: usize,
    window: Option<usize>,
    soft_cap: Option<f32>,
}

async fn check_mla(g: &Gpu, att: &mut Attention, case: Mla, types: [DType; 2], seed: u64) -> f32 {
    check_mla_in(
        g,
        att,
        case,
        stored_as(LayerSpec::mla(512, 64), types),
        seed,
    )
    .await
}

/// [`check_mla`] over `layer` (a latent of 512 and a rope key of 64, stored as their specs say).
async fn check_mla_in(g: &Gpu, att: &mut Attention, case: Mla, layer: LayerSpec, seed: u64) -> f32 {
    let (r, p) = (512, 64);
    let types = storage_of(&layer);
    let dtype = layer.slots[0].dtype.unwrap_or(DType::F32);
    let c = filled(g, layer, dtype, case.visible, case.n_q, seed);
    let ql = values(seed + 77, case.n_q * case.n_heads * r);
    let qr = values(seed + 78, case.n_q * case.n_heads * p);
    let (qlb, qrb) = (
        f32_buffer(&g.device, &ql).await,
        f32_buffer(&g.device, &qr).await,
    );
    let out = output(&g.device, case.n_q * case.n_heads * r).await;
    let options = AttentionOptions {
        window: case.window,
        soft_cap: case.soft_cap,
        scale: Some(0.07),
    };
    let result = att.mla(
        &c,
        0,
        MlaQueries {
            latent: Queries::new(&qlb, case.n_q, case.n_heads, r),
            rope: Queries::new(&qrb, case.n_q, case.n_heads, p),
        },
        &out,
        &options,
    );
    if !ran(g, result, att, &c, &out).await {
        return 0.0;
    }
    let want = reference::attention_mla(
        &ql,
        &qr,
        [case.n_q, case.n_heads, r],
        &c.read_f32_async(0, 0).await.unwrap(),
        &c.read_f32_async(0, 1).await.unwrap(),
        p,
        &options,
    );
    assert_close(
        &read_f32(g, &out).await,
        &want,
        &format!("{types:?} MLA {case:?} {:?}", att.kernel()),
    )
}

pub async fn mla_matches_the_reference_for_every_dtype(g: &Gpu) {
    let mut att = Attention::with_kernels(super::kernels_for(g));
    #[rustfmt::skip]
    let cases = [
        Mla { n_heads: 16, visible: 1, n_q: 1, window: None, soft_cap: None },
        Mla { n_heads: 4, visible: 65, n_q: 7, window: Some(20), soft_cap: Some(30.0) },
        Mla { n_heads: 20, visible: 130, n_q: 2, window: None, soft_cap: None },
        Mla { n_heads: 16, visible: 1000, n_q: 1, window: None, soft_cap: Some(50.0) },
    ];
    for kernel in kernels(g) {
        att.set_kernel(kernel);
        for dtype in DType::ALL {
            note!("-- {dtype} {kernel:?}");
            for (i, &case) in cases.iter().enumerate() {
                check_mla(g, &mut att, case, [dtype; 2], 60 + i as u64).await;
            }
        }
    }
    mla_decode_matches_an_independent_model(g).await;
}

/// A prefill of 6 tokens, then 4 decode steps of one token, MLA after every append against the twin
/// over an independent CPU model of the cache.
async fn mla_decode_matches_an_independent_model(g: &Gpu) {
    let (n_heads, r, p) = (4usize, 16usize, 4usize);
    for dtype in DType::ALL {
        let spec = CacheSpec::new(vec![LayerSpec::mla(r, p)], dtype, 24).unwrap();
        let (mut c, mut m) = (cache_on(g, spec.clone()), CpuCache::new(&spec));
        let mut att = Attention::for_cache(&c);
        let options = AttentionOptions {
            scale: Some(0.2),
            ..Default::default()
        };
        let mut worst = 0.0f32;
        for (step, n_q) in [6usize, 1, 1, 1, 1].into_iter().enumerate() {
            append_both(&mut c, &mut m, 0, n_q, 60 + step as u64);
            let q_latent = values(70 + step as u64, n_q * n_heads * r);
            let q_rope = values(80 + step as u64, n_q * n_heads * p);
            let ql = f32_buffer(&g.device, &q_latent).await;
            let qr = f32_buffer(&g.device, &q_rope).await;
            let out = output(&g.device, n_q * n_heads * r).await;
            att.mla(
                &c,
                0,
                MlaQueries {
                    latent: Queries::new(&ql, n_q, n_heads, r),
                    rope: Queries::new(&qr, n_q, n_heads, p),
                },
                &out,
                &options,
            )
            .unwrap();
            let visible = c.visible(0).unwrap();
            let want = reference::attention_mla(
                &q_latent,
                &q_rope,
                [n_q, n_heads, r],
                &m.read_f32(0, 0, visible),
                &m.read_f32(0, 1, visible),
                p,
                &options,
            );
            let what = format!("{dtype} step {step}");
            worst = worst.max(assert_close(&read_f32(g, &out).await, &want, &what));
            c.advance(n_q).unwrap();
        }
        note!("{dtype}: MLA prefill and decode, worst scaled error {worst:e}");
    }
}

/// GQA of 3 queries x 4 heads (d = 64) over layer 0 of `c`, against the twin over its read-back.
async fn check_gqa_3x4(
    g: &Gpu,
    att: &mut Attention,
    c: &KvCache,
    q: &[f32],
    qb: &wgpu::Buffer,
    out: &wgpu::Buffer,
    what: &str,
) {
    let (n_q, n_heads, d) = (3, 4, 128);
    let options = AttentionOptions::default();
    att.gqa(c, 0, Queries::new(qb, n_q, n_heads, d), out, &options)
        .unwrap();
    let want = reference::attention_gqa(
        q,
        [n_q, n_heads, d],
        &c.read_f32_async(0, 0).await.unwrap(),
        &c.read_f32_async(0, 1).await.unwrap(),
        2,
        d,
        &options,
    );
    assert_close(&read_f32(g, out).await, &want, what);
}

pub async fn attention_sees_the_rows_left_by_truncate_and_reset(g: &Gpu) {
    let mut att = Attention::with_kernels(super::kernels_for(g));
    // Every type (`storage_pairs` of both parities), in the shapes of `gqa_matches`' cases 2 and 3.
    for types in [
        [DType::F32; 2],
        [DType::F16, DType::BF16],
        [DType::BF16, DType::F16],
    ] {
        note!("-- {types:?}");
        let layer = stored_as(LayerSpec::kv(2, 128, 128), types);
        let mut c = cache_on(g, CacheSpec::new(vec![layer], types[0], 256).unwrap());
        let (n_q, n_heads) = (3, 4);
        let q = values(5, n_q * n_heads * 128);
        let qb = f32_buffer(&g.device, &q).await;
        let out = output(&g.device, n_q * n_heads * 128).await;
        append_random(&mut c, 0, 200, 1);
        c.advance(200).unwrap();
        // Speculative rollback: the 3 new rows follow row 39, and rows 43.. of the old run are unseen.
        c.truncate(40).unwrap();
        append_random(&mut c, 0, n_q, 2);
        assert_eq!(c.visible(0).unwrap(), 43);
        check_gqa_3x4(
            g,
            &mut att,
            &c,
            &q,
            &qb,
            &out,
            &format!("{types:?} after truncate"),
        )
        .await;
        c.advance(n_q).unwrap();
        c.reset().unwrap();
        append_random(&mut c, 0, n_q, 3);
        check_gqa_3x4(
            g,
            &mut att,
            &c,
            &q,
            &qb,
            &out,
            &format!("{types:?} after reset"),
        )
        .await;
        c.advance(n_q).unwrap();
        c.reset_fast();
        append_random(&mut c, 0, n_q + 1, 4);
        check_gqa_3x4(
            g,
            &mut att,
            &c,
            &q,
            &qb,
            &out,
            &format!("{types:?} after reset_fast"),
        )
        .await;
    }
}

pub async fn many_calls_with_different_parameters_share_one_encoder(g: &Gpu) {
    let mut att = Attention::with_kernels(super::kernels_for(g));
    // The shapes and storage of `gqa_matches`' cases 0 and 1 (see `storage_pairs`).
    let layers = vec![
        stored_as(LayerSpec::kv(2, 64, 64), [DType::F16, DType::BF16]),
        LayerSpec::empty(),
        stored_as(LayerSpec::kv(2, 128, 64), [DType::BF16, DType::F16]),
    ];
    let mut c = cache_on(g, CacheSpec::new(layers, DType::F16, 300).unwrap());
    for layer in [0, 2] {
        append_random(&mut c, layer, 300, layer as u64 + 1);
    }
    let q0 = values(1, 6 * 64);
    let q2 = values(2, 8 * 128);
    let (q0b, q2b) = (
        f32_buffer(&g.device, &q0).await,
        f32_buffer(&g.device, &q2).await,
    );
    let (out0, out2) = (
        output(&g.device, 6 * 64).await,
        output(&g.device, 8 * 64).await,
    );
    let o0 = AttentionOptions {
        window: Some(50),
        ..Default::default()
    };
    let o2 = AttentionOptions {
        scale: Some(0.3),
        soft_cap: Some(4.0),
        ..Default::default()
    };
    let mut encoder = g.device.create_command_encoder(&Default::default());
    att.record_gqa(
        &mut encoder,
        &c,
        0,
        Queries::new(&q0b, 1, 6, 64),
        &out0,
        &o0,
    )
    .unwrap();
    att.record_gqa(
        &mut encoder,
        &c,
        2,
        Queries::new(&q2b, 1, 8, 128),
        &out2,
        &o2,
    )
    .unwrap();
    g.queue.submit([encoder.finish()]);
    let want0 = reference::attention_gqa(
        &q0,
        [1, 6, 64],
        &c.read_f32_async(0, 0).await.unwrap(),
        &c.read_f32_async(0, 1).await.unwrap(),
        2,
        64,
        &o0,
    );
    let want2 = reference::attention_gqa(
        &q2,
        [1, 8, 128],
        &c.read_f32_async(2, 0).await.unwrap(),
        &c.read_f32_async(2, 1).await.unwrap(),
        2,
        64,
        &o2,
    );
    assert_close(&read_f32(g, &out0).await, &want0, "layer 0");
    assert_close(&read_f32(g, &out2).await, &want2, "layer 2");
}

pub async fn bad_requests_are_refused_and_change_nothing(g: &Gpu) {
    let mut att = Attention::with_kernels(super::kernels_for(g));
    let layers = vec![
        LayerSpec::kv(2, 8, 8),
        LayerSpec::empty(),
        LayerSpec::mla(16, 4),
        LayerSpec::new(vec![SlotSpec::new("qkv", &[3, 8])]),
    ];
    let mut c = cache_on(g, CacheSpec::new(layers, DType::F32, 16).unwrap());
    for layer in [0, 2, 3] {
        let shapes: Vec<Vec<usize>> = c.spec().layers()[layer]
            .slots
            .iter()
            .map(|s| [&[4][..], &s.trailing].concat())
            .collect();
        let data: Vec<Vec<f32>> = shapes
            .iter()
            .map(|sh| values(3, sh.iter().product()))
            .collect();
        let slabs: Vec<HostSlab> = data
            .iter()
            .zip(&shapes)
            .map(|(d, sh)| HostSlab::f32(d, sh))
            .collect();
        c.append(layer, &slabs).unwrap();
    }
    let q = f32_buffer(&g.device, &values(4, 64)).await;
    let out = output(&g.device, 64).await;
    let before = read_f32(g, &out).await;
    let dflt = AttentionOptions::default();
    let mut gqa = |layer: usize, q: Queries<'_>, out: &wgpu::Buffer, o: &AttentionOptions| {
        att.gqa(&c, layer, q, out, o).unwrap_err()
    };

    let e = gqa(0, Queries::new(&q, 1, 4, 7), &out, &dflt);
    assert!(matches!(e, Error::QueryShape { layer: 0, .. }), "{e}");
    assert!(e.to_string().contains("[1, 4, 8]"), "{e}");
    let e = gqa(0, Queries::new(&q, 1, 3, 8), &out, &dflt);
    assert_eq!(
        e,
        Error::HeadGroups {
            layer: 0,
            n_heads: 3,
            n_kv_heads: 2
        }
    );
    let e = gqa(0, Queries::new(&q, 5, 2, 8), &out, &dflt);
    assert_eq!(
        e,
        Error::QueryRows {
            seq: None,
            layer: 0,
            n_q: 5,
            visible: 4
        }
    );
    let e = gqa(0, Queries::new(&q, 0, 2, 8), &out, &dflt);
    assert!(matches!(e, Error::QueryRows { n_q: 0, .. }), "{e}");
    let e = gqa(1, Queries::new(&q, 1, 2, 8), &out, &dflt);
    assert!(
        matches!(e, Error::NotAttentionLayer { layer: 1, .. }),
        "{e}"
    );
    let e = gqa(2, Queries::new(&q, 1, 2, 16), &out, &dflt);
    assert!(
        matches!(
            e,
            Error::NotAttentionLayer {
                layer: 2,
                kind: "GQA",
                ..
            }
        ),
        "{e}"
    );
    let e = gqa(3, Queries::new(&q, 1, 3, 8), &out, &dflt);
    assert!(
        matches!(e, Error::NotAttentionLayer { layer: 3, .. }),
        "{e}"
    );
    let e = gqa(9, Queries::new(&q, 1, 2, 8), &out, &dflt);
    assert!(matches!(e, Error::LayerOutOfRange { layer: 9, .. }), "{e}");
    let small = output(&g.device, 15).await;
    let e = gqa(0, Queries::new(&q, 1, 2, 8), &small, &dflt);
    assert_eq!(
        e,
        Error::BufferTooSmall {
            layer: 0,
            which: "output",
            shape: vec![1, 2, 8],
            needed: 64,
            size: 60
        }
    );
    let big_q = f32_buffer(&g.device, &values(7, 128)).await;
    let e = gqa(0, Queries::new(&big_q, 4, 4, 8), &out, &dflt);
    assert!(
        matches!(
            e,
            Error::BufferTooSmall {
                which: "output",
                ..
            }
        ),
        "{e}"
    );
    let e = gqa(
        0,
        Queries::new(&q, 4, 4, 8),
        &output(&g.device, 1024).await,
        &dflt,
    );
    assert!(
        matches!(
            e,
            Error::BufferTooSmall {
                which: "q",
                needed: 512,
                ..
            }
        ),
        "{e}"
    );
    let uniform = g.device.create_buffer(&wgpu::BufferDescriptor {
        label: None,
        size: 256,
        usage: wgpu::BufferUsages::UNIFORM,
        mapped_at_creation: false,
    });
    let e = gqa(0, Queries::new(&uniform, 1, 2, 8), &out, &dflt);
    assert!(
        matches!(
            e,
            Error::AttentionBuffer {
                which: "q",
                problem: BufferProblem::NoStorage { .. },
                ..
            }
        ),
        "{e}"
    );
    let e = gqa(
        0,
        Queries::new(&q, 1, 2, 8),
        c.view(0, 1).unwrap().buffer,
        &dflt,
    );
    assert!(
        matches!(
            e,
            Error::AttentionBuffer {
                which: "output",
                ..
            }
        ),
        "{e}"
    );
    for bad in [
        AttentionOptions {
            window: Some(0),
            ..dflt
        },
        AttentionOptions {
            soft_cap: Some(0.0),
            ..dflt
        },
        AttentionOptions {
            soft_cap: Some(f32::NAN),
            ..dflt
        },
        // Subnormal: a device that flushes it to zero would not cap at all.
        AttentionOptions {
            soft_cap: Some(f32::MIN_POSITIVE / 2.0),
            ..dflt
        },
        AttentionOptions {
            scale: Some(f32::INFINITY),
            ..dflt
        },
        // Subnormal: a device that flushes it to zero would zero every score.
        AttentionOptions {
            scale: Some(-f32::MIN_POSITIVE / 4.0),
            ..dflt
        },
    ] {
        let e = gqa(0, Queries::new(&q, 1, 2, 8), &out, &bad);
        // Each is refused for the option that is wrong in it (the others are the defaults).
        let named = match &e {
            Error::AttentionRequest { layer: 0, problem } => match problem {
                AttentionProblem::EmptyWindow => bad.window == Some(0),
                AttentionProblem::SoftCap { .. } => bad.soft_cap.is_some(),
                AttentionProblem::Scale { .. } => bad.scale.is_some(),
                _ => false,
            },
            _ => false,
        };
        assert!(named, "{bad:?}: {e}");
    }

    let ql = f32_buffer(&g.device, &values(5, 64)).await;
    let qr = f32_buffer(&g.device, &values(6, 16)).await;
    let mut mla = |layer: usize, a: Queries<'_>, b: Queries<'_>| {
        att.mla(&c, layer, MlaQueries { latent: a, rope: b }, &out, &dflt)
            .unwrap_err()
    };
    let e = mla(2, Queries::new(&ql, 1, 2, 16), Queries::new(&qr, 1, 2, 5));
    assert_eq!(
        e,
        Error::QueryShape {
            layer: 2,
            which: "q_rope",
            expected: vec![1, 2, 4],
            got: vec![1, 2, 5]
        }
    );
    let e = mla(2, Queries::new(&ql, 1, 2, 15), Queries::new(&qr, 1, 2, 4));
    assert!(
        matches!(
            e,
            Error::QueryShape {
                which: "q_latent",
                ..
            }
        ),
        "{e}"
    );
    let e = mla(0, Queries::new(&ql, 1, 2, 8), Queries::new(&qr, 1, 2, 8));
    assert!(
        matches!(
            e,
            Error::NotAttentionLayer {
                layer: 0,
                kind: "MLA",
                ..
            }
        ),
        "{e}"
    );
    assert_eq!(
        read_f32(g, &out).await,
        before,
        "a refused call wrote the output"
    );
    assert_eq!(c.visible(0).unwrap(), 4);
}

pub async fn the_subgroup_kernel_is_refused_by_name_where_there_are_no_subgroups(g: &Gpu) {
    if kernels(g).contains(&KernelChoice::StreamSubgroup) {
        super::skipped(
            "the subgroup kernel's refusal (this adapter has subgroups: the kernel itself is \
             checked by the reference tests)",
        );
        return;
    }
    let mut att = Attention::with_kernels(super::kernels_for(g));
    att.set_kernel(KernelChoice::StreamSubgroup);
    let c = filled(g, LayerSpec::kv(2, 64, 64), DType::F32, 40, 1, 5);
    let q = f32_buffer(&g.device, &values(6, 8 * 64)).await;
    let out = output(&g.device, 8 * 64).await;
    let e = att
        .gqa(
            &c,
            0,
            Queries::new(&q, 1, 8, 64),
            &out,
            &AttentionOptions::default(),
        )
        .unwrap_err();
    assert!(
        matches!(&e, Error::AttentionRequest {
            problem: AttentionProblem::DeviceLimit { limit: AttentionLimit::Kernel, detail }, ..
        } if detail.contains("SUBGROUP")),
        "{e}"
    );
    let untouched = read_f32(g, &out).await.iter().all(|&x| x == -7.0);
    assert!(untouched, "a refused call wrote");
}

/// One GQA call (the default kernel) over two rows whose scores are -4 and -2 before scaling, and
/// what the twin gives: the GPU's output, the twin's.
pub async fn gqa_of_two_scored_rows(g: &Gpu, options: AttentionOptions) -> (Vec<f32>, Vec<f32>) {
    let spec = CacheSpec::new(vec![LayerSpec::kv(1, 4, 4)], DType::F32, 4).unwrap();
    let mut c = cache_on(g, spec);
    let (k, v) = ([-1.0f32; 4], values(5, 4));
    let (k2, v2) = ([-0.5f32; 4], values(6, 4));
    for (k, v) in [(&k, &v), (&k2, &v2)] {
        c.append(
            0,
            &[HostSlab::f32(k, &[1, 1, 4]), HostSlab::f32(v, &[1, 1, 4])],
        )
        .unwrap();
    }
    let q_data = [1.0f32; 4];
    let q = f32_buffer(&g.device, &q_data).await;
    let out = output(&g.device, 4).await;
    let mut att = Attention::with_kernels(super::kernels_for(g));
    att.gqa(&c, 0, Queries::new(&q, 1, 1, 4), &out, &options)
        .unwrap();
    let want = reference::attention_gqa(
        &q_data,
        [1, 1, 4],
        &c.read_f32_async(0, 0).await.unwrap(),
        &c.read_f32_async(0, 1).await.unwrap(),
        1,
        4,
        &options,
    );
    (read_f32(g, &out).await, want)
}

/// A scale and a soft-cap at the edge of f32 (1e30 each) match the twin: the scaled scores lie
/// far below the kernels' first running max, and a cap so large that `tanh`'s argument underflows
/// (see `tests/hostile.rs`, which found both; this runs them in the browser too).
pub async fn scales_and_soft_caps_at_the_edge_of_f32_match_the_twin(g: &Gpu) {
    for options in [
        AttentionOptions {
            scale: Some(1e30),
            ..Default::default()
        },
        AttentionOptions {
            soft_cap: Some(1e30),
            ..Default::default()
        },
    ] {
        let (got, want) = gqa_of_two_scored_rows(g, options).await;
        assert_close(&got, &want, &format!("{options:?}"));
    }
}

/// Scores that rise by 100 from each row to the next, and scores near -200, over 5 rows with queries
/// that see 3, 4 and 5 of them, on every kernel: GQA (f32, 2 KV heads of 128) under a GPU's plans,
/// where teams with subgroups take two rows per loop iteration for f32, and DeepSeek's MLA (f32 and
/// f16) under the adapter's own, where a CPU adapter's subgroup teams take four. A step's running
/// max must be the largest of its rows' scores (with the first row's alone, a later row's weight
/// `exp(100)` overflows), and must leave out the rows the chunk does not have (a score of 0 would
/// zero the weights of scores below -87). Against the twins.
pub async fn steep_and_deep_scores_match_the_twin(g: &Gpu) {
    let (rows, n_q) = (5, 3);
    // Element 0 of row i's key (GQA) or latent (MLA); the queries are 1 there and 0 elsewhere, and
    // the scale is 1, so that is row i's score.
    let scores = [|i: usize| 100.0 * i as f32, |i: usize| -200.0 - i as f32];
    let options = AttentionOptions {
        scale: Some(1.0),
        ..Default::default()
    };
    let mut att = Attention::with_kernels(super::kernels_for(g));
    for gqa in [true, false] {
        att.plan_as_for_a_gpu(gqa);
        let dtypes: &[DType] = if gqa {
            &[DType::F32]
        } else {
            &[DType::F32, DType::F16]
        };
        // [n_kv, n_heads, d_a (K or the latent), d_b (k_pe), d_v]
        let [n_kv, n_heads, d_a, d_b, d_v] = if gqa {
            [2, 8, 128, 0, 128]
        } else {
            [1, 16, 512, 64, 512]
        };
        let shapes = if gqa {
            [vec![rows, n_kv, d_a], vec![rows, n_kv, d_v]]
        } else {
            [vec![rows, d_a], vec![rows, d_b]]
        };
        for kernel in kernels(g) {
            att.set_kernel(kernel);
            for &dtype in dtypes {
                for (k, score) in scores.iter().enumerate() {
                    let what = format!(
                        "{} {kernel:?} {dtype:?}, scores {k}",
                        ["MLA", "GQA"][usize::from(gqa)]
                    );
                    let layer = if gqa {
                        LayerSpec::kv(n_kv, d_a, d_v)
                    } else {
                        LayerSpec::mla(d_a, d_b)
                    };
                    let mut c = cache_on(g, CacheSpec::new(vec![layer], dtype, rows).unwrap());
                    // Slot 0 (K, or the latent, which is MLA's V too): the score in element 0 of
                    // each KV head, small values after it. Slot 1: V's values, or k_pe's zeros.
                    let mut a: Vec<f32> = values(90 + k as u64, rows * n_kv * d_a)
                        .iter()
                        .map(|x| x * 0.01)
                        .collect();
                    for i in 0..rows {
                        for kv in 0..n_kv {
                            a[(i * n_kv + kv) * d_a] = score(i);
                        }
                    }
                    let b = if gqa {
                        values(95 + k as u64, rows * n_kv * d_v)
                    } else {
                        vec![0.0; rows * d_b]
                    };
                    let slabs = [HostSlab::f32(&a, &shapes[0]), HostSlab::f32(&b, &shapes[1])];
                    c.append(0, &slabs).unwrap();
                    c.advance(rows).unwrap();
                    let mut qa = vec![0.0f32; n_q * n_heads * d_a];
                    for h in 0..n_q * n_heads {
                        qa[h * d_a] = 1.0;
                    }
                    let qb = vec![0.0f32; (n_q * n_heads * d_b).max(1)];
                    let (qa_buf, qb_buf) = (
                        f32_buffer(&g.device, &qa).await,
                        f32_buffer(&g.device, &qb).await,
                    );
                    let out = output(&g.device, n_q * n_heads * d_v).await;
                    let dims = [n_q, n_heads, d_a];
                    let result = if gqa {
                        att.gqa(
                            &c,
                            0,
                            Queries::new(&qa_buf, n_q, n_heads, d_a),
                            &out,
                            &options,
                        )
                    } else {
                        let queries = MlaQueries {
                            latent: Queries::new(&qa_buf, n_q, n_heads, d_a),
                            rope: Queries::new(&qb_buf, n_q, n_heads, d_b),
                        };
                        att.mla(&c, 0, queries, &out, &options)
                    };
                    if !ran(g, result, &att, &c, &out).await {
                        continue;
                    }
                    let (sa, sb) = (
                        c.read_f32_async(0, 0).await.unwrap(),
                        c.read_f32_async(0, 1).await.unwrap(),
                    );
                    let want = if gqa {
                        reference::attention_gqa(&qa, dims, &sa, &sb, n_kv, d_v, &options)
                    } else {
                        reference::attention_mla(&qa, &qb, dims, &sa, &sb, d_b, &options)
                    };
                    assert_close(&read_f32(g, &out).await, &want, &what);
                }
            }
        }
    }
}

/// `Attention::prepare` builds every pipeline the cache's attention layers need, once: a second call
/// builds none, the calls that follow on every attention layer run and match the twins and (on a
/// registry of its own) add no pipeline, and a head count that does not divide into a layer's KV
/// heads is refused.
pub async fn prepare_builds_the_pipelines_of_every_attention_layer_once(g: &Gpu) {
    // Shapes the other tests of the suite also run (their kernels compile once on the shared
    // registry): GQA with d_k != d_v and odd 16-bit dims (the storage of `gqa_matches`' cases 1 and
    // 7, see `storage_pairs`), MLA's small per-head rows. Every type: f32, and bf16 with f16.
    for kernel in [KernelChoice::Auto].into_iter().chain(kernels(g)) {
        for types in [[DType::F32; 2], [DType::BF16, DType::F16]] {
            // The default choice for f32 on a fresh kernel registry, so nothing is built before;
            // the rest on the run's shared one (a fresh registry recompiles everything, which cold
            // OpenGL pays in seconds: 18 pipelines here were built twice). The fresh one leaves the
            // odd layer out: its four tiled pipelines are the tiled kernel's, built on the shared
            // registry below.
            let fresh = kernel == KernelChoice::Auto && types[0] == DType::F32;
            let spec = |odd: bool| {
                let mut layers = vec![
                    stored_as(LayerSpec::kv(2, 128, 64), types),
                    LayerSpec::empty(),
                    LayerSpec::mla(32, 8),
                    stored_as(LayerSpec::kv(2, 33, 17), types),
                ];
                if !odd {
                    layers.pop();
                }
                CacheSpec::new(layers, types[0], 64).unwrap()
            };
            let mut c = cache_on(g, spec(!fresh));
            let registry = if fresh {
                Kernels::new(&g.device, &g.queue).unwrap()
            } else {
                super::kernels_for(g)
            };
            let mut att = Attention::with_kernels(registry.clone());
            att.set_kernel(kernel);
            let streams = matches!(
                kernel,
                KernelChoice::StreamShared
                    | KernelChoice::StreamSubgroup
                    | KernelChoice::StreamAlone
            );
            let e = att.prepare(&c, 3).unwrap_err();
            assert!(
                matches!(
                    e,
                    Error::HeadGroups {
                        layer: 0,
                        n_heads: 3,
                        n_kv_heads: 2
                    }
                ),
                "{e}"
            );
            if streams {
                // The odd layer is not a whole number of vectors: the forced kernel refuses it.
                // The cache without it is prepared below.
                let e = att.prepare(&c, 4).unwrap_err();
                assert!(
                    matches!(&e, Error::AttentionRequest { layer: 3, .. }),
                    "{e}"
                );
                c = cache_on(g, spec(false));
            }
            let n_layers = c.spec().n_layers();
            let built = att.prepare(&c, 4).unwrap();
            // The fresh registry holds what this prepare built (two pass-1 pipelines, GQA's and
            // MLA's, and more where shorter contexts take fewer rows per invocation) and the
            // reduces a call may take: on a CPU adapter 8 lanes, and 64 for a call whose chunks
            // would take 8 past the loop budget. The shared one holds the other tests' too.
            let held = registry.attention_pipelines();
            if fresh {
                let cpu = g.adapter.get_info().device_type == wgpu::DeviceType::Cpu;
                let reduces = if cpu { 2 } else { 1 };
                assert!(built >= 2, "{kernel:?} {types:?}: {built} pipelines");
                assert_eq!(held, built + reduces, "{kernel:?} {types:?}: {built} built");
            }
            assert_eq!(att.prepare(&c, 4).unwrap(), 0, "{kernel:?} {types:?}");
            for l in (0..n_layers).filter(|&l| l != 1) {
                append_random(&mut c, l, 9, 300 + l as u64);
            }
            c.advance(9).unwrap();
            let what = format!("{types:?} {kernel:?} after prepare");
            // Decode, and chunks of 4, 5 and 8 queries (on lavapipe teams of 4, and of 8: layer 0's
            // heads fit them).
            for n_q in [1, 4, 5, 8] {
                let what = format!("{n_q} queries, {what}");
                one_gqa_query(g, &mut att, &c, 0, [128, 64], n_q, 310, &what).await;
            }
            let options = AttentionOptions::default();
            // MLA (layer 2), decode and a chunk of 8, and the odd GQA layer 3, where there is one.
            for n_q in [1, 8] {
                let (ql, qr) = (values(311, n_q * 4 * 32), values(312, n_q * 4 * 8));
                let (qlb, qrb) = (
                    f32_buffer(&g.device, &ql).await,
                    f32_buffer(&g.device, &qr).await,
                );
                let out = output(&g.device, n_q * 4 * 32).await;
                let queries = MlaQueries {
                    latent: Queries::new(&qlb, n_q, 4, 32),
                    rope: Queries::new(&qrb, n_q, 4, 8),
                };
                att.mla(&c, 2, queries, &out, &options).unwrap();
                let want = reference::attention_mla(
                    &ql,
                    &qr,
                    [n_q, 4, 32],
                    &c.read_f32_async(2, 0).await.unwrap(),
                    &c.read_f32_async(2, 1).await.unwrap(),
                    8,
                    &options,
                );
                let what = format!("MLA, {n_q} queries, {what}");
                assert_close(&read_f32(g, &out).await, &want, &what);
            }
            if n_layers == 4 {
                let what = format!("odd, {what}");
                one_gqa_query(g, &mut att, &c, 3, [33, 17], 1, 313, &what).await;
            }
            // Nothing new was needed for those calls (nothing else runs on the shared registry
            // meanwhile: the suite's tests run one at a time).
            assert_eq!(
                registry.attention_pipelines(),
                held,
                "{kernel:?} {types:?}: the calls built pipelines prepare did not"
            );
        }
    }
}
/// `KernelChoice::Auto` takes the tiled kernel where the device refuses the streaming kernel it
/// plans (a generated kernel a device cannot compile; simulated, since software adapters compile
/// every one): `prepare` succeeds and builds the tiled pipelines, the call that follows matches
/// the twin and builds nothing more. A forced streaming kernel is refused by name, by the call and
/// by `prepare`.
pub async fn auto_takes_the_tiled_kernel_where_the_streaming_one_is_refused(g: &Gpu) {
    let c = filled(g, LayerSpec::kv(2, 8, 8), DType::F32, 300, 1, 140);
    let registry = super::kernels_for(g);
    let mut att = Attention::with_kernels(registry.clone());
    att.refuse_streaming_kernels(true);
    att.prepare(&c, 4).unwrap();
    let held = registry.attention_pipelines();
    one_gqa_query(
        g,
        &mut att,
        &c,
        0,
        [8, 8],
        1,
        141,
        "Auto, streaming kernel refused",
    )
    .await;
    assert_eq!(
        registry.attention_pipelines(),
        held,
        "the call built pipelines prepare did not"
    );
    assert_eq!(
        att.kernel(),
        KernelChoice::Auto,
        "the fallback became the choice"
    );
    let refused = |e: &Error| {
        matches!(
            e,
            Error::AttentionRequest {
                layer: 0,
                problem: AttentionProblem::DeviceLimit { limit: AttentionLimit::Kernel, detail },
            } if detail.contains("was refused")
        )
    };
    let q = f32_buffer(&g.device, &values(142, 4 * 8)).await;
    let out = output(&g.device, 4 * 8).await;
    for kernel in kernels(g).into_iter().filter(|&k| k != KernelChoice::Tiled) {
        att.set_kernel(kernel);
        let e = att.prepare(&c, 4).unwrap_err();
        assert!(refused(&e), "{kernel:?}: {e}");
        let e = att
            .gqa(
                &c,
                0,
                Queries::new(&q, 1, 4, 8),
                &out,
                &AttentionOptions::default(),
            )
            .unwrap_err();
        assert!(refused(&e), "{kernel:?}: {e}");
    }
    assert!(
        read_f32(g, &out).await.iter().all(|&x| x == -7.0),
        "a refused call wrote"
    );
}

/// One query of 4 heads over GQA layer `layer` of `c` (2 KV heads of `d_k` / `d_v` elements),
/// against the twin over its read-back.
#[allow(clippy::too_many_arguments)]
async fn one_gqa_query(
    g: &Gpu,
    att: &mut Attention,
    c: &KvCache,
    layer: usize,
    [d_k, d_v]: [usize; 2],
    n_q: usize,
    seed: u64,
    what: &str,
) {
    let q = values(seed, n_q * 4 * d_k);
    let qb = f32_buffer(&g.device, &q).await;
    let out = output(&g.device, n_q * 4 * d_v).await;
    let options = AttentionOptions::default();
    att.gqa(c, layer, Queries::new(&qb, n_q, 4, d_k), &out, &options)
        .unwrap();
    let want = reference::attention_gqa(
        &q,
        [n_q, 4, d_k],
        &c.read_f32_async(layer, 0).await.unwrap(),
        &c.read_f32_async(layer, 1).await.unwrap(),
        2,
        d_v,
        &options,
    );
    assert_close(&read_f32(g, &out).await, &want, what);
}

/// Element `(i, h, e)` of a view at `offset` along `strides`.
pub fn view_at(offset: usize, strides: [usize; 3], i: usize, h: usize, e: usize) -> usize {
    offset + i * strides[0] + h * strides[1] + e * strides[2]
}

/// The elements of `[n_q, n_heads, d]` at `offset` along `strides`, row-major.
pub fn gather(data: &[f32], offset: usize, shape: [usize; 3], strides: [usize; 3]) -> Vec<f32> {
    let bits: Vec<u32> = data.iter().map(|x| x.to_bits()).collect();
    reference::gather_strided(&bits, offset, &shape, &strides)
        .into_iter()
        .map(f32::from_bits)
        .collect()
}

/// A strided output of `shape` in a buffer of sentinels: where it starts, its strides and the
/// buffer's length (a few sentinels past the last element).
#[derive(Clone, Copy, Debug)]
pub struct OutView {
    pub offset: usize,
    pub strides: [usize; 3],
}

impl OutView {
    pub fn len(&self, shape: [usize; 3]) -> usize {
        view_at(
            self.offset,
            self.strides,
            shape[0] - 1,
            shape[1] - 1,
            shape[2] - 1,
        ) + 5
    }
}

/// Holds the strided output `got` (the whole buffer) to the row-major `want`, and every element
/// the view does not name to the sentinel.
pub fn assert_view_close(got: &[f32], view: OutView, shape: [usize; 3], want: &[f32], what: &str) {
    let mut named = vec![false; got.len()];
    let mut picked = Vec::with_capacity(want.len());
    for i in 0..shape[0] {
        for h in 0..shape[1] {
            for e in 0..shape[2] {
                let at = view_at(view.offset, view.strides, i, h, e);
                named[at] = true;
                picked.push(got[at]);
            }
        }
    }
    assert_close(&picked, want, what);
    for (at, (&x, &named)) in got.iter().zip(&named).enumerate() {
        assert!(
            named || x == -7.0,
            "{what}: element {at} outside the output view was written ({x})"
        );
    }
}

#[derive(Clone, Copy, Debug)]
struct FusedGqa {
    n_kv: usize,
    group: usize,
    d_k: usize,
    d_v: usize,
    visible: usize,
    n_q: usize,
    /// Elements before the first row of the fused buffer.
    pad: usize,
    out: OutView,
}

/// One GQA step whose queries, keys and values all come out of one fused buffer of rows
/// `[q | k | v]` (after `pad` elements), with its output written into a larger buffer.
async fn check_fused_gqa(
    g: &Gpu,
    att: &mut Attention,
    case: FusedGqa,
    types: [DType; 2],
    seed: u64,
) {
    let FusedGqa {
        n_kv,
        d_k,
        d_v,
        n_q,
        pad,
        ..
    } = case;
    let n_heads = n_kv * case.group;
    let spec = CacheSpec::new(
        vec![stored_as(LayerSpec::kv(n_kv, d_k, d_v), types)],
        types[0],
        case.visible.max(8),
    )
    .unwrap();
    let mut c = cache_on(g, spec);
    if case.visible > n_q {
        append_random(&mut c, 0, case.visible - n_q, seed);
        c.advance(case.visible - n_q).unwrap();
    }
    let (q_dim, k_dim) = (n_heads * d_k, n_kv * d_k);
    let width = q_dim + k_dim + n_kv * d_v;
    let fused = values(seed + 5, pad + n_q * width);
    let qkv = f32_buffer(&g.device, &fused).await;
    let (k_shape, v_shape) = ([n_q, n_kv, d_k], [n_q, n_kv, d_v]);
    let (k_strides, v_strides) = ([width, d_k, 1], [width, d_v, 1]);
    let k = GpuSlab {
        buffer: &qkv,
        dtype: DType::F32,
        offset: (pad + q_dim) as u64,
        shape: &k_shape,
        strides: Some(&k_strides),
    };
    let v = GpuSlab {
        offset: (pad + q_dim + k_dim) as u64,
        shape: &v_shape,
        strides: Some(&v_strides),
        ..k
    };
    c.append_gpu(0, &[k, v]).unwrap();
    let q_shape = [n_q, n_heads, d_k];
    let q_strides = [width, d_k, 1];
    let out_shape = [n_q, n_heads, d_v];
    let out = output(&g.device, case.out.len(out_shape)).await;
    let options = AttentionOptions::default();
    let result = att.gqa(
        &c,
        0,
        Queries::new(&qkv, n_q, n_heads, d_k)
            .at(pad)
            .with_strides(q_strides),
        Output::new(&out)
            .at(case.out.offset)
            .with_strides(case.out.strides),
        &options,
    );
    if !ran(g, result, att, &c, &out).await {
        return;
    }
    // The rows the append took are the fused buffer's K and V as stored (the twin below reads the
    // cache back, so a row taken from the wrong place would be on both sides of it).
    let kv = [
        (k_shape, k_strides, pad + q_dim),
        (v_shape, v_strides, pad + q_dim + k_dim),
    ];
    for (slot, ((shape, strides, at), dtype)) in kv.into_iter().zip(types).enumerate() {
        let elems = shape[1] * shape[2];
        let taken = reference::round_trip_rows(&gather(&fused, at, shape, strides), dtype, elems);
        let held = c.read_f32_async(0, slot).await.unwrap();
        assert_eq!(
            held[held.len() - n_q * elems..]
                .iter()
                .map(|x| x.to_bits())
                .collect::<Vec<_>>(),
            taken.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            "{types:?} {case:?}: slot {slot} rows taken from the fused buffer"
        );
    }
    let want = reference::attention_gqa(
        &gather(&fused, pad, q_shape, q_strides),
        q_shape,
        &c.read_f32_async(0, 0).await.unwrap(),
        &c.read_f32_async(0, 1).await.unwrap(),
        n_kv,
        d_v,
        &options,
    );
    let what = format!("{types:?} {case:?} {:?}", att.kernel());
    assert_view_close(&read_f32(g, &out).await, case.out, out_shape, &want, &what);
    assert_eq!(
        read_f32(g, &qkv).await,
        fused,
        "{what}: the queries' buffer changed"
    );
}

pub async fn gqa_reads_fused_qkv_rows_and_writes_a_strided_output(g: &Gpu) {
    let mut att = Attention::with_kernels(super::kernels_for(g));
    #[rustfmt::skip]
    let cases = [
        // Rows with a gap between them, at an element that is no binding offset.
        FusedGqa { n_kv: 2, group: 2, d_k: 16, d_v: 16, visible: 40, n_q: 3, pad: 3,
            out: OutView { offset: 5, strides: [4 * 16 + 7, 16, 1] } },
        // Head-major output, a query stride that is no multiple of 4 elements.
        FusedGqa { n_kv: 1, group: 4, d_k: 8, d_v: 24, visible: 70, n_q: 2, pad: 1,
            out: OutView { offset: 2, strides: [24, 2 * 24 + 1, 1] } },
        // Head dimensions only the tiled kernel takes; every visible row a query.
        FusedGqa { n_kv: 2, group: 1, d_k: 6, d_v: 5, visible: 4, n_q: 4, pad: 0,
            out: OutView { offset: 1, strides: [2 * 5 + 1, 5, 1] } },
        // Head-minor output: element stride = heads.
        FusedGqa { n_kv: 2, group: 4, d_k: 8, d_v: 8, visible: 300, n_q: 1, pad: 70,
            out: OutView { offset: 64, strides: [64, 1, 8] } },
    ];
    for kernel in kernels(g) {
        att.set_kernel(kernel);
        note!("-- fused QKV, {kernel:?}");
        for (i, &case) in cases.iter().enumerate() {
            for types in storage_pairs(&DType::ALL, i) {
                check_fused_gqa(g, &mut att, case, types, 90 + i as u64).await;
            }
        }
    }
}

#[derive(Clone, Copy, Debug)]
struct FusedMla {
    n_heads: usize,
    visible: usize,
    n_q: usize,
    pad: usize,
    out: OutView,
}

pub async fn mla_reads_per_head_latent_and_rope_rows_and_writes_a_strided_output(g: &Gpu) {
    let (r, p) = (32, 8);
    let mut att = Attention::with_kernels(super::kernels_for(g));
    #[rustfmt::skip]
    let cases = [
        FusedMla { n_heads: 4, visible: 50, n_q: 3, pad: 3,
            out: OutView { offset: 3, strides: [4 * 32 + 9, 32, 1] } },
        // The first case's heads: one kernel for both (each head count compiles its own).
        FusedMla { n_heads: 4, visible: 300, n_q: 1, pad: 64,
            out: OutView { offset: 1, strides: [0, 33, 1] } },
        FusedMla { n_heads: 2, visible: 5, n_q: 5, pad: 0,
            out: OutView { offset: 0, strides: [32, 5 * 32, 1] } },
        // The last case's heads, outputs at element 0 (a call of one chunk could write them in
        // place) with a gap between heads, then between queries: written through the view.
        FusedMla { n_heads: 2, visible: 5, n_q: 1, pad: 0,
            out: OutView { offset: 0, strides: [0, 33, 1] } },
        FusedMla { n_heads: 2, visible: 5, n_q: 5, pad: 0,
            out: OutView { offset: 0, strides: [67, 32, 1] } },
    ];
    for kernel in kernels(g) {
        att.set_kernel(kernel);
        for dtype in DType::ALL {
            note!("-- per-head [latent | rope] rows, {dtype} {kernel:?}");
            for (i, &case) in cases.iter().enumerate() {
                let FusedMla {
                    n_heads, n_q, pad, ..
                } = case;
                let seed = 120 + i as u64;
                let c = filled(g, LayerSpec::mla(r, p), dtype, case.visible, n_q, seed);
                // Each query's row: per head [latent | rope], then 5 more elements.
                let width = n_heads * (r + p) + 5;
                let fused = values(seed + 7, pad + n_q * width);
                let q = f32_buffer(&g.device, &fused).await;
                let strides = [width, r + p, 1];
                let out_shape = [n_q, n_heads, r];
                let out = output(&g.device, case.out.len(out_shape)).await;
                let options = AttentionOptions {
                    scale: Some(0.09),
                    ..AttentionOptions::default()
                };
                let queries = MlaQueries {
                    latent: Queries::new(&q, n_q, n_heads, r)
                        .at(pad)
                        .with_strides(strides),
                    rope: Queries::new(&q, n_q, n_heads, p)
                        .at(pad + r)
                        .with_strides(strides),
                };
                let result = att.mla(
                    &c,
                    0,
                    queries,
                    Output::new(&out)
                        .at(case.out.offset)
                        .with_strides(case.out.strides),
                    &options,
                );
                assert!(ran(g, result, &att, &c, &out).await);
                let want = reference::attention_mla(
                    &gather(&fused, pad, [n_q, n_heads, r], strides),
                    &gather(&fused, pad + r, [n_q, n_heads, p], strides),
                    [n_q, n_heads, r],
                    &c.read_f32_async(0, 0).await.unwrap(),
                    &c.read_f32_async(0, 1).await.unwrap(),
                    p,
                    &options,
                );
                let what = format!("{dtype} MLA {case:?} {kernel:?}");
                assert_view_close(&read_f32(g, &out).await, case.out, out_shape, &want, &what);
            }
        }
    }
}

/// Queries shared through a stride of 0: one query vector for every head, or one element for a
/// whole head. The kernels' bounds check once took a stride of 0 for 1, so it found such a view
/// longer than its binding, and the call skipped its work while it returned `Ok`. The views of one
/// element (GQA's `[0, 0, 0]`, MLA's rope) start within the first 32 bytes, so their binding holds
/// at most 8 elements whatever offset alignment the device has: fewer than the 8 they repeat, which
/// the old check refused. The shapes are those of the fused-QKV and per-head MLA tests (the same
/// pipelines).
pub async fn queries_shared_through_a_stride_of_0_are_read(g: &Gpu) {
    let mut att = Attention::with_kernels(super::kernels_for(g));
    let options = AttentionOptions::default();
    let gqa_cache = filled(g, LayerSpec::kv(2, 8, 8), DType::F32, 300, 1, 130);
    let mla_cache = filled(g, LayerSpec::mla(32, 8), DType::F32, 300, 1, 131);
    let q_data = values(132, 48);
    let q = f32_buffer(&g.device, &q_data).await;
    let rope_data = values(133, 200);
    let rope_q = f32_buffer(&g.device, &rope_data).await;
    let (k, v) = (
        gqa_cache.read_f32_async(0, 0).await.unwrap(),
        gqa_cache.read_f32_async(0, 1).await.unwrap(),
    );
    let (c_kv, k_pe) = (
        mla_cache.read_f32_async(0, 0).await.unwrap(),
        mla_cache.read_f32_async(0, 1).await.unwrap(),
    );
    let mut checked = 0;
    for kernel in kernels(g) {
        att.set_kernel(kernel);
        // Every head the same 8 elements; every element one value.
        for strides in [[0, 0, 1], [0, 0, 0]] {
            let shape = [1, 8, 8];
            let out = output(&g.device, 64).await;
            let queries = Queries::new(&q, 1, 8, 8).at(3).with_strides(strides);
            let result = att.gqa(&gqa_cache, 0, queries, Output::new(&out), &options);
            if !ran(g, result, &att, &gqa_cache, &out).await {
                continue;
            }
            let shared = gather(&q_data, 3, shape, strides);
            let want = reference::attention_gqa(&shared, shape, &k, &v, 2, 8, &options);
            let what = format!("GQA queries of strides {strides:?}, {kernel:?}");
            assert_close(&read_f32(g, &out).await, &want, &what);
            checked += 1;
        }
        // 4 heads: the latent one vector for all, the rope one element.
        let (latent, rope) = ([1, 4, 32], [1, 4, 8]);
        let (latent_strides, rope_strides) = ([0, 0, 1], [0, 0, 0]);
        let out = output(&g.device, 4 * 32).await;
        let queries = MlaQueries {
            latent: Queries::new(&q, 1, 4, 32).with_strides(latent_strides),
            rope: Queries::new(&q, 1, 4, 8).at(2).with_strides(rope_strides),
        };
        let result = att.mla(&mla_cache, 0, queries, Output::new(&out), &options);
        if !ran(g, result, &att, &mla_cache, &out).await {
            continue;
        }
        let want = reference::attention_mla(
            &gather(&q_data, 0, latent, latent_strides),
            &gather(&q_data, 2, rope, rope_strides),
            latent,
            &c_kv,
            &k_pe,
            8,
            &options,
        );
        let what = format!("MLA, latent shared by every head, rope one element, {kernel:?}");
        assert_close(&read_f32(g, &out).await, &want, &what);
        checked += 1;
        // The same latent view with the rope from another buffer, then from another binding of it
        // (element 130 lies past its first 256 bytes): each call reads its own rope.
        for at in [2, 130] {
            let queries = MlaQueries {
                rope: Queries::new(&rope_q, 1, 4, 8)
                    .at(at)
                    .with_strides(rope_strides),
                ..queries
            };
            att.mla(&mla_cache, 0, queries, Output::new(&out), &options)
                .unwrap();
            let want = reference::attention_mla(
                &gather(&q_data, 0, latent, latent_strides),
                &gather(&rope_data, at, rope, rope_strides),
                latent,
                &c_kv,
                &k_pe,
                8,
                &options,
            );
            let what = format!("MLA, rope at element {at} of another buffer, {kernel:?}");
            assert_close(&read_f32(g, &out).await, &want, &what);
        }
    }
    assert!(checked >= 3, "only {checked} calls ran");
}

pub async fn views_out_of_range_overflowing_overlapping_or_aliased_are_refused(g: &Gpu) {
    let mut att = Attention::with_kernels(super::kernels_for(g));
    let layers = vec![LayerSpec::kv(2, 8, 8), LayerSpec::mla(16, 4)];
    let mut c = cache_on(g, CacheSpec::new(layers, DType::F32, 16).unwrap());
    append_random(&mut c, 0, 4, 1);
    append_random(&mut c, 1, 4, 2);
    let q = f32_buffer(&g.device, &values(4, 64)).await;
    let out = output(&g.device, 64).await;
    let (q_before, out_before) = (read_f32(g, &q).await, read_f32(g, &out).await);
    let dflt = AttentionOptions::default();
    let q1 = Queries::new(&q, 1, 2, 8);
    let mut gqa = |q: Queries<'_>, out: Output<'_>| att.gqa(&c, 0, q, out, &dflt).unwrap_err();
    let unusable = |e: &Error, which: &str| match e {
        Error::AttentionBuffer {
            which: w, problem, ..
        } if *w == which => Some(problem.clone()),
        _ => None,
    };

    // 57 + 16 elements of a 64-element buffer.
    let e = gqa(q1.at(57), Output::new(&out));
    assert_eq!(
        e,
        Error::BufferTooSmall {
            layer: 0,
            which: "q",
            shape: vec![1, 2, 8],
            needed: 73 * 4,
            size: 256
        }
    );
    let e = gqa(q1, Output::new(&out).at(49));
    assert!(
        matches!(
            e,
            Error::BufferTooSmall {
                which: "output",
                needed: 260,
                ..
            }
        ),
        "{e}"
    );
    // Indices past 64 bits overflow; on 32-bit targets (wasm32) no usize offset does, and the view
    // is out of range.
    let overflow = |e: &Error, which: &str| {
        matches!(unusable(e, which), Some(BufferProblem::Overflow { .. }))
            || (usize::BITS < 64
                && matches!(e, Error::BufferTooSmall { which: w, .. } if *w == which))
    };
    for view in [
        q1.at(usize::MAX),
        q1.with_strides([0, usize::MAX, 1]),
        q1.at(usize::MAX / 8).with_strides([0, usize::MAX / 8, 1]),
    ] {
        let e = gqa(view, Output::new(&out));
        assert!(overflow(&e, "q"), "{e}");
    }
    let e = gqa(q1, Output::new(&out).at(usize::MAX));
    assert!(overflow(&e, "output"), "{e}");
    // Heads 4 elements apart with 8 elements each; every head on one address.
    for strides in [[16, 4, 1], [0, 0, 1], [16, 8, 0]] {
        let e = gqa(q1, Output::new(&out).with_strides(strides));
        assert!(
            matches!(
                unusable(&e, "output"),
                Some(BufferProblem::Overlapping { .. })
            ),
            "{strides:?}: {e}"
        );
    }
    // The output in the queries' own buffer, over them.
    let e = gqa(q1, Output::new(&q).at(8));
    assert_eq!(
        unusable(&e, "output"),
        Some(BufferProblem::AliasesQueries {
            which: "q",
            out: (32, 96),
            queries: (0, 64)
        }),
        "{e}"
    );
    // The output into a slot: of the layer read, and of another layer (large enough for it).
    let slot = c.view(0, 1).unwrap().buffer.clone();
    let e = gqa(q1, Output::new(&slot));
    assert_eq!(unusable(&e, "output"), Some(BufferProblem::IsSlot), "{e}");
    let other = c.full_view(1, 0).unwrap().buffer.clone();
    let e = gqa(q1, Output::new(&other));
    assert_eq!(unusable(&e, "output"), Some(BufferProblem::IsSlot), "{e}");

    // MLA: the output beside the latent queries, over the rope queries of the same buffer.
    let latent = Queries::new(&q, 1, 2, 16);
    let rope = Queries::new(&q, 1, 2, 4).at(40);
    let e = att
        .mla(
            &c,
            1,
            MlaQueries { latent, rope },
            Output::new(&q).at(32),
            &dflt,
        )
        .unwrap_err();
    assert!(
        matches!(
            unusable(&e, "output"),
            Some(BufferProblem::AliasesQueries {
                which: "q_rope",
                ..
            })
        ),
        "{e}"
    );
    assert_eq!(
        read_f32(g, &q).await,
        q_before,
        "a refused call wrote the queries"
    );
    assert_eq!(
        read_f32(g, &out).await,
        out_before,
        "a refused call wrote the output"
    );
    assert_eq!(c.visible(0).unwrap(), 4);

    // The output in the queries' own buffer after them, at a binding boundary (byte 256): taken, on
    // every kernel. A call of one chunk binds such an output in place of its partial results when it
    // is a buffer of its own; here it may not (one dispatch would read and write one buffer).
    let (k, v) = (
        c.read_f32_async(0, 0).await.unwrap(),
        c.read_f32_async(0, 1).await.unwrap(),
    );
    let want = reference::attention_gqa(&values(5, 16), [1, 2, 8], &k, &v, 2, 8, &dflt);
    for kernel in kernels(g) {
        att.set_kernel(kernel);
        // A fresh buffer per kernel: one an earlier kernel wrote would already hold the answer.
        let shared = f32_buffer(&g.device, &values(5, 128)).await;
        let q = Queries::new(&shared, 1, 2, 8);
        att.gqa(&c, 0, q, Output::new(&shared).at(64), &dflt)
            .unwrap();
        let got = read_f32(g, &shared).await;
        assert_close(
            &got[64..80],
            &want,
            &format!("{kernel:?}, output beside the queries"),
        );
        // Every other element (the queries among them) as it was.
        let before = values(5, 128);
        let (mut kept, mut was) = (got[..64].to_vec(), before[..64].to_vec());
        kept.extend_from_slice(&got[80..]);
        was.extend_from_slice(&before[80..]);
        assert_eq!(kept, was, "{kernel:?}: written outside the output");
        // In a buffer of its own, at a binding boundary and one element past it: a call of one
        // chunk may write such an output in place (its binding starting at the boundary, its view
        // at element 0 of it) or through the merge pass.
        for at in [64, 1] {
            let out = output(&g.device, 128).await;
            att.gqa(&c, 0, q, Output::new(&out).at(at), &dflt).unwrap();
            let view = OutView {
                offset: at,
                strides: [16, 8, 1],
            };
            let what = format!("{kernel:?}, output at element {at} of its own buffer");
            assert_view_close(&read_f32(g, &out).await, view, [1, 2, 8], &want, &what);
        }
        // A head's elements 16 apart, the heads 8 apart (as if contiguous), in a buffer of its
        // own from element 0: a call of one chunk, but pass 1 writes whole heads, so not in place.
        let out = output(&g.device, 128).await;
        let strides = [0, 8, 16];
        let every_other = Output::new(&out).with_strides(strides);
        att.gqa(&c, 0, q, every_other, &dflt).unwrap();
        let view = OutView { offset: 0, strides };
        let what = format!("{kernel:?}, output elements 16 apart");
        assert_view_close(&read_f32(g, &out).await, view, [1, 2, 8], &want, &what);
    }
}

/// The value of fp8 code `b` (`e4m3`: 4 exponent bits, else e5m2's 5), or `None` for infinity and
/// NaN: an independent decoding, for the exact-read check below.
fn fp8_value(b: u8, e4m3: bool) -> Option<f32> {
    let (m_bits, bias, top) = if e4m3 { (3, 7, 15) } else { (2, 15, 31) };
    let (e, m) = (
        ((b & 0x7f) >> m_bits) as i32,
        (b & ((1 << m_bits) - 1)) as f32,
    );
    let special = if e4m3 { b & 0x7f == 0x7f } else { e == top };
    let one = (1u32 << m_bits) as f32;
    let mag = match e {
        _ if special => return None,
        0 => m / one * 2f32.powi(1 - bias),
        _ => (1.0 + m / one) * 2f32.powi(e - bias),
    };
    Some(if b & 0x80 != 0 { -mag } else { mag })
}

/// Whether an attention output `got` is the value `stored` it should have read: its bits, but a zero
/// of either sign for a zero (the output sums weighted values from +0) and any NaN for a NaN.
fn read_as_stored(got: f32, stored: f32) -> bool {
    if stored.is_nan() {
        return got.is_nan();
    }
    got.to_bits() == stored.to_bits() || (got == 0.0 && stored == 0.0)
}

/// Rows and key width of [`attention_reads_every_stored_code_exactly`] and
/// [`fp8_nan_codes_read_as_nan`].
const ROWS: usize = 64;
const D_K: usize = 16;

/// Their keys and queries, `ROWS` of each: row i's key has 512 i in its first element (0 elsewhere)
/// and every query 1 there, so query i's score for row j is 512 j and its weights of the rows
/// before its own are exactly 0 (a softmax over scores 128 and more apart, at the scale 1/4).
fn code_keys_and_queries() -> (Vec<f32>, Vec<f32>) {
    let keys = (0..ROWS * D_K)
        .map(|i| {
            if i % D_K == 0 {
                (i / D_K) as f32 * 512.0
            } else {
                0.0
            }
        })
        .collect();
    let q = (0..ROWS * D_K).map(|i| f32::from(i % D_K == 0)).collect();
    (keys, q)
}

/// Attention reads every stored code exactly: every finite f16, bf16, e4m3 and e5m2 code, and q8_0 /
/// q4_0 blocks whose f16 scales run from zero through f16's subnormals to its large normals, in V
/// rows of 256 (where q8_0's scale vectors are shared by a team's steps and q4_0 is read in vectors
/// of 32 on 8 lanes) and, for the block types,
/// of 64 (68-byte q8_0 and 36-byte q4_0 rows, which the streaming kernel reads as words). Each row's key scores 128
/// above the previous row's, so causal query `i` weighs row `i` by exactly 1 and every other row by
/// exactly 0, and its output must equal row `i` as the cache reads it back (`read_f32`, decoded on
/// the CPU) exactly, not merely within the tolerance: on every kernel of the adapter. Exactly is bit
/// for bit but for the sign of a zero (the output sums weighted values from +0, so a -0 code comes
/// out +0), and bf16's codes below f32's normals may read as zero where the adapter flushes them.
pub async fn attention_reads_every_stored_code_exactly(g: &Gpu) {
    let mut att = Attention::with_kernels(super::kernels_for(g));
    let (keys, q) = code_keys_and_queries();
    let qb = f32_buffer(&g.device, &q).await;
    let f16_codes: Vec<half::f16> = (0..=u16::MAX)
        .filter(|b| b & 0x7c00 != 0x7c00)
        .map(half::f16::from_bits)
        .collect();
    let bf16_codes: Vec<half::bf16> = (0..=u16::MAX)
        .filter(|b| b & 0x7f80 != 0x7f80)
        .map(half::bf16::from_bits)
        .collect();
    let fp8 = |e4m3| {
        (0..=u8::MAX)
            .filter_map(|b| fp8_value(b, e4m3))
            .collect::<Vec<f32>>()
    };
    // Blocks of 32 scaled by 2^-32 .. 2^15: q8_0's scale (max / 127) and q4_0's (max / -8) go from
    // zero (below f16's subnormals) to f16's normals.
    let blocks: Vec<f32> = values(7, ROWS * 256)
        .iter()
        .enumerate()
        .map(|(i, x)| x * 2f32.powi((i / 32 % 48) as i32 - 32))
        .collect();
    for kernel in kernels(g) {
        att.set_kernel(kernel);
        for (dtype, d_v) in [
            (DType::F16, 256),
            (DType::BF16, 256),
            (DType::F8E4M3, 256),
            (DType::F8E5M2, 256),
            (DType::Q8_0, 256),
            (DType::Q8_0, 64),
            (DType::Q4_0, 256),
            (DType::Q4_0, 64),
        ] {
            // Each dtype's codes, as host data in batches of one cache's V rows (zero-padded).
            let batch = ROWS * d_v;
            let mut zeroed = 0;
            let n = match dtype {
                DType::F16 => f16_codes.len(),
                DType::BF16 => bf16_codes.len(),
                _ => batch,
            };
            for b in 0..n.div_ceil(batch) {
                let layer = stored_as(LayerSpec::kv(1, D_K, d_v), [DType::F32, dtype]);
                let mut c = cache_on(g, CacheSpec::new(vec![layer], DType::F32, ROWS).unwrap());
                let (k_shape, v_shape) = ([ROWS, 1, D_K], [ROWS, 1, d_v]);
                let k = HostSlab::f32(&keys, &k_shape);
                let range = b * batch..((b + 1) * batch).min(n);
                let pad = batch - range.len();
                let (h16, hb16): (Vec<half::f16>, Vec<half::bf16>);
                let f: Vec<f32> = match dtype {
                    DType::F8E4M3 | DType::F8E5M2 => {
                        let codes = fp8(dtype == DType::F8E4M3);
                        codes.iter().copied().cycle().take(batch).collect()
                    }
                    _ => Vec::new(),
                };
                let v = match dtype {
                    DType::F16 => {
                        h16 = [&f16_codes[range], &vec![half::f16::ZERO; pad][..]].concat();
                        HostSlab::f16(&h16, &v_shape)
                    }
                    DType::BF16 => {
                        hb16 = [&bf16_codes[range], &vec![half::bf16::ZERO; pad][..]].concat();
                        HostSlab::bf16(&hb16, &v_shape)
                    }
                    DType::F8E4M3 | DType::F8E5M2 => HostSlab::f32(&f, &v_shape),
                    _ => HostSlab::f32(&blocks[..batch], &v_shape),
                };
                c.append(0, &[k, v]).unwrap();
                let out = output(&g.device, batch).await;
                let result = att.gqa(
                    &c,
                    0,
                    Queries::new(&qb, ROWS, 1, D_K),
                    &out,
                    &AttentionOptions::default(),
                );
                if !ran(g, result, &att, &c, &out).await {
                    continue;
                }
                let stored = c.read_f32_async(0, 1).await.unwrap();
                if dtype.is_fp8() {
                    // Every code went in as its own value, so the cache keeps it unchanged.
                    let exact = stored
                        .iter()
                        .zip(&f)
                        .all(|(s, x)| s.to_bits() == x.to_bits());
                    assert!(
                        exact,
                        "{dtype}: the fp8 codes were not stored as themselves"
                    );
                }
                let got = read_f32(g, &out).await;
                // WGSL lets arithmetic flush f32's subnormals to zero (SwiftShader does): bf16 codes
                // below f32's smallest normal may come out as zero, and nothing else may differ.
                let flushed = |i: usize| got[i] == 0.0 && stored[i].is_subnormal();
                let same = |i: usize| read_as_stored(got[i], stored[i]);
                let wrong: Vec<usize> = (0..got.len())
                    .filter(|&i| !same(i) && !flushed(i))
                    .collect();
                zeroed += (0..got.len()).filter(|&i| got[i] != stored[i]).count();
                assert!(
                    wrong.is_empty(),
                    "{dtype} {kernel:?} batch {b}: {} of {} values differ, first at {} (row {}): {:e} \
                     read back as {:e}",
                    wrong.len(),
                    got.len(),
                    wrong[0],
                    wrong[0] / d_v,
                    got[wrong[0]],
                    stored[wrong[0]]
                );
            }
            note!(
                "{dtype} {kernel:?}, rows of {d_v}: {} of {n} values read exactly, {zeroed} f32 \
                 subnormals flushed to zero by the adapter",
                n - zeroed
            );
        }
    }
}

/// fp8's NaN codes read as NaN, on every kernel: e4m3's NaN (0x7f with either sign, the code
/// after its largest number 448) and e5m2's (0x7f with either sign; an append keeps a NaN as those,
/// and saturates infinities, so e5m2's infinity codes are never stored). Beside them every finite
/// code, as [`attention_reads_every_stored_code_exactly`] reads them, with its shapes, keys and
/// queries (its pipelines): the last row holds every code's value (NaN for a NaN code, of its sign),
/// the rows before it zeros, and the last query weighs the last row by exactly 1 and the others by
/// exactly 0, so its output is that row as stored; the queries before it do not see it (on
/// lavapipe, teams of several queries load it for them all), and theirs are zeros. Four caches per
/// kernel, the codes rotated by 0 to 3 elements, so that each NaN code lies in each byte of a word
/// once (a kernel may unpack a word's bytes differently).
pub async fn fp8_nan_codes_read_as_nan(g: &Gpu) {
    const D_V: usize = 256;
    let mut att = Attention::with_kernels(super::kernels_for(g));
    let (keys, q) = code_keys_and_queries();
    let qb = f32_buffer(&g.device, &q).await;
    let shapes = [[ROWS, 1, D_K], [ROWS, 1, D_V]];
    let all = kernels(g);
    let mut checks = 0;
    for dtype in [DType::F8E4M3, DType::F8E5M2] {
        let e4m3 = dtype == DType::F8E4M3;
        let sign = |b: u8| if b & 0x80 == 0 { 1.0 } else { -1.0 };
        // e5m2's infinity codes as infinities (stored as its largest numbers).
        let special = |b: u8| match b & 0x7f {
            0x7c if !e4m3 => f32::INFINITY,
            _ => f32::NAN,
        };
        let value = |b: u8| fp8_value(b, e4m3).unwrap_or(special(b).copysign(sign(b)));
        let layer = stored_as(LayerSpec::kv(1, D_K, D_V), [DType::F32, dtype]);
        for &kernel in &all {
            att.set_kernel(kernel);
            for turn in 0..4 {
                let mut v = vec![0.0f32; (ROWS - 1) * D_V];
                v.extend((0..D_V).map(|e| value((e + turn) as u8)));
                let spec = CacheSpec::new(vec![layer.clone()], DType::F32, ROWS).unwrap();
                let mut c = cache_on(g, spec);
                let slabs = [
                    HostSlab::f32(&keys, &shapes[0]),
                    HostSlab::f32(&v, &shapes[1]),
                ];
                c.append(0, &slabs).unwrap();
                let stored = c.read_f32_async(0, 1).await.unwrap();
                let last = &stored[(ROWS - 1) * D_V..];
                let nans = last.iter().filter(|x| x.is_nan()).count();
                assert_eq!(nans, if e4m3 { 2 } else { 6 }, "{dtype}: NaN codes stored");
                let out = output(&g.device, ROWS * D_V).await;
                let queries = Queries::new(&qb, ROWS, 1, D_K);
                let result = att.gqa(&c, 0, queries, &out, &AttentionOptions::default());
                assert!(ran(g, result, &att, &c, &out).await, "{dtype} {kernel:?}");
                let got = read_f32(g, &out).await;
                let (before, got) = got.split_at((ROWS - 1) * D_V);
                assert!(
                    before.iter().all(|&x| x == 0.0),
                    "{dtype} {kernel:?}: a query before the last row read something but zeros"
                );
                for (e, (&x, &w)) in got.iter().zip(last).enumerate() {
                    assert!(
                        read_as_stored(x, w),
                        "{dtype} {kernel:?}, turn {turn}: element {e} read as {x:e}, stored {w:e}"
                    );
                }
                checks += 1;
            }
        }
    }
    // Every kernel took the shape, each time.
    assert_eq!(checks, 2 * 4 * all.len(), "checks that ran");
}

/// An fp8 NaN code in a key (GQA), in MLA's latent (its keys and values) or in its rope key makes
/// every element of the outputs of the heads that read it NaN, on every kernel that takes the
/// shape (one-invocation teams refuse MLA's); the heads and queries that do not read it match the
/// twin. The code is what an append stores for a NaN (0x7f) and for a negative one (0xff), in a
/// row that the windows of the last three queries leave out, one KV head or slot at a time: GQA's
/// keys take it in every byte of a word with each sign, the latent and the rope key each in every
/// byte (two of them with each sign). [`fp8_nan_codes_read_as_nan`] reads the codes as values.
/// The shapes and options are those of `quantized_storage_matches_the_reference` (its pipelines).
pub async fn fp8_nan_codes_in_keys_make_their_scores_nan(g: &Gpu) {
    let mut att = Attention::with_kernels(super::kernels_for(g));
    // GQA in groups of one: query head h reads KV head h.
    let (rows, n_q, n_heads, d) = (65, 7, 4, 64);
    let (r, p) = (512, 64);
    // Queries 0 to 3 see the row (windows of 32 and 20 ending at rows 58 to 64).
    let (gqa_row, mla_row, seen) = (30, 42, |qi: usize| qi <= 3);
    let gqa_options = AttentionOptions {
        window: Some(32),
        soft_cap: Some(20.0),
        scale: None,
    };
    let mla_options = AttentionOptions {
        window: Some(20),
        soft_cap: Some(30.0),
        scale: Some(0.07),
    };
    let q = values(150, n_q * n_heads * d);
    let (ql, qr) = (
        values(151, n_q * n_heads * r),
        values(152, n_q * n_heads * p),
    );
    let (qb, qlb, qrb) = (
        f32_buffer(&g.device, &q).await,
        f32_buffer(&g.device, &ql).await,
        f32_buffer(&g.device, &qr).await,
    );
    let all = kernels(g);
    let (mut checks, mut mla_checks) = (0, 0);
    for dtype in [DType::F8E4M3, DType::F8E5M2] {
        for turn in 0..8 {
            // Byte `(turn + turn / 4) % 4` of word `turn`: every byte with each sign.
            let e = 4 * turn + (turn + turn / 4) % 4;
            let negative = turn >= 4;
            let nan = if negative { -f32::NAN } else { f32::NAN };
            // Stored as a NaN of that sign, there and nowhere else.
            let stored_once = |stored: &[f32], at: usize| {
                let nans: Vec<usize> = (0..stored.len()).filter(|&i| stored[i].is_nan()).collect();
                assert_eq!(nans, [at], "{dtype}, turn {turn}: NaN stored");
                assert_eq!(
                    stored[at].is_sign_negative(),
                    negative,
                    "{dtype}, turn {turn}"
                );
            };
            // GQA: KV head `turn % 4`.
            let head = turn % 4;
            let (mut k, v) = (
                values(153, rows * n_heads * d),
                values(154, rows * n_heads * d),
            );
            let at = (gqa_row * n_heads + head) * d + e;
            k[at] = nan;
            let layer = stored_as(LayerSpec::kv(n_heads, d, d), [dtype; 2]);
            let mut c = cache_on(g, CacheSpec::new(vec![layer], dtype, rows).unwrap());
            let shape = [rows, n_heads, d];
            c.append(0, &[HostSlab::f32(&k, &shape), HostSlab::f32(&v, &shape)])
                .unwrap();
            c.advance(rows).unwrap();
            let keys = c.read_f32_async(0, 0).await.unwrap();
            stored_once(&keys, at);
            let want = reference::attention_gqa(
                &q,
                [n_q, n_heads, d],
                &keys,
                &c.read_f32_async(0, 1).await.unwrap(),
                n_heads,
                d,
                &gqa_options,
            );
            let nan_head = |qi: usize, h: usize| seen(qi) && h == head;
            let what = format!("{dtype}, GQA key element {e} NaN");
            let dims = [n_heads, d];
            assert_nan_heads(&want, &want, dims, nan_head, &format!("the twin, {what}"));
            for &kernel in &all {
                att.set_kernel(kernel);
                let out = output(&g.device, n_q * n_heads * d).await;
                let queries = Queries::new(&qb, n_q, n_heads, d);
                let result = att.gqa(&c, 0, queries, &out, &gqa_options);
                assert!(ran(g, result, &att, &c, &out).await, "{dtype} {kernel:?}");
                let got = read_f32(g, &out).await;
                let what = format!("{kernel:?}, {what}");
                assert_nan_heads(&got, &want, dims, nan_head, &what);
                checks += 1;
            }
            // MLA: the latent in even turns, the rope key in odd ones (every head reads both).
            let (mut latent, mut rope) = (values(155, rows * r), values(156, rows * p));
            let (slot, at) = match turn % 2 {
                0 => (0, mla_row * r + e),
                _ => (1, mla_row * p + e),
            };
            [&mut latent, &mut rope][slot][at] = nan;
            let layer = stored_as(LayerSpec::mla(r, p), [dtype; 2]);
            let mut c = cache_on(g, CacheSpec::new(vec![layer], dtype, rows).unwrap());
            let shapes = [[rows, r], [rows, p]];
            let slabs = [
                HostSlab::f32(&latent, &shapes[0]),
                HostSlab::f32(&rope, &shapes[1]),
            ];
            c.append(0, &slabs).unwrap();
            c.advance(rows).unwrap();
            let stored = [
                c.read_f32_async(0, 0).await.unwrap(),
                c.read_f32_async(0, 1).await.unwrap(),
            ];
            stored_once(&stored[slot], at);
            assert!(!stored[1 - slot].iter().any(|x| x.is_nan()), "{dtype}");
            let want = reference::attention_mla(
                &ql,
                &qr,
                [n_q, n_heads, r],
                &stored[0],
                &stored[1],
                p,
                &mla_options,
            );
            let nan_head = |qi: usize, _| seen(qi);
            let what = format!(
                "{dtype}, MLA {} element {e} NaN",
                ["latent", "rope key"][slot]
            );
            let dims = [n_heads, r];
            assert_nan_heads(&want, &want, dims, nan_head, &format!("the twin, {what}"));
            for &kernel in &all {
                att.set_kernel(kernel);
                let out = output(&g.device, n_q * n_heads * r).await;
                let queries = MlaQueries {
                    latent: Queries::new(&qlb, n_q, n_heads, r),
                    rope: Queries::new(&qrb, n_q, n_heads, p),
                };
                // (`ran` checks a forced kernel's refusal of the shape.)
                let result = att.mla(&c, 0, queries, &out, &mla_options);
                if !ran(g, result, &att, &c, &out).await {
                    continue;
                }
                let got = read_f32(g, &out).await;
                let what = format!("{kernel:?}, {what}");
                assert_nan_heads(&got, &want, dims, nan_head, &what);
                mla_checks += 1;
            }
        }
    }
    // Every kernel took every GQA call, and every kernel but one-invocation teams every MLA call.
    let takes_mla = all
        .iter()
        .filter(|&&k| k != KernelChoice::StreamAlone)
        .count();
    assert_eq!((checks, mla_checks), (2 * 8 * all.len(), 2 * 8 * takes_mla));
}

/// Outputs of `[n_heads, d]` per query: every element of the heads `nan_head(query, head)` names is
/// NaN in `got`, and the other heads match the twin's (`want`), which are finite. With the twin's
/// outputs as `got`, it checks that they are NaN exactly there.
fn assert_nan_heads(
    got: &[f32],
    want: &[f32],
    [n_heads, d]: [usize; 2],
    nan_head: impl Fn(usize, usize) -> bool,
    what: &str,
) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (got, want)) in got.chunks(d).zip(want.chunks(d)).enumerate() {
        let (qi, h) = (i / n_heads, i % n_heads);
        if nan_head(qi, h) {
            let finite = got.iter().filter(|x| !x.is_nan()).count();
            assert_eq!(
                finite, 0,
                "{what}: query {qi} head {h} has {finite} elements not NaN: {got:?}"
            );
        } else {
            assert!(
                want.iter().all(|x| x.is_finite()),
                "{what}: the twin's query {qi} head {h} is not finite"
            );
            assert_close(got, want, &format!("{what}: query {qi} head {h}"));
        }
    }
}
