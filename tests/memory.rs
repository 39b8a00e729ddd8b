//! Dropped caches and dropped source buffers release their memory, however long the `Attention` or
//! the cache that used them lives: counted with wgpu's live-buffer counter over many cycles (the
//! bodies live in `common/memory_bodies.rs`; the browser suite runs them with its own count). The
//! tests of this file run one at a time (the counter is per device, shared by every test of the
//! binary).
#![cfg(not(target_arch = "wasm32"))]

mod common;

use common::serial;

common::shared_tests!(memory_bodies, serial: serial;
    one_attention_serving_many_dropped_caches_keeps_none_of_them,
    a_cache_appending_from_many_dropped_sources_keeps_few_of_them,
    release_memory_lets_go_of_the_scratch_and_the_app_buffers,
);

/// A refused attention call keeps none of the buffers it bound: natively the queries' bind group
/// is made before an output of another device is refused, and it was kept in the attention's
/// cache, holding the query buffer's memory after the app dropped it.
#[test]
fn a_refused_attention_keeps_no_query_buffer() {
    use common::shared::memory_bodies::Residency;
    use kvgpu::{
        Attention, AttentionOptions, CacheSpec, DType, Error, HostSlab, LayerSpec, Output, Queries,
    };
    let _serial = serial();
    let g = common::gpu();
    let other = pollster::block_on(common::shared::default_limits_gpu(g));
    let mut c =
        common::cache(CacheSpec::new(vec![LayerSpec::kv(1, 64, 64)], DType::F32, 8).unwrap());
    let row = common::shared::values(1, 64);
    let slab = HostSlab::f32(&row, &[1, 1, 64]);
    c.append(0, &[slab, slab]).unwrap();
    c.advance(1).unwrap();
    // The output starts past its binding's start (4 elements in), so pass 1 does not write it
    // itself and the queries' group is made alone, before the output's.
    let (opts, at) = (AttentionOptions::default(), 4);
    let mut attn = Attention::for_cache(&c);
    let (q, out) = (storage(&g.device, 1024), storage(&g.device, 2048));
    attn.gqa(
        &c,
        0,
        Queries::new(&q, 1, 4, 64),
        Output::new(&out).at(at),
        &opts,
    )
    .unwrap();
    let residency = Residency::new(g);
    let before = residency.live_now();
    let big = storage(&g.device, 8 << 20);
    let foreign = storage(&other.device, 2048);
    let e = attn
        .gqa(
            &c,
            0,
            Queries::new(&big, 1, 4, 64),
            Output::new(&foreign).at(at),
            &opts,
        )
        .unwrap_err();
    assert!(matches!(e, Error::ForeignDevice { .. }), "{e}");
    drop(big);
    assert_eq!(residency.live_now(), before);
}

/// A refused GPU append keeps none of the sources it checked: natively the first slot's source is
/// bound (a slab-write bind group into an f16 cache) or probed (a copy into an f32 one) before the
/// second slot's source, of another device, is refused, and the cache kept that group or probe,
/// holding the first source's memory after the app dropped it.
#[test]
fn a_refused_gpu_append_keeps_no_source_buffer() {
    use common::shared::memory_bodies::Residency;
    use kvgpu::{CacheSpec, DType, Error, GpuSlab, LayerSpec};
    let _serial = serial();
    let g = common::gpu();
    let other = pollster::block_on(common::shared::default_limits_gpu(g));
    for dtype in [DType::F16, DType::F32] {
        let mut c =
            common::cache(CacheSpec::new(vec![LayerSpec::kv(1, 64, 64)], dtype, 8).unwrap());
        let residency = Residency::new(g);
        let before = residency.live_now();
        let (big, foreign) = (storage(&g.device, 8 << 20), storage(&other.device, 1024));
        let slab = |buffer| GpuSlab {
            buffer,
            dtype: DType::F32,
            offset: 0,
            shape: &[1, 1, 64],
            strides: None,
        };
        let e = c.append_gpu(0, &[slab(&big), slab(&foreign)]).unwrap_err();
        assert!(matches!(e, Error::ForeignDevice { .. }), "{dtype}: {e}");
        drop(big);
        assert_eq!(residency.live_now(), before, "{dtype}");
    }
}

/// A streamed import refused midway lets go of the rows it staged at once, while the app still
/// holds the import (whose later calls repeat the refusal): the staging buffers were kept until the
/// import was dropped, as large as the snapshot's rows. A cache's import and a pool's, refused by a
/// byte past the snapshot's end. (wgpu holds the buffers that `Queue::write_buffer` wrote into
/// until the queue's next submission: an empty one here.)
#[test]
fn a_refused_streamed_import_lets_go_of_its_staging() {
    use common::shared::memory_bodies::Residency;
    use kvgpu::{CacheSpec, DType, Error, LayerSpec, PagedCache, SnapshotProblem};
    let _serial = serial();
    let g = common::gpu();
    let spec = CacheSpec::new(vec![LayerSpec::kv(2, 64, 64)], DType::F32, 2048).unwrap();
    let mut src = common::cache(spec.clone());
    common::shared::append_random(&mut src, 0, 2048, 7);
    src.advance(2048).unwrap();
    let bytes = src.snapshot().unwrap();
    let mut extra = bytes[bytes.len() / 2..].to_vec();
    extra.push(0);
    let trailing = |e: Error| {
        assert!(
            matches!(
                e,
                Error::Snapshot {
                    problem: SnapshotProblem::TrailingBytes { .. }
                }
            ),
            "{e}"
        );
    };
    let residency = Residency::new(g);
    // Half the snapshot stages rows; the rest and a byte more are refused, and the live buffers
    // are back to their count before the import.
    let refused_midway = |what: &str, push: &mut dyn FnMut(&[u8]) -> kvgpu::Result<()>| {
        let before = residency.live_now().0;
        push(&bytes[..bytes.len() / 2]).unwrap();
        let staging = residency.live_now().0;
        assert!(
            staging > before,
            "{what}: {staging} live buffers while staging, {before} before"
        );
        trailing(push(&extra).unwrap_err());
        g.queue.submit([]);
        assert_eq!(residency.live_now().0, before, "{what}, refused");
    };
    let mut cache = common::cache(spec.clone());
    let mut import = cache.import_stream().unwrap();
    refused_midway("the cache's import", &mut |piece| import.push(piece));
    trailing(import.finish().unwrap_err());
    let mut pool = PagedCache::with_kernels(common::shared::kernels_for(g), spec, 16, 256).unwrap();
    let mut import = pool.import_sequence_stream();
    refused_midway("the pool's import", &mut |piece| import.push(piece));
    trailing(import.finish().unwrap_err());
    assert_eq!(pool.pages_in_use(), 0);
}

/// A `STORAGE | COPY_SRC` buffer of `size` bytes on `device`.
fn storage(device: &wgpu::Device, size: u64) -> wgpu::Buffer {
    device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("memory test buffer"),
        size,
        usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
        mapped_at_creation: false,
    })
}

/// A streamed import submits the rows it has written into staging every 16 MiB or so, so that wgpu
/// lets go of its own copies of them (it holds every `Queue::write_buffer` upload until the queue's
/// next submission): pushing a snapshot of 64 MiB of rows in 1 MiB pieces, the device never holds
/// more than a few dozen uploads at once, and never grows by the snapshot's rows again. Counted in
/// buffers (OpenGL counts no buffer memory in wgpu); the rows arrive whole and correct.
#[test]
fn a_streamed_import_lets_go_of_its_uploads_as_it_goes() {
    use common::shared::memory_bodies::Residency;
    use kvgpu::{CacheSpec, DType, LayerSpec};
    let _serial = serial();
    let g = common::gpu();
    // 16 KiB rows per slot: 64 MiB in the two slots' 2,048 rows.
    let spec = CacheSpec::new(vec![LayerSpec::kv(4, 1024, 1024)], DType::F32, 2048).unwrap();
    let mut src = common::cache(spec.clone());
    let rows = common::shared::append_random(&mut src, 0, 2048, 11);
    src.advance(2048).unwrap();
    let bytes = src.snapshot().unwrap();
    drop(src);
    let mut cache = common::cache(spec);
    let residency = Residency::new(g);
    let mut import = cache.import_stream().unwrap();
    let pieces: Vec<&[u8]> = bytes.chunks(1 << 20).collect();
    import.push(pieces[0]).unwrap();
    // The header's staging buffers, allocated at the first piece.
    let staging = residency.live_now().0;
    let mut most = 0;
    for piece in &pieces[1..] {
        import.push(piece).unwrap();
        most = most.max(residency.live_now().0 - staging);
    }
    assert!(
        (1..=24).contains(&most),
        "{most} more buffers at most while {} pieces were pushed",
        pieces.len()
    );
    assert_eq!(import.finish().unwrap(), 2048);
    for (slot, want) in rows.iter().enumerate() {
        let got = cache.read_f32(0, slot).unwrap();
        assert!(got == *want, "slot {slot}");
    }
}
