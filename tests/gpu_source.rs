//! Appends from GPU buffers: strided sources (fused QKV, head-major), element type conversion matching
//! `half` bit for bit, odd widths, the contiguous copy path, and refused sources. The bodies live in
//! `common/source_bodies.rs`; the browser suite (`tests/web.rs`) runs the same ones.
#![cfg(not(target_arch = "wasm32"))]

mod common;

common::shared_tests!(source_bodies:
    fused_qkv_k_and_v_go_straight_into_the_cache,
    gqa_prefill_then_decode_from_fused_qkv,
    head_major_source_is_transposed_into_rows,
    conversion_matches_half_bit_for_bit,
    contiguous_same_type_and_odd_offsets,
    refused_sources_change_nothing,
    many_recorded_appends_in_one_encoder,
    sources_of_spread_elements_are_gathered,
);
