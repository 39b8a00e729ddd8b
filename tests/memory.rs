//! Dropped caches and dropped source buffers release their memory, however long the `Attention` or
//! the cache that used them lives: counted with wgpu's live-buffer counter over many cycles. The tests
//! of this file run one at a time (the counter is per device, shared by every test of the binary).
#![cfg(not(target_arch = "wasm32"))]

mod common;

use common::*;
use kvgpu::*;
use wgpu::util::DeviceExt;

fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Buffers alive on the device, after wgpu has freed what nothing references any more.
fn live_buffers() -> isize {
    let g = gpu();
    g.device.poll(wgpu::PollType::wait_indefinitely()).unwrap();
    g.device.get_internal_counters().hal.buffers.read()
}

#[test]
fn one_attention_serving_many_dropped_caches_keeps_none_of_them() {
    let _serial = serial();
    let g = gpu();
    // 4 MiB per slot: 24 caches would hold 192 MiB if the attention kept them.
    let spec = CacheSpec::new(vec![LayerSpec::kv(1, 64, 64)], DType::F32, 4096).unwrap();
    let q = g
        .device
        .create_buffer_init(&wgpu::util::BufferInitDescriptor {
            label: Some("q"),
            contents: bytemuck::cast_slice(&values(1, 4 * 64)),
            usage: wgpu::BufferUsages::STORAGE,
        });
    let out = g.device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("out"),
        size: 4 * 64 * 4,
        usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
        mapped_at_creation: false,
    });
    let first = cache(spec.clone());
    let mut attention = Attention::for_cache(&first);
    drop(first);
    let mut baseline = None;
    for i in 0..24 {
        let mut c = cache(spec.clone());
        append_random(&mut c, 0, 100, i);
        attention
            .gqa(&c, 0, Queries::new(&q, 1, 4, 64), &out, &Default::default())
            .unwrap();
        drop(c);
        let live = live_buffers();
        // The first cycle sizes the attention's scratch; after it nothing may accumulate.
        let base = *baseline.get_or_insert(live);
        assert!(
            live <= base,
            "cycle {i}: {live} live buffers, {base} after the first"
        );
    }
}

#[test]
fn a_cache_appending_from_many_dropped_sources_keeps_few_of_them() {
    let _serial = serial();
    let g = gpu();
    let spec = CacheSpec::new(vec![LayerSpec::kv(1, 64, 64)], DType::F16, 64).unwrap();
    let mut c = cache(spec);
    let before = live_buffers();
    // 8 MiB sources, each used by one strided (kernel-path) append and one copy-path append, then
    // dropped: the cache may keep at most a few within its pinning bound (32 MiB) alive.
    for i in 0..24u64 {
        let src = g.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("8 MiB source"),
            size: 8 << 20,
            usage: wgpu::BufferUsages::STORAGE
                | wgpu::BufferUsages::COPY_SRC
                | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let shape = [1, 1, 64];
        let strided = GpuSlab {
            buffer: &src,
            dtype: DType::F32,
            offset: 64 * i,
            shape: &shape,
            strides: Some(&[128, 64, 1]),
        };
        let copied = GpuSlab {
            dtype: DType::F16,
            strides: None,
            ..strided
        };
        c.append_gpu(0, &[strided, copied]).unwrap();
        c.truncate(0).unwrap();
        drop(src);
        let live = live_buffers();
        assert!(
            live - before <= 2 * (32 / 8) + 2,
            "after {} dropped 8 MiB sources {} more buffers are alive",
            i + 1,
            live - before
        );
    }
    drop(c);
    assert!(
        live_buffers() < before,
        "dropping the cache freed its buffers"
    );
}
