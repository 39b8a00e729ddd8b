//! Shared GPU setup for the integration tests: one device per test binary, chosen by `WGPU_BACKEND`
//! and `WGPU_ADAPTER_NAME`. No adapter is a failure that says how to install one, never a pass.
#![allow(dead_code)]

use std::sync::OnceLock;

#[path = "shared.rs"]
pub mod shared;

use kvgpu::{CacheSpec, DType, Gpu, KvCache};

/// Runs a test binary's tests one at a time, where it takes this lock: on OpenGL every thread
/// shares one context lock, which wgpu gives up on after 6 s, and some files count what the device
/// or the shared registry holds (each file says why it takes it). One lock per test binary.
pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

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

#[allow(unused_imports)]
pub use shared::{TOL, append_random, assert_close, values};

/// Every word of every slot buffer, read back from the GPU.
pub fn snapshot(cache: &KvCache) -> Vec<Vec<Vec<u32>>> {
    pollster::block_on(shared::snapshot(cache))
}

/// Native `#[test]`s that run shared async bodies of `module` on the device of [`gpu`], one test per
/// body, named after it; `serial: lock` first takes the guard `lock()` returns.
#[allow(unused_macros)]
macro_rules! shared_tests {
    ($module:ident: $($name:ident),+ $(,)?) => {
        $(
            #[test]
            fn $name() {
                pollster::block_on($crate::common::shared::$module::$name($crate::common::gpu()));
            }
        )+
    };
    ($module:ident, serial: $lock:path; $($name:ident),+ $(,)?) => {
        $(
            #[test]
            fn $name() {
                let _serial = $lock();
                pollster::block_on($crate::common::shared::$module::$name($crate::common::gpu()));
            }
        )+
    };
}
#[allow(unused_imports)]
pub(crate) use shared_tests;

pub fn for_each_dtype(mut f: impl FnMut(DType)) {
    for dtype in DType::ALL {
        eprintln!("-- {dtype}");
        f(dtype);
    }
}
