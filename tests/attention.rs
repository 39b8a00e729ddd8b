//! GQA / MHA and MLA attention on the GPU against the plain-Rust twins in `kvgpu::reference`, for every
//! storage type, on the adapter chosen by `WGPU_BACKEND` (CI runs this on llvmpipe GL and lavapipe).
//!
//! Tolerance: the references read back the values the cache actually stores (`KvCache::read_f32`), so
//! 16-bit storage is compared exactly like f32, and accumulate in f64. The GPU accumulates in f32 with
//! its own `exp`, so an output may differ by `|gpu - cpu| <= 1e-5 · (1 + |cpu|)`: 1e-5 relative to
//! the values' scale (|v| < 2), and never looser for larger outputs.
#![cfg(not(target_arch = "wasm32"))]

mod common;

use common::*;
use kvgpu::reference;
use kvgpu::*;
use wgpu::util::DeviceExt;

/// Runs the tests of this file one at a time: on OpenGL every thread shares one context lock, which
/// wgpu gives up on after 6 s, and a loaded software adapter can hold it that long for another thread.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn storage(data: &[f32]) -> wgpu::Buffer {
    gpu()
        .device
        .create_buffer_init(&wgpu::util::BufferInitDescriptor {
            label: Some("test storage"),
            contents: bytemuck::cast_slice(data),
            usage: wgpu::BufferUsages::STORAGE
                | wgpu::BufferUsages::COPY_SRC
                | wgpu::BufferUsages::COPY_DST,
        })
}

/// An output buffer of `n` f32 filled with a sentinel, so untouched outputs are visible.
fn output(n: usize) -> wgpu::Buffer {
    storage(&vec![-7.0; n])
}

fn read(buffer: &wgpu::Buffer) -> Vec<f32> {
    let g = gpu();
    let bytes = kvgpu::read_buffer(&g.device, &g.queue, buffer, 0, buffer.size()).unwrap();
    bytemuck::pod_collect_to_vec(&bytes)
}

/// A one-layer cache with `visible` rows: `visible - n_q` committed, then `n_q` appended this step.
fn filled(layer: LayerSpec, dtype: DType, visible: usize, n_q: usize, seed: u64) -> KvCache {
    let mut c = cache(CacheSpec::new(vec![layer], dtype, visible.max(8)).unwrap());
    if visible > n_q {
        append_random(&mut c, 0, visible - n_q, seed);
        c.advance(visible - n_q).unwrap();
    }
    append_random(&mut c, 0, n_q, seed + 1);
    assert_eq!(c.visible(0).unwrap(), visible);
    c
}

/// Every pass-1 kernel this adapter can run: the tiled and the streaming kernel everywhere, the
/// streaming kernel with `subgroupAdd` where the device has subgroups of one size. Lavapipe has them
/// (subgroups of 8), so the Vulkan run of CI always tests all three; OpenGL has none, which is said.
fn kernels() -> Vec<KernelChoice> {
    let g = gpu();
    let info = g.adapter.get_info();
    let subgroups = g.device.features().contains(wgpu::Features::SUBGROUP)
        && info.subgroup_min_size == info.subgroup_max_size;
    if info.backend == wgpu::Backend::Vulkan && info.name.contains("llvmpipe") {
        assert!(subgroups, "lavapipe offers subgroups of 8: {info:?}");
    }
    let mut all = vec![KernelChoice::Tiled, KernelChoice::StreamShared];
    if subgroups {
        all.push(KernelChoice::StreamSubgroup);
    } else {
        eprintln!(
            "skipped here: KernelChoice::StreamSubgroup ({:?} has no subgroups of one size); \
             its refusal is tested instead",
            info.backend
        );
    }
    all
}

/// Whether the streaming kernels take these head dimensions (whole 16-byte vectors).
fn streamable(dtype: DType, dims: &[usize]) -> bool {
    let per_vec = if dtype == DType::F32 { 4 } else { 8 };
    dims.iter().all(|d| d % per_vec == 0)
}

/// The result of one call under `att`'s kernel: `Some` when it ran; `None` when a forced streaming
/// kernel refused a shape it cannot take (asserted to be that refusal, with nothing written).
fn ran(
    result: Result<()>,
    att: &Attention,
    dtype: DType,
    dims: &[usize],
    out: &wgpu::Buffer,
) -> bool {
    let forced_stream = matches!(
        att.kernel(),
        KernelChoice::StreamShared | KernelChoice::StreamSubgroup
    );
    if forced_stream && !streamable(dtype, dims) {
        let e = result.unwrap_err();
        assert!(
            matches!(
                &e,
                Error::AttentionRequest {
                    problem: AttentionProblem::DeviceLimit { .. },
                    ..
                }
            ),
            "{e}"
        );
        assert!(read(out).iter().all(|&x| x == -7.0), "a refused call wrote");
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
fn check_gqa(att: &mut Attention, case: Gqa, dtype: DType, seed: u64) -> f32 {
    let c = filled(
        LayerSpec::kv(case.n_kv, case.d_k, case.d_v),
        dtype,
        case.visible,
        case.n_q,
        seed,
    );
    let n_heads = case.n_kv * case.group;
    let q = values(seed + 99, case.n_q * n_heads * case.d_k);
    let qb = storage(&q);
    let out = output(case.n_q * n_heads * case.d_v);
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
    if !ran(result, att, dtype, &[case.d_k, case.d_v], &out) {
        return 0.0;
    }
    let want = reference::attention_gqa(
        &q,
        [case.n_q, n_heads, case.d_k],
        &c.read_f32(0, 0).unwrap(),
        &c.read_f32(0, 1).unwrap(),
        case.n_kv,
        case.d_v,
        &options,
    );
    let what = format!("{dtype} {case:?} {:?}", att.kernel());
    assert_close(&read(&out), &want, &what)
}

#[test]
fn gqa_matches_the_reference_for_every_dtype() {
    let _serial = serial();
    let g = gpu();
    let mut att = Attention::new(&g.device, &g.queue).unwrap();
    #[rustfmt::skip]
    let cases = [
        // MHA, a single visible row.
        Gqa { n_kv: 2, group: 1, d_k: 64, d_v: 64, visible: 1, n_q: 1, window: None, soft_cap: None },
        // d_v differs from d_k.
        Gqa { n_kv: 2, group: 4, d_k: 128, d_v: 64, visible: 2, n_q: 1, window: None, soft_cap: None },
        Gqa { n_kv: 1, group: 8, d_k: 64, d_v: 64, visible: 63, n_q: 7, window: None, soft_cap: Some(30.0) },
        Gqa { n_kv: 2, group: 4, d_k: 128, d_v: 128, visible: 64, n_q: 1, window: Some(16), soft_cap: None },
        Gqa { n_kv: 4, group: 1, d_k: 64, d_v: 64, visible: 65, n_q: 7, window: Some(32), soft_cap: Some(20.0) },
        Gqa { n_kv: 2, group: 4, d_k: 128, d_v: 128, visible: 1000, n_q: 7, window: None, soft_cap: None },
        // A group wider than one workgroup's 16 heads.
        Gqa { n_kv: 1, group: 20, d_k: 64, d_v: 64, visible: 100, n_q: 2, window: None, soft_cap: Some(5.0) },
        // Odd head dims: 16-bit heads that start in the middle of a word.
        Gqa { n_kv: 3, group: 2, d_k: 33, d_v: 17, visible: 70, n_q: 3, window: Some(9), soft_cap: None },
        // Enough workgroups per chunk that one chunk holds tiles of 8 rows per invocation, the last tile
        // partial (on CPU adapters), with a window and with odd 16-bit dims.
        Gqa { n_kv: 8, group: 4, d_k: 64, d_v: 32, visible: 600, n_q: 2, window: Some(550), soft_cap: None },
        Gqa { n_kv: 8, group: 2, d_k: 33, d_v: 17, visible: 700, n_q: 3, window: None, soft_cap: Some(30.0) },
    ];
    for kernel in kernels() {
        att.set_kernel(kernel);
        for_each_dtype(|dtype| {
            let worst = cases
                .iter()
                .enumerate()
                .map(|(i, &case)| check_gqa(&mut att, case, dtype, 10 + i as u64))
                .fold(0f32, f32::max);
            eprintln!("{dtype} {kernel:?}: worst scaled error {worst:e}");
        });
    }
}

#[test]
fn attention_over_4096_rows_splits_the_sequence() {
    let _serial = serial();
    let g = gpu();
    let mut att = Attention::new(&g.device, &g.queue).unwrap();
    #[rustfmt::skip]
    let cases = [
        Gqa { n_kv: 1, group: 8, d_k: 128, d_v: 128, visible: 4096, n_q: 1, window: None, soft_cap: None },
        Gqa { n_kv: 2, group: 4, d_k: 64, d_v: 64, visible: 4096, n_q: 7, window: Some(1000), soft_cap: Some(50.0) },
    ];
    let mla = Mla {
        n_heads: 16,
        visible: 4096,
        n_q: 1,
        window: None,
        soft_cap: None,
    };
    for kernel in kernels() {
        att.set_kernel(kernel);
        for_each_dtype(|dtype| {
            for (i, &case) in cases.iter().enumerate() {
                check_gqa(&mut att, case, dtype, 40 + i as u64);
            }
            check_mla(&mut att, mla, dtype, 50);
        });
    }
}

#[derive(Clone, Copy, Debug)]
struct Mla {
    n_heads: usize,
    visible: usize,
    n_q: usize,
    window: Option<usize>,
    soft_cap: Option<f32>,
}

fn check_mla(att: &mut Attention, case: Mla, dtype: DType, seed: u64) -> f32 {
    let (r, p) = (512, 64);
    let c = filled(LayerSpec::mla(r, p), dtype, case.visible, case.n_q, seed);
    let ql = values(seed + 77, case.n_q * case.n_heads * r);
    let qr = values(seed + 78, case.n_q * case.n_heads * p);
    let (qlb, qrb) = (storage(&ql), storage(&qr));
    let out = output(case.n_q * case.n_heads * r);
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
    assert!(ran(result, att, dtype, &[r, p], &out));
    let want = reference::attention_mla(
        &ql,
        &qr,
        [case.n_q, case.n_heads, r],
        &c.read_f32(0, 0).unwrap(),
        &c.read_f32(0, 1).unwrap(),
        p,
        &options,
    );
    let what = format!("{dtype} MLA {case:?} {:?}", att.kernel());
    assert_close(&read(&out), &want, &what)
}

#[test]
fn mla_matches_the_reference_for_every_dtype() {
    let _serial = serial();
    let g = gpu();
    let mut att = Attention::new(&g.device, &g.queue).unwrap();
    #[rustfmt::skip]
    let cases = [
        Mla { n_heads: 16, visible: 1, n_q: 1, window: None, soft_cap: None },
        Mla { n_heads: 4, visible: 65, n_q: 7, window: Some(20), soft_cap: Some(30.0) },
        Mla { n_heads: 20, visible: 130, n_q: 2, window: None, soft_cap: None },
        Mla { n_heads: 16, visible: 1000, n_q: 1, window: None, soft_cap: Some(50.0) },
    ];
    for kernel in kernels() {
        att.set_kernel(kernel);
        for_each_dtype(|dtype| {
            for (i, &case) in cases.iter().enumerate() {
                check_mla(&mut att, case, dtype, 60 + i as u64);
            }
        });
    }
}

#[test]
fn many_queries_over_2048_rows_of_deepseek_v2_lite_mla() {
    // 16 queries over 2,048 rows with DeepSeek-V2-Lite's shapes: off by 0.099 on lavapipe while one
    // workgroup walked the whole context past Mesa's loop limit.
    let _serial = serial();
    for_each_dtype(|dtype| {
        pollster::block_on(shared::deepseek_v2_lite_mla_matches_the_reference(
            gpu(),
            dtype,
            2048,
            16,
        ));
    });
}

#[test]
fn many_queries_over_the_longest_context_a_slot_holds_see_every_row() {
    // The worst case for the loop limit: 16 queries over as many rows as one slot of the device's
    // binding limit holds (128 MiB on llvmpipe and lavapipe), K = 0 and V's element e bit e of the row
    // index, so every dropped tile shows (see the shared body).
    let _serial = serial();
    let g = gpu();
    for dtype in [DType::F32, DType::BF16] {
        let visible = (g.limits().max_slot_bytes() / (64 * dtype.size()) as u64) as usize;
        pollster::block_on(shared::many_queries_over_a_long_context_see_every_row(
            g, dtype, visible,
        ));
    }
}

#[test]
fn attention_sees_the_rows_left_by_truncate_and_reset() {
    let _serial = serial();
    let g = gpu();
    let mut att = Attention::new(&g.device, &g.queue).unwrap();
    for_each_dtype(|dtype| {
        let mut c = cache(CacheSpec::new(vec![LayerSpec::kv(2, 64, 64)], dtype, 256).unwrap());
        let (n_q, n_heads) = (3, 4);
        let q = values(5, n_q * n_heads * 64);
        let qb = storage(&q);
        let out = output(n_q * n_heads * 64);
        let options = AttentionOptions::default();
        let check = |att: &mut Attention, c: &KvCache, what: &str| {
            att.gqa(c, 0, Queries::new(&qb, n_q, n_heads, 64), &out, &options)
                .unwrap();
            let want = reference::attention_gqa(
                &q,
                [n_q, n_heads, 64],
                &c.read_f32(0, 0).unwrap(),
                &c.read_f32(0, 1).unwrap(),
                2,
                64,
                &options,
            );
            assert_close(&read(&out), &want, &format!("{dtype} {what}"));
        };
        append_random(&mut c, 0, 200, 1);
        c.advance(200).unwrap();
        // Speculative rollback: the 3 new rows follow row 39, and rows 43.. of the old run are unseen.
        c.truncate(40).unwrap();
        append_random(&mut c, 0, n_q, 2);
        assert_eq!(c.visible(0).unwrap(), 43);
        check(&mut att, &c, "after truncate");
        c.advance(n_q).unwrap();
        c.reset();
        append_random(&mut c, 0, n_q, 3);
        check(&mut att, &c, "after reset");
        c.advance(n_q).unwrap();
        c.reset_fast();
        append_random(&mut c, 0, n_q + 1, 4);
        check(&mut att, &c, "after reset_fast");
    });
}

#[test]
fn many_calls_with_different_parameters_share_one_encoder() {
    let _serial = serial();
    let g = gpu();
    let mut att = Attention::new(&g.device, &g.queue).unwrap();
    let layers = vec![
        LayerSpec::kv(2, 64, 64),
        LayerSpec::empty(),
        LayerSpec::kv(1, 128, 32),
    ];
    let mut c = cache(CacheSpec::new(layers, DType::F16, 300).unwrap());
    for layer in [0, 2] {
        append_random(&mut c, layer, 300, layer as u64 + 1);
    }
    let q0 = values(1, 6 * 64);
    let q2 = values(2, 4 * 128);
    let (q0b, q2b) = (storage(&q0), storage(&q2));
    let (out0, out2) = (output(6 * 64), output(4 * 32));
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
        Queries::new(&q2b, 1, 4, 128),
        &out2,
        &o2,
    )
    .unwrap();
    g.queue.submit([encoder.finish()]);
    let want0 = reference::attention_gqa(
        &q0,
        [1, 6, 64],
        &c.read_f32(0, 0).unwrap(),
        &c.read_f32(0, 1).unwrap(),
        2,
        64,
        &o0,
    );
    let want2 = reference::attention_gqa(
        &q2,
        [1, 4, 128],
        &c.read_f32(2, 0).unwrap(),
        &c.read_f32(2, 1).unwrap(),
        1,
        32,
        &o2,
    );
    assert_close(&read(&out0), &want0, "layer 0");
    assert_close(&read(&out2), &want2, "layer 2");
}

#[test]
fn bad_requests_are_refused_and_change_nothing() {
    let _serial = serial();
    let g = gpu();
    let mut att = Attention::new(&g.device, &g.queue).unwrap();
    let layers = vec![
        LayerSpec::kv(2, 8, 8),
        LayerSpec::empty(),
        LayerSpec::mla(16, 4),
        LayerSpec::new(vec![SlotSpec::new("qkv", &[3, 8])]),
    ];
    let mut c = cache(CacheSpec::new(layers, DType::F32, 16).unwrap());
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
    let q = storage(&values(4, 64));
    let out = output(64);
    let before = read(&out);
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
    let small = output(15);
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
    let big_q = storage(&values(7, 128));
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
    let e = gqa(0, Queries::new(&q, 4, 4, 8), &output(1024), &dflt);
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
        AttentionOptions {
            scale: Some(f32::INFINITY),
            ..dflt
        },
    ] {
        let e = gqa(0, Queries::new(&q, 1, 2, 8), &out, &bad);
        assert!(matches!(e, Error::AttentionRequest { layer: 0, .. }), "{e}");
    }

    let ql = storage(&values(5, 64));
    let qr = storage(&values(6, 16));
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
    assert_eq!(read(&out), before, "a refused call wrote the output");
    assert_eq!(c.visible(0).unwrap(), 4);
}

#[test]
fn buffers_and_caches_of_another_device_are_refused() {
    let _serial = serial();
    let g = gpu();
    // A second device of the same adapter (and instance): wgpu compares devices and buffers by their
    // id within one instance, so that is where a foreign buffer can be told apart.
    let (device, queue) =
        pollster::block_on(g.adapter.request_device(&Default::default())).unwrap();
    let other = Gpu {
        adapter: g.adapter.clone(),
        device,
        queue,
    };
    let mut c = cache(CacheSpec::new(vec![LayerSpec::kv(1, 8, 8)], DType::F32, 4).unwrap());
    let d = values(1, 8);
    c.append(
        0,
        &[HostSlab::f32(&d, &[1, 1, 8]), HostSlab::f32(&d, &[1, 1, 8])],
    )
    .unwrap();
    let foreign = other
        .device
        .create_buffer_init(&wgpu::util::BufferInitDescriptor {
            label: Some("foreign"),
            contents: bytemuck::cast_slice(&[0f32; 8]),
            usage: wgpu::BufferUsages::STORAGE,
        });
    let q = storage(&d);
    let out = output(8);
    let mut att = Attention::new(&g.device, &g.queue).unwrap();
    let e = att
        .gqa(
            &c,
            0,
            Queries::new(&foreign, 1, 1, 8),
            &out,
            &Default::default(),
        )
        .unwrap_err();
    assert!(matches!(e, Error::ForeignDevice { layer: 0, .. }), "{e}");
    let e = att
        .gqa(
            &c,
            0,
            Queries::new(&q, 1, 1, 8),
            &foreign,
            &Default::default(),
        )
        .unwrap_err();
    assert!(matches!(e, Error::ForeignDevice { layer: 0, .. }), "{e}");
    let mut elsewhere = Attention::new(&other.device, &other.queue).unwrap();
    let e = elsewhere
        .gqa(
            &c,
            0,
            Queries::new(&foreign, 1, 1, 8),
            &foreign,
            &Default::default(),
        )
        .unwrap_err();
    assert!(
        matches!(&e, Error::ForeignDevice { what, .. } if what.starts_with("cache")),
        "{e}"
    );
    // The refusals left the Attention usable.
    att.gqa(&c, 0, Queries::new(&q, 1, 1, 8), &out, &Default::default())
        .unwrap();
    let want = reference::attention_gqa(&d, [1, 1, 8], &d, &d, 1, 8, &Default::default());
    assert_close(&read(&out), &want, "after refusals");
}

#[test]
fn the_subgroup_kernel_is_refused_by_name_where_there_are_no_subgroups() {
    let _serial = serial();
    let g = gpu();
    if kernels().contains(&KernelChoice::StreamSubgroup) {
        eprintln!("this adapter has subgroups: the kernel itself is checked by the tests above");
        return;
    }
    let mut att = Attention::new(&g.device, &g.queue).unwrap();
    att.set_kernel(KernelChoice::StreamSubgroup);
    let c = filled(LayerSpec::kv(2, 64, 64), DType::F32, 40, 1, 5);
    let q = storage(&values(6, 8 * 64));
    let out = output(8 * 64);
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
        matches!(&e, Error::AttentionRequest { problem: AttentionProblem::DeviceLimit { detail }, .. }
            if detail.contains("SUBGROUP")),
        "{e}"
    );
    assert!(
        read(&out).iter().all(|&x| x == -7.0),
        "a refused call wrote"
    );
}
