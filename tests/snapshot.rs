//! Snapshots (`KvCache::export_async` / `import`, `PagedCache::export_sequence_async` /
//! `import_sequence`): round trips, refusals that change nothing, the same bytes on every backend.
//! The bodies live in `common/snapshot_bodies.rs`; the browser suite (`tests/web.rs`) runs the same
//! ones. One test here moves snapshots between a Vulkan and an OpenGL device of one process.
#![cfg(not(target_arch = "wasm32"))]

mod common;

use kvgpu::Gpu;
use kvgpu::wgpu::Backends;

common::shared_tests!(snapshot_bodies:
    snapshots_round_trip_bit_for_bit,
    pool_sequences_and_forks_round_trip,
    refused_snapshots_change_nothing,
    snapshots_move_between_devices,
    the_snapshot_of_a_seeded_cache_is_the_same_on_every_backend,
    streamed_imports_match_whole_ones,
    a_failing_writer_stops_the_export,
    a_failing_reader_stops_the_import,
);

/// A snapshot taken on Vulkan restores bit for bit on OpenGL, and one taken there on Vulkan, whatever
/// `WGPU_BACKEND` says. Where this machine lacks one of the two it says so and checks nothing.
#[test]
fn snapshots_move_between_vulkan_and_opengl() {
    let open = |backends| pollster::block_on(Gpu::open(backends, None));
    let (vulkan, gl) = match (open(Backends::VULKAN), open(Backends::GL)) {
        (Ok(v), Ok(g)) => (v, g),
        (v, g) => {
            eprintln!(
                "SKIPPED snapshots_move_between_vulkan_and_opengl: it needs both adapters \
                 (Vulkan: {}; OpenGL: {})",
                v.map_or_else(|e| e.to_string(), |g| g.describe()),
                g.map_or_else(|e| e.to_string(), |g| g.describe()),
            );
            return;
        }
    };
    eprintln!("from {} to {} and back", vulkan.describe(), gl.describe());
    pollster::block_on(common::shared::snapshot_bodies::restore_on_another_device(
        &vulkan, &gl,
    ));
    pollster::block_on(common::shared::snapshot_bodies::restore_on_another_device(
        &gl, &vulkan,
    ));
}
