//! Shared GPU setup for the integration tests: one device per test binary, chosen by `WGPU_BACKEND`
//! and `WGPU_ADAPTER_NAME`. No adapter is a failure that says how to install one, never a pass.
#![allow(dead_code)]

use std::sync::OnceLock;

use kvgpu::{CacheSpec, DType, Gpu, HostSlab, KvCache};

pub fn gpu() -> &'static Gpu {
    static GPU: OnceLock<Gpu> = OnceLock::new();
    GPU.get_or_init(|| {
        let gpu = Gpu::from_env_blocking().unwrap_or_else(|e| {
            panic!(
                "GPU tests need an adapter and found none: {e}\n{}",
                kvgpu::INSTALL_HINT
            )
        });
        eprintln!("kvgpu tests on {}", gpu.describe());
        gpu
    })
}

pub fn cache(spec: CacheSpec) -> KvCache {
    let g = gpu();
    KvCache::new(&g.device, &g.queue, spec).expect("cache fits the device")
}

/// Deterministic pseudo-random values in [-2, 2).
pub fn values(seed: u64, n: usize) -> Vec<f32> {
    kvgpu::reference::pseudo_random(seed, n, 2.0)
}

/// Appends `n` rows of pseudo-random f32 data to every slot of `layer` from the host and returns the
/// data, slot by slot (`[n, ...trailing]` row-major).
pub fn append_random(cache: &mut KvCache, layer: usize, n: usize, seed: u64) -> Vec<Vec<f32>> {
    let shapes: Vec<Vec<usize>> = cache.spec().layers()[layer]
        .slots
        .iter()
        .map(|s| [&[n][..], &s.trailing].concat())
        .collect();
    let data: Vec<Vec<f32>> = shapes
        .iter()
        .enumerate()
        .map(|(s, sh)| values(seed * 31 + s as u64, sh.iter().product()))
        .collect();
    let slabs: Vec<HostSlab> = data
        .iter()
        .zip(&shapes)
        .map(|(d, sh)| HostSlab::f32(d, sh))
        .collect();
    cache.append(layer, &slabs).expect("a valid append");
    data
}

/// Every word of every slot buffer, read back from the GPU.
pub fn snapshot(cache: &KvCache) -> Vec<Vec<Vec<u32>>> {
    cache
        .spec()
        .layers()
        .iter()
        .enumerate()
        .map(|(l, layer)| {
            (0..layer.slots.len())
                .map(|s| cache.read_full_words(l, s).unwrap())
                .collect()
        })
        .collect()
}

pub fn for_each_dtype(mut f: impl FnMut(DType)) {
    for dtype in DType::ALL {
        eprintln!("-- {dtype}");
        f(dtype);
    }
}
