//! Quantized storage (q8_0, q4_0, fp8 e4m3 and e5m2) on the adapter chosen by `WGPU_BACKEND`: every
//! append path against the CPU twin bit for bit, edge inputs included, the checks of specs and
//! sources, and GQA and MLA attention over them, also with K and V in different storage types and
//! scaled fp8. The bodies live in `common/quant_bodies.rs` and `common/attention_bodies.rs`; the
//! browser suite (`tests/web.rs`) runs the same ones. Pools and snapshots of quantized storage are
//! tested with the others (`tests/paged.rs`, `tests/snapshot.rs`).
#![cfg(not(target_arch = "wasm32"))]

mod common;

use kvgpu::{CacheSpec, DType, LayerSpec};

// The tests of this file take `serial()`: on OpenGL a test waiting over 6 s for wgpu's one EGL
// context panics, and the long-context test holds it longer (CI runs OpenGL with one thread anyway).
use common::serial;

// Attention over quantized storage, and over K and V of different types (their bodies are with the
// other attention bodies).
common::shared_tests!(attention_bodies, serial: serial;
    quantized_storage_matches_the_reference,
    mixed_storage_matches_the_reference,
    quantized_attention_over_4096_rows_splits_the_sequence,
    quantized_gpu_plans_match_the_reference,
    wide_unaligned_fp8_heads_stay_within_the_loop_budget,
    fp8_nan_codes_in_keys_make_their_scores_nan,
);

common::shared_tests!(quant_bodies, serial: serial;
    host_rows_are_stored_as_the_twin_quantizes_them,
    gpu_sources_are_quantized_as_the_twin_does,
    quantized_specs_and_sources_are_checked,
    quantized_caches_take_the_bytes_they_promise,
    mixed_storage_takes_every_append_path,
    scaled_fp8_gpu_sources_store_the_host_codes_at_any_scale,
);

/// The longest-context test of `tests/attention.rs` over quantized storage: 16 queries over as many
/// rows as the larger slot of one binding holds (on llvmpipe and lavapipe 1,973,790 rows of q8_0
/// K, and 2,097,152 of fp8), so that the kernels' chunks are cut by the loop budget for these
/// types too, every row's V its row index's bits (see the shared body). V is q4_0 and e4m3, which
/// store 0 and 1 exactly (q8_0 stores 1 as 16383/16384, whose sums over a million rows round in
/// f32 past the tolerance).
#[test]
fn quantized_attention_over_the_longest_context_a_slot_holds_sees_every_row() {
    let _serial = serial();
    let g = common::gpu();
    for types in [[DType::Q8_0, DType::Q4_0], [DType::F8E5M2, DType::F8E4M3]] {
        let spec = CacheSpec::new(
            vec![common::shared::attention_bodies::stored_as(
                LayerSpec::kv(1, 64, 64),
                types,
            )],
            types[0],
            1,
        )
        .unwrap();
        let row = spec
            .row_bytes(0, 0)
            .unwrap()
            .max(spec.row_bytes(0, 1).unwrap());
        let visible = (g.limits().max_slot_bytes() / row) as usize;
        pollster::block_on(
            common::shared::many_queries_over_a_long_context_see_every_row(g, types, visible),
        );
    }
}
