//! The paged pool (`PagedCache`): many sequences, forks sharing pages, private copies on write,
//! truncation and removal returning pages, admission, host and GPU appends, against a plain-Rust
//! model. The bodies live in `common/paged_bodies.rs`; the browser suite (`tests/web.rs`) runs the
//! same ones.
#![cfg(not(target_arch = "wasm32"))]

mod common;

common::shared_tests!(paged_bodies:
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
);

/// Natively a pool reads back blocking as it does async (a sequence's rows, decoded rows, the whole
/// pool buffer); `Attention::for_pool` shares the pool's kernel registry; `scatter()` says what
/// `set_scatter` chose.
#[test]
fn a_pool_reads_blocking_shares_its_registry_and_says_its_scatter() {
    use kvgpu::{Attention, CacheSpec, DType, HostSlab, LayerSpec, PagedCache, ScatterChoice};
    let g = common::gpu();
    let spec = CacheSpec::new(vec![LayerSpec::kv(1, 8, 8)], DType::F16, 16).unwrap();
    let mut p = PagedCache::with_kernels(common::shared::kernels_for(g), spec, 4, 4).unwrap();
    assert_eq!(p.scatter(), ScatterChoice::Auto);
    p.set_scatter(ScatterChoice::Never);
    assert_eq!(p.scatter(), ScatterChoice::Never);
    let s = p.add_sequence().unwrap();
    let rows = common::shared::values(5, 6 * 8);
    let slab = HostSlab::f32(&rows, &[6, 1, 8]);
    p.append(s, 0, &[slab, slab]).unwrap();
    p.advance(s, 6).unwrap();
    for slot in 0..2 {
        let words = p.read_words(s, 0, slot).unwrap();
        assert_eq!(words.len(), 6 * 4, "slot {slot}");
        assert_eq!(
            words,
            pollster::block_on(p.read_words_async(s, 0, slot)).unwrap()
        );
        assert_eq!(
            p.read_f32(s, 0, slot).unwrap(),
            kvgpu::reference::round_trip_rows(&rows, DType::F16, 8),
            "slot {slot}"
        );
        let pool = p.read_pool_words(0, slot).unwrap();
        assert_eq!(pool.len(), 16 * 4, "slot {slot}");
        assert_eq!(
            pool,
            pollster::block_on(p.read_pool_words_async(0, slot)).unwrap()
        );
    }
    assert!(std::sync::Arc::ptr_eq(
        Attention::for_pool(&p).kernels(),
        p.kernels()
    ));
}
