//! The device helper: an unmatched adapter name is an error listing what exists, not a panic.
#![cfg(not(target_arch = "wasm32"))]

use kvgpu::{Error, Gpu};

#[test]
fn unmatched_adapter_name_is_an_error_naming_the_adapters_found() {
    let err = pollster::block_on(Gpu::open(
        wgpu::Backends::all(),
        Some("no-such-adapter-xyz"),
    ))
    .unwrap_err();
    match &err {
        Error::AdapterNotFound { reason } => {
            assert!(reason.contains("no-such-adapter-xyz"), "{reason}")
        }
        other => panic!("expected AdapterNotFound, got {other:?}"),
    }
}

#[test]
fn a_matching_name_opens_that_adapter() {
    let any = Gpu::from_env_blocking().expect("an adapter; see kvgpu::INSTALL_HINT");
    let name = any.adapter.get_info().name;
    let backend = any.adapter.get_info().backend;
    let again = pollster::block_on(Gpu::open(backend.into(), Some(&name.to_uppercase()))).unwrap();
    assert_eq!(again.adapter.get_info().name, name);
    assert!(any.limits().max_storage_buffer_binding_size >= 128 << 20);
}

#[test]
fn caches_of_two_instances_and_caches_sharing_pipelines() {
    use kvgpu::{CacheSpec, DType, HostSlab, KvCache, LayerSpec};
    // Two `Gpu`s are two wgpu instances whose device ids can coincide: each cache must still use
    // pipelines of its own device.
    let (a, b) = (
        Gpu::from_env_blocking().unwrap(),
        Gpu::from_env_blocking().unwrap(),
    );
    let spec = CacheSpec::new(vec![LayerSpec::mla(4, 2)], DType::F16, 4).unwrap();
    let mut ca = KvCache::new(&a.device, &a.queue, spec.clone()).unwrap();
    let mut cb = KvCache::new(&b.device, &b.queue, spec.clone()).unwrap();
    // The registry carries its device's queue, so a cache sharing it cannot be handed another
    // device's queue (which used to write nothing and raise a wgpu mismatch).
    let mut shared = KvCache::with_kernels(ca.kernels().clone(), spec).unwrap();
    assert_eq!(shared.queue(), &a.queue);
    assert!(std::sync::Arc::ptr_eq(ca.kernels(), shared.kernels()));
    for (i, c) in [&mut ca, &mut cb, &mut shared].into_iter().enumerate() {
        let (x, y) = (vec![i as f32 + 1.0; 8], vec![-(i as f32); 4]);
        c.append(0, &[HostSlab::f32(&x, &[2, 4]), HostSlab::f32(&y, &[2, 2])])
            .unwrap();
        c.truncate_and_scrub(0).unwrap();
        c.append(0, &[HostSlab::f32(&x, &[2, 4]), HostSlab::f32(&y, &[2, 2])])
            .unwrap();
        c.advance(2).unwrap();
        c.reset().unwrap();
        c.append(
            0,
            &[
                HostSlab::f32(&x[..4], &[1, 4]),
                HostSlab::f32(&y[..2], &[1, 2]),
            ],
        )
        .unwrap();
        assert_eq!(c.read_f32(0, 0).unwrap(), vec![i as f32 + 1.0; 4]);
    }
}

#[test]
fn caches_made_on_many_threads_at_once_are_never_refused_their_own_queue() {
    use kvgpu::{CacheSpec, DType, HostSlab, KvCache, LayerSpec};
    // Each new registry checks that the queue is the device's own by polling the device; other
    // threads polling and submitting at the same time must not make that check fail.
    let gpu = Gpu::from_env_blocking().unwrap();
    let spec = CacheSpec::new(vec![LayerSpec::kv(1, 4, 4)], DType::F32, 8).unwrap();
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        // A thread of the app polling the device all the while.
        s.spawn(|| {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let _ = gpu.device.poll(wgpu::PollType::Poll);
            }
        });
        let makers: Vec<_> = (0..4)
            .map(|t| {
                let (gpu, spec) = (&gpu, spec.clone());
                s.spawn(move || {
                    for i in 0..10 {
                        let mut c = KvCache::new(&gpu.device, &gpu.queue, spec.clone())
                            .unwrap_or_else(|e| panic!("thread {t}, cache {i}: {e}"));
                        let x = vec![t as f32; 4];
                        c.append(
                            0,
                            &[HostSlab::f32(&x, &[1, 1, 4]), HostSlab::f32(&x, &[1, 1, 4])],
                        )
                        .unwrap();
                        c.reset().unwrap();
                    }
                })
            })
            .collect();
        for m in makers {
            m.join().unwrap();
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
    });
}
