//! The cache on the GPU against the plain-Rust model, for every dtype, on the adapter chosen by
//! `WGPU_BACKEND` (CI runs this file on OpenGL llvmpipe and on Vulkan lavapipe). The bodies live in
//! `common/cache_bodies.rs`; the browser suite (`tests/web.rs`) runs the same ones. The accessors'
//! test is native only.
#![cfg(not(target_arch = "wasm32"))]

mod common;

common::shared_tests!(cache_bodies:
    mla_decode_steps_read_back_in_order,
    gqa_prefill_then_decode,
    rank_3_slot_and_odd_widths,
    layers_are_isolated_and_hybrid_layers_own_nothing,
    every_refusal_leaves_the_cache_unchanged,
    full_capacity_then_overflow_then_truncate_and_reappend,
    reset_zeroes_every_byte_and_reset_fast_keeps_data,
    recorded_ops_share_one_encoder,
    views_narrow_to_visible_rows,
    destroyed_buffers_are_not_read_back,
    host_data_already_in_the_storage_type_is_stored_as_is,
    scrub_matches_the_zero_twin_at_every_word_offset,
    parameters_move_on_to_fresh_buffers_inside_one_batch,
    a_sequence_moves_between_caches,
    append_layers_writes_every_layer_in_one_upload,
);

/// The accessors give back what a cache, a pool, their registry and an attention were made with.
#[test]
fn accessors_give_back_what_was_made() {
    use common::*;
    use kvgpu::*;
    use std::num::NonZeroUsize;
    let g = gpu();
    let spec = CacheSpec::qwen3_0_6b(DType::F16, 64).unwrap();
    assert_eq!(
        spec,
        CacheSpec::preset("qwen3-0.6b", DType::F16, 64).unwrap()
    );
    assert_eq!(spec.n_layers(), 28);
    assert_eq!(spec.bytes_per_token(), 28 * 2 * 8 * 128 * 2);
    let c = cache(spec.clone());
    assert_eq!((c.capacity(), c.remaining()), (64, 64));
    assert!(c.device() == &g.device && c.kernels().device() == &g.device);
    assert!(c.kernels().queue() == &g.queue);
    let pool = PagedCache::new(&g.device, &g.queue, spec, 16, 8).unwrap();
    assert!(pool.device() == &g.device && pool.queue() == &g.queue);

    let mut att = Attention::for_cache(&c);
    assert_eq!(att.target_workgroups(), None);
    att.set_target_workgroups(NonZeroUsize::new(96));
    assert_eq!(att.target_workgroups(), NonZeroUsize::new(96));
    att.set_target_workgroups(None);
    assert_eq!(att.target_workgroups(), None);

    let elements: Vec<DType> = DType::STORAGE
        .into_iter()
        .filter(|d| d.is_element())
        .collect();
    assert_eq!(elements, [DType::F32, DType::F16, DType::BF16]);

    let limits = DeviceLimits::from_wgpu(&g.device.limits());
    assert_eq!(
        limits.max_storage_buffer_binding_size,
        g.device.limits().max_storage_buffer_binding_size
    );
    assert_eq!(limits.max_buffer_size, g.device.limits().max_buffer_size);
    let wide = DeviceLimits {
        max_storage_buffer_binding_size: 1 << 40,
        max_buffer_size: 1 << 36,
    };
    assert_eq!(wide.binding_bytes(), u32::MAX as u64);
    let narrow = DeviceLimits {
        max_storage_buffer_binding_size: 1 << 27,
        max_buffer_size: 1 << 26,
    };
    assert_eq!(narrow.binding_bytes(), 1 << 26);

    assert_eq!(reference::prescaled(3.0, 0.5), 1.5);
    assert_eq!(
        reference::prescaled(-f32::NAN, 0.5).to_bits(),
        (-f32::NAN).to_bits()
    );
}
