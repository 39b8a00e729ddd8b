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
);
