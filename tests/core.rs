//! The cache on the GPU against the plain-Rust model, for every dtype, on the adapter chosen by
//! `WGPU_BACKEND` (CI runs this file on OpenGL llvmpipe and on Vulkan lavapipe). The bodies live in
//! `common/cache_bodies.rs`; the browser suite (`tests/web.rs`) runs the same ones.
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
    host_data_already_in_the_storage_type_is_stored_as_is,
    scrub_matches_the_zero_twin_at_every_word_offset,
    parameters_move_on_to_fresh_buffers_inside_one_batch,
    a_sequence_moves_between_caches,
    append_layers_writes_every_layer_in_one_upload,
);
