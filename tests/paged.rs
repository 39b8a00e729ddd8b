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
    a_recorded_copy_keeps_its_page_until_the_encoder_is_done,
    encoders_keep_what_a_removal_or_truncation_takes,
    a_recorded_step_of_writers_from_different_rows_is_admitted_whole,
);

/// `admits_new` answers for a request before it is a sequence, as a sequence made from the same
/// tokens and asked with `admits` would be answered, and changes nothing: the ledger (ids, the
/// prefixes' recency) is as it was.
#[test]
fn admitting_a_new_request_changes_nothing() {
    use kvgpu::{CacheSpec, DType, Error, HostSlab, LayerSpec, PagedCache};
    let g = common::gpu();
    let spec = CacheSpec::new(vec![LayerSpec::kv(1, 4, 4); 2], DType::F32, 40).unwrap();
    let mut p = PagedCache::with_kernels(common::shared::kernels_for(g), spec, 4, 8).unwrap();
    // Two pages of tokens 1..=8 published and cached; six pages free.
    let a = p.add_sequence().unwrap();
    let x = [0.5f32; 8 * 4];
    let rows = [HostSlab::f32(&x, &[8, 1, 4]), HostSlab::f32(&x, &[8, 1, 4])];
    for layer in 0..2 {
        p.append(a, layer, &rows).unwrap();
    }
    p.advance(a, 8).unwrap();
    let tokens: Vec<u32> = (1..=8).collect();
    assert_eq!(p.publish_prefix(a, &tokens).unwrap(), 8);
    p.remove(a).unwrap();
    assert_eq!((p.free_pages(), p.cached_pages()), (6, 2));
    let b = p.add_sequence().unwrap();
    let before = p.ledger().clone();
    // 32 rows from the prefix's 8: 8 pages, 2 of them shared; 33 rows need a seventh free one, as
    // 25 rows without the prefix do; past max_seq_len (40), the capacity; fewer rows than the
    // prefix, none more.
    // Tokens, the new sequence's rows (the prefix's included), the running sequences' growth.
    type Case<'a> = (&'a [u32], usize, Vec<(kvgpu::SeqId, usize)>);
    let cases: [Case; 7] = [
        (&tokens, 32, vec![]),
        (&tokens, 33, vec![]),
        (&tokens, 28, vec![(b, 4)]),
        (&tokens, 29, vec![(b, 4)]),
        (&[], 25, vec![]),
        (&tokens, 41, vec![]),
        (&tokens, 3, vec![]),
    ];
    let want = |r: &Result<(), Error>| match r {
        Ok(()) => "ok".to_string(),
        Err(Error::OutOfPages { needed, free }) => format!("pages {needed}/{free}"),
        Err(Error::CapacityExceeded { .. }) => "capacity".to_string(),
        Err(e) => format!("{e}"),
    };
    let answers: Vec<String> = cases
        .iter()
        .map(|(t, n, growth)| want(&p.admits_new(t, *n, growth)))
        .collect();
    assert_eq!(
        answers,
        [
            "ok",
            "pages 7/6",
            "ok",
            "pages 7/6",
            "pages 7/6",
            "capacity",
            "ok"
        ]
    );
    assert_eq!(p.ledger(), &before, "admits_new changed the ledger");
    // The same answers from a sequence made of the same tokens, each made and removed again.
    for ((t, n, growth), answer) in cases.iter().zip(&answers) {
        let (seq, prefix) = p.add_sequence_with_prefix(t).unwrap();
        let mut all = growth.clone();
        all.push((seq, n.saturating_sub(prefix)));
        assert_eq!(
            &want(&p.admits(&all)),
            answer,
            "{} tokens, {n} rows",
            t.len()
        );
        p.remove(seq).unwrap();
    }
}

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
