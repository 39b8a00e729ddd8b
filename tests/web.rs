//! The browser suite: runs in headless Chromium over WebGPU (`cargo test --target
//! wasm32-unknown-unknown`, flags in `webdriver.json`; `.ci/browser` runs it with a longer timeout).
//! Every test opens the browser's adapter and fails when there is none. The tests run the async
//! bodies of `common/` that the native suites run too (`tests/core.rs`, `gpu_source.rs`,
//! `attention.rs`, `limits.rs`, `safety.rs`, `paged.rs`, `snapshot.rs`, `quant.rs`, `memory.rs`,
//! `model.rs`), with the same helpers and the one tolerance `shared::TOL`.
//!
//! Native only, and why:
//! - `hostile.rs`: each case checks that a native call refuses or works without a wgpu panic (the
//!   browser's refusals are the shared bodies'). Its checks of kernels against the twins run here
//!   too: a scale or soft-cap at the edge of f32 (`scales_and_soft_caps_at_the_edge_of_f32_...`);
//!   zeroing, slab writes and attention on a device allowing 8 workgroups per dimension are native
//!   only (a browser device has WebGPU's 65,535 at least).
//! - `device.rs` (but for its lost device, whose body is shared and runs below), `attention.rs`'s
//!   foreign-device test and `snapshot.rs`'s move between Vulkan and OpenGL: several devices,
//!   instances or backends in one process (the browser's own foreign buffer and queue tests are
//!   below).
//! - `attention.rs`'s prepare on many threads at once: threads.
//! - `out_of_memory.rs`: it caps the process's address space.
//! - `memory.rs`'s refused attention and refused GPU append: they read the device's live buffers
//!   and bytes, which only native wgpu counts (the shared memory bodies follow buffers through a
//!   garbage collection in the browser instead).
//! - `limits.rs`'s slot of exactly the binding limit: 128 MiB filled from the host and read back
//!   whole (the shared body of that file, the slot over the limit, runs here).
//! - Native calls or blocking ones: `safety.rs`'s `verify_buffer` over every usage (the browser
//!   verifies its buffers in the tests below), the accessors of `core.rs` (a native test of
//!   `KvCache`'s and `PagedCache`'s getters, not shared as a body), the blocking exports of
//!   `snapshot.rs`, and `model.rs`'s property test (its seeded run is here).
#![cfg(target_arch = "wasm32")]

#[path = "common/shared.rs"]
mod shared;

use kvgpu::wgpu;
use kvgpu::{DType, DeviceLimits, Gpu};
use shared::{Stopwatch, note};
use wasm_bindgen_test::{wasm_bindgen_test, wasm_bindgen_test_configure};

wasm_bindgen_test_configure!(run_in_browser);

/// The browser's WebGPU adapter; none is a failure, never a skip. An error WebGPU reported that no
/// scope caught, left from an earlier test, fails this one (each test also checks its own at its
/// end: `checked`).
async fn gpu() -> Gpu {
    let gpu = Gpu::from_env().await.unwrap_or_else(|e| {
        panic!(
            "the browser suite needs a WebGPU adapter and found none: {e}; run Chromium with \
             --enable-unsafe-webgpu (see webdriver.json)"
        )
    });
    assert_eq!(
        gpu.adapter.get_info().backend,
        wgpu::Backend::BrowserWebGpu,
        "the browser suite must run on the browser's WebGPU, not {}",
        gpu.describe()
    );
    shared::keep_for_the_suite(&gpu);
    shared::assert_no_uncaptured_errors(&gpu, "before this test (late errors of an earlier one)")
        .await;
    gpu
}

/// Fails the test on any error WebGPU reported during it that no scope caught: kvgpu must trigger
/// none (natively wgpu panics on them).
async fn checked(g: &Gpu) {
    shared::assert_no_uncaptured_errors(g, "during this test").await;
}

/// Browser tests that run shared bodies of `module` on the browser's adapter, one test per body,
/// named after it.
macro_rules! browser_tests {
    ($module:ident: $($name:ident),+ $(,)?) => {
        $(
            #[wasm_bindgen_test]
            async fn $name() {
                let g = gpu().await;
                shared::$module::$name(&g).await;
                checked(&g).await;
            }
        )+
    };
}

/// Browser tests named before their bodies were shared: `test => module::body`.
macro_rules! renamed_browser_tests {
    ($($name:ident => $module:ident::$body:ident),+ $(,)?) => {
        $(
            #[wasm_bindgen_test]
            async fn $name() {
                let g = gpu().await;
                shared::$module::$body(&g).await;
                checked(&g).await;
            }
        )+
    };
}

#[wasm_bindgen_test]
async fn browser_adapter_is_webgpu() {
    let g = gpu().await;
    let limits = g.limits();
    note!("kvgpu browser suite on {} with {limits:?}", g.describe());
    checked(&g).await;
    assert!(
        limits.max_slot_bytes() >= DeviceLimits::WEBGPU_DEFAULT.max_storage_buffer_binding_size,
        "a WebGPU device binds at least the WebGPU default: {limits:?}"
    );
}

// tests/core.rs and tests/limits.rs.
browser_tests!(cache_bodies:
    gqa_prefill_then_decode,
    rank_3_slot_and_odd_widths,
    layers_are_isolated_and_hybrid_layers_own_nothing,
    full_capacity_then_overflow_then_truncate_and_reappend,
    recorded_ops_share_one_encoder,
    views_narrow_to_visible_rows,
    destroyed_buffers_are_not_read_back,
    scrub_matches_the_zero_twin_at_every_word_offset,
    parameters_move_on_to_fresh_buffers_inside_one_batch,
    a_sequence_moves_between_caches,
    append_layers_writes_every_layer_in_one_upload,
);

renamed_browser_tests!(
    mla_append_over_steps_matches_cpu_model => cache_bodies::mla_decode_steps_read_back_in_order,
    refused_operations_leave_the_cache_unchanged => cache_bodies::every_refusal_leaves_the_cache_unchanged,
    reset_and_scrub_zero_the_gpu_memory => cache_bodies::reset_zeroes_every_byte_and_reset_fast_keeps_data,
    f16_and_bf16_storage_is_bit_exact => cache_bodies::host_data_already_in_the_storage_type_is_stored_as_is,
    slot_beyond_the_device_limit_is_refused => cache_bodies::slot_over_the_binding_limit_is_refused_with_the_capacity_that_fits,
    gqa_attention_prefill_and_decode_match_the_cpu_twin => attention_bodies::gqa_matches_the_reference_for_every_dtype,
    mla_attention_decode_matches_the_cpu_twin => attention_bodies::mla_matches_the_reference_for_every_dtype,
);

// tests/gpu_source.rs.
browser_tests!(source_bodies:
    fused_qkv_k_and_v_go_straight_into_the_cache,
    gqa_prefill_then_decode_from_fused_qkv,
    head_major_source_is_transposed_into_rows,
    conversion_matches_half_bit_for_bit,
    contiguous_same_type_and_odd_offsets,
    refused_sources_change_nothing,
    many_recorded_appends_in_one_encoder,
    sources_of_spread_elements_are_gathered,
);

// tests/attention.rs.
browser_tests!(attention_bodies:
    attention_reads_every_stored_code_exactly,
    fp8_nan_codes_read_as_nan,
    fp8_nan_codes_in_keys_make_their_scores_nan,
    gpu_plans_match_the_reference,
    cpu_plans_of_32_bit_loads_match_the_reference,
    plans_of_the_other_mesa_match_the_reference,
    quantized_storage_matches_the_reference,
    mixed_storage_matches_the_reference,
    quantized_attention_over_4096_rows_splits_the_sequence,
    quantized_gpu_plans_match_the_reference,
    wide_unaligned_fp8_heads_stay_within_the_loop_budget,
    attention_over_4096_rows_splits_the_sequence,
    large_soft_caps_keep_their_precision,
    a_non_finite_element_stays_in_its_head,
    a_non_finite_row_stays_out_of_the_queries_that_do_not_see_it,
    a_nan_a_head_reads_makes_its_output_nan,
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
    scales_and_soft_caps_at_the_edge_of_f32_match_the_twin,
    steep_and_deep_scores_match_the_twin,
    auto_takes_the_tiled_kernel_where_the_streaming_one_is_refused,
);

// tests/model.rs: fixed pseudo-random operation sequences instead of proptest's.
browser_tests!(model_bodies: pseudo_random_operations_match_the_model);

// tests/paged.rs.
browser_tests!(paged_bodies:
    prepare_paged_builds_what_the_calls_use,
    a_batch_copies_a_shared_page_before_writing_into_it,
    a_source_appended_again_across_a_page_binds_its_own_row_map,
    paged_pool_matches_the_model,
    paged_attention_matches_the_reference,
    long_paged_sequences_match_the_reference,
    ragged_batches_read_strided_views_windows_and_split_pairs,
    paged_pool_sizes_are_checked,
    paged_sources_of_another_device_are_refused,
    batched_appends_match_one_by_one,
    many_sequences_grow_the_page_table,
    scattered_appends_take_every_source,
    published_prefixes_start_sequences_from_their_pages,
    sequences_of_another_pool_are_refused,
    recorded_appends_change_the_table_in_encoder_order,
    attention_recorded_before_the_table_grows_sees_later_entries,
    many_runs_of_host_rows_land_alike_whichever_way_they_move,
    scrubbing_zeroes_the_rows_no_one_holds,
    a_recorded_copy_keeps_its_page_until_the_encoder_is_done,
    encoders_keep_what_a_removal_or_truncation_takes,
    a_recorded_step_of_writers_from_different_rows_is_admitted_whole,
);

// tests/snapshot.rs (its Vulkan-to-OpenGL test is native only; here snapshots move between two
// WebGPU devices, and the pinned bytes of a seeded cache show SwiftShader writes what Vulkan and
// OpenGL write).
browser_tests!(snapshot_bodies:
    snapshots_round_trip_bit_for_bit,
    pool_sequences_and_forks_round_trip,
    refused_snapshots_change_nothing,
    snapshots_move_between_devices,
    the_snapshot_of_a_seeded_cache_is_the_same_on_every_backend,
    streamed_imports_match_whole_ones,
    a_failing_writer_stops_the_export,
    a_failing_reader_stops_the_import,
    a_longest_sequence_past_32_bits_restores_everywhere,
    imported_rows_get_zero_padding,
);

// tests/quant.rs.
browser_tests!(quant_bodies:
    host_rows_are_stored_as_the_twin_quantizes_them,
    gpu_sources_are_quantized_as_the_twin_does,
    quantized_specs_and_sources_are_checked,
    quantized_caches_take_the_bytes_they_promise,
    mixed_storage_takes_every_append_path,
    scaled_fp8_gpu_sources_store_the_host_codes_at_any_scale,
);

// tests/memory.rs: buffers followed through their GPUBuffer objects and a full garbage collection.
browser_tests!(memory_bodies:
    one_attention_serving_many_dropped_caches_keeps_none_of_them,
    a_cache_appending_from_many_dropped_sources_keeps_few_of_them,
    release_memory_lets_go_of_the_scratch_and_the_app_buffers,
);

// The defects of tests/safety.rs and tests/attention.rs.

#[wasm_bindgen_test]
async fn a_16_bit_source_ending_inside_a_word_is_refused_before_recording() {
    let g = gpu().await;
    shared::a_16_bit_source_ending_inside_a_word_is_refused_before_recording(&g).await;
    checked(&g).await;
}

#[wasm_bindgen_test]
async fn thousands_of_recorded_appends_in_one_encoder_keep_their_own_parameters() {
    let g = gpu().await;
    shared::thousands_of_recorded_appends_in_one_encoder_keep_their_own_parameters(&g).await;
    checked(&g).await;
}

#[wasm_bindgen_test]
async fn the_16_byte_path_leaves_the_padding_half_zero() {
    let g = gpu().await;
    shared::the_16_byte_path_leaves_the_padding_half_zero(&g).await;
    checked(&g).await;
}

#[wasm_bindgen_test]
async fn no_call_panics_after_the_device_is_lost() {
    let g = gpu().await;
    shared::no_call_panics_after_the_device_is_lost(&g).await;
    checked(&g).await;
}

#[wasm_bindgen_test]
async fn a_queue_of_another_device_is_refused() {
    let g = gpu().await;
    shared::a_queue_of_another_device_is_refused(&g).await;
    checked(&g).await;
}

#[wasm_bindgen_test]
async fn many_queries_over_2048_rows_of_deepseek_v2_lite_mla() {
    let g = gpu().await;
    for dtype in DType::ALL {
        shared::deepseek_v2_lite_mla_matches_the_reference(&g, dtype, 2048, 16).await;
    }
    checked(&g).await;
}

/// The long-context defect of tests/attention.rs, sized for SwiftShader. Natively it runs 16 queries
/// over as many rows as one slot of the device's binding limit holds (128 MiB on lavapipe). This
/// suite's device binds 1 GiB, 4,194,304 f32 rows, which would take SwiftShader about 150 s for f32
/// alone, so f32 runs the full slot of a device with WebGPU's default limits instead (128 MiB, 524,288
/// rows, about 20 s on 2 cores) and f16 keys with bf16 values an eighth of its default slot, 131,071
/// rows (the last tile partial, about 5 s). SwiftShader is a CPU adapter, where 16 queries on one KV
/// head already make the 16 workgroups kvgpu aims for, so only the loop-budget cut splits the
/// context: without it one workgroup would walk all 524,288 (or 131,071) rows, far beyond 16,384.
/// The quantized pairs of `tests/quant.rs`'s long-context test run over 131,071 rows too.
#[wasm_bindgen_test]
async fn many_queries_over_the_longest_context_a_slot_holds_see_every_row() {
    let g = gpu().await;
    let d = shared::default_limits_gpu(&g).await;
    let full_slot = (d.limits().max_slot_bytes() / (64 * 4)) as usize;
    assert_eq!(full_slot, 524_288, "{:?}", d.limits());
    for (types, visible) in [
        ([DType::F32; 2], full_slot),
        ([DType::F16, DType::BF16], 131_071),
        ([DType::Q8_0, DType::Q4_0], 131_071),
        ([DType::F8E5M2, DType::F8E4M3], 131_071),
    ] {
        let clock = Stopwatch::start();
        shared::many_queries_over_a_long_context_see_every_row(&d, types, visible).await;
        note!("{types:?}, {visible} rows: {:.1} s", clock.seconds());
    }
    checked(&d).await;
    checked(&g).await;
}

/// tests/safety.rs `app_buffers_of_another_device_are_refused`, the same body: here the refusals
/// come from the set of buffers `verify_buffer` accepted, since WebGPU reports a buffer of another
/// device only asynchronously.
#[wasm_bindgen_test]
async fn app_buffers_of_another_device_are_refused() {
    let g = gpu().await;
    shared::app_buffers_of_another_device_are_refused(&g).await;
    checked(&g).await;
}

/// tests/safety.rs `buffers_made_through_kvgpu_need_no_verifying`, the same body: here a buffer
/// the device made itself is refused as unverified, and kvgpu's are taken at once.
#[wasm_bindgen_test]
async fn buffers_made_through_kvgpu_need_no_verifying() {
    let g = gpu().await;
    shared::buffers_made_through_kvgpu_need_no_verifying(&g).await;
    checked(&g).await;
}

/// A buffer mapped in part, or one whose `map_async` is still pending, is refused by
/// `read_buffer_async` and `append_gpu` with the cache unchanged, and both go through once it is
/// unmapped. WebGPU's `mapState` tells both. Before, kvgpu asked wgpu for a view of the whole
/// buffer: a pending mapping passed as unmapped, and for a partial one wgpu's WebGPU backend threw a
/// JavaScript `RangeError` ("Invalid typed array length") that aborted the module. Natively
/// tests/hostile.rs checks both (`a_buffer_being_mapped_is_refused` the pending one, which wgpu 30
/// tells only through `map_async`).
#[wasm_bindgen_test]
async fn a_buffer_mapped_in_part_or_being_mapped_is_refused() {
    use kvgpu::{
        CacheSpec, Error, KvCache, LayerSpec, SourceProblem, read_buffer_async, verify_buffer,
    };
    use wasm_bindgen::JsValue;

    let g = gpu().await;
    let b = g.device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("mapped in part"),
        size: 8192,
        usage: wgpu::BufferUsages::MAP_WRITE | wgpu::BufferUsages::COPY_SRC,
        mapped_at_creation: false,
    });
    verify_buffer(&g.device, &b).await.unwrap();
    let spec = CacheSpec::new(vec![LayerSpec::mla(4, 2)], DType::F32, 4).unwrap();
    let mut c = shared::cache_on(&g, spec);
    let append = |c: &mut KvCache| c.append_gpu(0, &shared::mla_4_2_token(&b, 1024));
    let (ledger, words) = (c.ledger().clone(), shared::snapshot(&c).await);
    // The first half is being mapped: map_async has been called and has not resolved.
    let mapped = js_sys::Promise::new(&mut |resolve, _| {
        b.slice(..4096).map_async(wgpu::MapMode::Write, move |r| {
            r.expect("the first half maps");
            resolve.call0(&JsValue::NULL).unwrap();
        });
    });
    for state in ["being mapped", "mapped in part"] {
        if state == "mapped in part" {
            wasm_bindgen_futures::JsFuture::from(mapped.clone())
                .await
                .unwrap();
        }
        let e = read_buffer_async(&g.device, &g.queue, &b, 4096, 16)
            .await
            .unwrap_err();
        assert!(e.to_string().contains("mapped"), "{state}: {e}");
        let e = append(&mut c).unwrap_err();
        assert!(
            matches!(
                e,
                Error::SourceLayout {
                    problem: SourceProblem::Mapped,
                    ..
                }
            ),
            "{state}: {e}"
        );
        assert_eq!(c.ledger(), &ledger, "{state}");
        assert_eq!(shared::snapshot(&c).await, words, "{state}");
    }
    b.unmap();
    read_buffer_async(&g.device, &g.queue, &b, 4096, 16)
        .await
        .unwrap();
    append(&mut c).unwrap();
    c.advance(1).unwrap();
    assert_eq!(c.ledger().len(), 1);
    checked(&g).await;
}
