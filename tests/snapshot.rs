//! Snapshots (`KvCache::export_async` / `import`, `PagedCache::export_sequence_async` /
//! `import_sequence`): round trips, refusals that change nothing, the same bytes on every backend.
//! The bodies live in `common/snapshot_bodies.rs`; the browser suite (`tests/web.rs`) runs the same
//! ones. Two tests here are native only: one moves snapshots between a Vulkan and an OpenGL device
//! of one process, one checks the blocking exports and a header's compatibility check.
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
    a_longest_sequence_past_32_bits_restores_everywhere,
    imported_rows_get_zero_padding,
);

/// A snapshot taken on Vulkan restores bit for bit on OpenGL, and one taken there on Vulkan, whatever
/// `WGPU_BACKEND` says. Where this machine lacks one of the two it says so and checks nothing.
#[test]
fn snapshots_move_between_vulkan_and_opengl() {
    let open = |backends| pollster::block_on(Gpu::open(backends, None));
    let (vulkan, gl) = match (open(Backends::VULKAN), open(Backends::GL)) {
        (Ok(v), Ok(g)) => (v, g),
        (v, g) => {
            common::shared::skipped(&format!(
                "the whole test: it needs both adapters (Vulkan: {}; OpenGL: {})",
                v.map_or_else(|e| e.to_string(), |g| g.describe()),
                g.map_or_else(|e| e.to_string(), |g| g.describe()),
            ));
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

/// The blocking exports write what the snapshots hold (`KvCache::export`,
/// `PagedCache::export_sequence`), and a snapshot's header checks a destination's spec on its own:
/// the same spec (and another capacity) passes, another storage type or slot shape is named.
#[test]
fn blocking_exports_write_the_snapshots_and_headers_check_their_destination() {
    use common::*;
    use kvgpu::*;
    let g = gpu();
    let spec = CacheSpec::new(
        vec![LayerSpec::kv(2, 4, 4), LayerSpec::mla(6, 2)],
        DType::F16,
        16,
    )
    .unwrap();
    let mut c = cache(spec.clone());
    for layer in 0..2 {
        append_random(&mut c, layer, 5, 40 + layer as u64);
    }
    c.advance(5).unwrap();
    let mut out = Vec::new();
    let written = c.export(&mut out).unwrap();
    assert_eq!(written, out.len() as u64);
    assert_eq!(out, c.snapshot().unwrap());

    let mut pool = PagedCache::new(&g.device, &g.queue, spec.clone(), 4, 8).unwrap();
    let seq = pool.import_sequence(&out).unwrap();
    let mut again = Vec::new();
    let written = pool.export_sequence(seq, &mut again).unwrap();
    assert_eq!(written, again.len() as u64);
    assert_eq!(again, pool.snapshot_sequence(seq).unwrap());
    // The pool's header names its page size; its rows restore the cache's snapshot exactly.
    assert_eq!(SnapshotHeader::parse(&again).unwrap().page_size, 4);
    let mut back = cache(spec.clone());
    back.import(&again).unwrap();
    assert_eq!(back.snapshot().unwrap(), out);

    let header = SnapshotHeader::parse(&out).unwrap();
    assert_eq!((header.len, &header.spec), (5, &spec));
    let roomier = CacheSpec::new(spec.layers().to_vec(), DType::F16, 64).unwrap();
    assert_eq!(header.check_compatible(&roomier), Ok(()));
    let f32_spec = CacheSpec::new(spec.layers().to_vec(), DType::F32, 16).unwrap();
    assert!(matches!(
        header.check_compatible(&f32_spec),
        Err(Error::Snapshot {
            problem: SnapshotProblem::DType {
                layer: 0,
                slot: 0,
                snapshot: DType::F16,
                cache: DType::F32,
            }
        })
    ));
    let wider = CacheSpec::new(
        vec![LayerSpec::kv(2, 4, 4), LayerSpec::mla(8, 2)],
        DType::F16,
        16,
    )
    .unwrap();
    assert!(matches!(
        header.check_compatible(&wider),
        Err(Error::Snapshot {
            problem: SnapshotProblem::SlotShape {
                layer: 1,
                slot: 0,
                ..
            }
        })
    ));
}
