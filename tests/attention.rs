//! GQA / MHA and MLA attention on the GPU against the plain-Rust twins in `kvgpu::reference`, for every
//! storage type, on the adapter chosen by `WGPU_BACKEND` (CI runs this on llvmpipe GL and lavapipe).
//! The bodies live in `common/attention_bodies.rs` and `common/shared.rs` (the browser suite,
//! `tests/web.rs`, runs the same ones), held to the one tolerance `shared::TOL`.
#![cfg(not(target_arch = "wasm32"))]

mod common;

use common::*;
use kvgpu::reference;
use kvgpu::*;
use wgpu::util::DeviceExt;

// The tests of this file take `serial()`: on OpenGL every thread shares one context lock, which
// wgpu gives up on after 6 s, and a loaded software adapter can hold it that long for another thread.

fn storage(data: &[f32]) -> wgpu::Buffer {
    pollster::block_on(shared::f32_buffer(&gpu().device, data))
}

/// An output buffer of `n` f32 filled with a sentinel, so untouched outputs are visible.
fn output(n: usize) -> wgpu::Buffer {
    pollster::block_on(shared::output(&gpu().device, n))
}

fn read(buffer: &wgpu::Buffer) -> Vec<f32> {
    pollster::block_on(shared::read_f32(gpu(), buffer))
}

common::shared_tests!(attention_bodies, serial: serial;
    gqa_matches_the_reference_for_every_dtype,
    gpu_plans_match_the_reference,
    cpu_plans_of_32_bit_loads_match_the_reference,
    plans_of_the_other_mesa_match_the_reference,
    attention_reads_every_stored_code_exactly,
    fp8_nan_codes_read_as_nan,
    attention_over_4096_rows_splits_the_sequence,
    large_soft_caps_keep_their_precision,
    a_non_finite_element_stays_in_its_head,
    a_non_finite_row_stays_out_of_the_queries_that_do_not_see_it,
    a_nan_a_head_reads_makes_its_output_nan,
    mla_matches_the_reference_for_every_dtype,
    attention_sees_the_rows_left_by_truncate_and_reset,
    many_calls_with_different_parameters_share_one_encoder,
    bad_requests_are_refused_and_change_nothing,
    the_subgroup_kernel_is_refused_by_name_where_there_are_no_subgroups,
    prepare_builds_the_pipelines_of_every_attention_layer_once,
    gqa_reads_fused_qkv_rows_and_writes_a_strided_output,
    mla_reads_per_head_latent_and_rope_rows_and_writes_a_strided_output,
    queries_shared_through_a_stride_of_0_are_read,
    views_out_of_range_overflowing_overlapping_or_aliased_are_refused,
    views_bound_before_the_scratch_grew_are_bound_again,
    steep_and_deep_scores_match_the_twin,
);

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
    for types in [[DType::F32; 2], [DType::F16, DType::BF16]] {
        let visible = (g.limits().max_slot_bytes() / (64 * types[0].size()) as u64) as usize;
        pollster::block_on(shared::many_queries_over_a_long_context_see_every_row(
            g, types, visible,
        ));
    }
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
    // Natively wgpu tells a foreign query or output only when its bind group is made, after the
    // call's scratch buffers are: a refused call puts the scratch it had back (here none).
    assert_eq!(att.scratch_bytes(), 0);
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
    assert_eq!(att.scratch_bytes(), 0);
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
    assert_eq!(att.scratch_bytes(), 0);
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
    assert!(att.scratch_bytes() > 0);
    let want = reference::attention_gqa(&d, [1, 1, 8], &d, &d, 1, 8, &Default::default());
    assert_close(&read(&out), &want, "after refusals");
}

#[test]
fn attentions_preparing_on_many_threads_at_once_build_each_pipeline_once() {
    // The registry makes a pipeline outside its lock, once, by the first thread that needs it: the
    // pipelines that threads preparing one model at once build between them are as many as one
    // thread alone builds, and each thread's attention then matches the twin. Two fresh registries
    // (one for the thread alone), small heads: cold OpenGL compiles each variant twice. Software
    // adapters make a pipeline in well under a second, so the threads seldom meet inside the
    // registry here; `kernels`' unit test of its maps makes them meet.
    let _serial = serial();
    let g = gpu();
    let spec = CacheSpec::new(
        vec![LayerSpec::kv(2, 16, 16), LayerSpec::kv(1, 32, 32)],
        DType::F32,
        16,
    )
    .unwrap();
    let mut c = cache(spec);
    let rows: Vec<Vec<Vec<f32>>> = (0..2)
        .map(|l| append_random(&mut c, l, 7, 40 + l as u64))
        .collect();
    c.advance(7).unwrap();
    // The default kernels only: the tiled ones come from the same kind of map (its unit test in
    // `kernels` runs two keys at once and one key on eight threads), and cost cold OpenGL seconds.
    let registry = || Kernels::new(&g.device, &g.queue).unwrap();
    let alone = Attention::with_kernels(registry()).prepare(&c, 4).unwrap();
    assert!(alone >= 1, "{alone} pipelines");
    let (q, out_len) = (values(50, 4 * 32), 4 * 32);
    let qb = storage(&q);
    let shared = registry();
    let threads = 4;
    let start = std::sync::Barrier::new(threads);
    let built: Vec<usize> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads)
            .map(|t| {
                let (shared, start, c, qb) = (shared.clone(), &start, &c, &qb);
                let (rows, q) = (&rows, &q);
                s.spawn(move || {
                    let mut att = Attention::with_kernels(shared);
                    start.wait();
                    let built = att.prepare(c, 4).unwrap();
                    assert_eq!(att.prepare(c, 4).unwrap(), 0, "thread {t}");
                    for (layer, d) in [(0, 16), (1, 32)] {
                        let out = output(out_len);
                        let options = AttentionOptions::default();
                        att.gqa(c, layer, Queries::new(qb, 1, 4, d), &out, &options)
                            .unwrap();
                        let want = reference::attention_gqa(
                            &q[..4 * d],
                            [1, 4, d],
                            &rows[layer][0],
                            &rows[layer][1],
                            2 - layer,
                            d,
                            &options,
                        );
                        let got = read(&out);
                        assert_close(&got[..4 * d], &want, &format!("thread {t}, layer {layer}"));
                        assert!(
                            got[4 * d..].iter().all(|&x| x == -7.0),
                            "thread {t}, layer {layer}: written past the output"
                        );
                    }
                    built
                })
            })
            .collect();
        workers.into_iter().map(|w| w.join().unwrap()).collect()
    });
    assert_eq!(
        built.iter().sum::<usize>(),
        alone,
        "built per thread {built:?}"
    );
}
