//! Dropped caches and dropped source buffers release their memory, however long the `Attention` or
//! the cache that used them lives: counted with wgpu's live-buffer counter over many cycles (the
//! bodies live in `common/memory_bodies.rs`; the browser suite runs them with its own count). The
//! tests of this file run one at a time (the counter is per device, shared by every test of the
//! binary).
#![cfg(not(target_arch = "wasm32"))]

mod common;

fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

common::shared_tests!(memory_bodies, serial: serial;
    one_attention_serving_many_dropped_caches_keeps_none_of_them,
    a_cache_appending_from_many_dropped_sources_keeps_few_of_them,
);
