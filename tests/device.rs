//! The device helper: an unmatched adapter name is an error listing what exists, not a panic.
#![cfg(not(target_arch = "wasm32"))]

mod common;

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
    // A part of the name, in another case, finds it too (llvmpipe's name goes on "(LLVM ...)").
    let word = name.split_whitespace().next().unwrap().to_uppercase();
    if word.len() < name.len() {
        let part = pollster::block_on(Gpu::open(backend.into(), Some(&word))).unwrap();
        assert_eq!(part.adapter.get_info().name, name, "{word}");
    } else {
        common::shared::skipped(&format!(
            "opening by a part of {name:?}, a name of one word"
        ));
    }
    assert!(any.limits().max_storage_buffer_binding_size >= 128 << 20);
}

/// A device of a wgpu instance of its own (not `Gpu::open`'s), on the backend `WGPU_BACKEND` names.
fn own_instance_gpu() -> Gpu {
    let instance =
        wgpu::Instance::new(wgpu::InstanceDescriptor::new_without_display_handle_from_env());
    let adapter = pollster::block_on(instance.request_adapter(&Default::default())).unwrap();
    let (device, queue) = pollster::block_on(adapter.request_device(&Default::default())).unwrap();
    Gpu {
        adapter,
        device,
        queue,
    }
}

#[test]
fn caches_of_two_instances_and_caches_sharing_pipelines() {
    use kvgpu::{CacheSpec, DType, HostSlab, KvCache, LayerSpec};
    // Two wgpu instances, whose device ids can coincide: each cache must still use pipelines of its
    // own device.
    let (a, b) = (Gpu::from_env_blocking().unwrap(), own_instance_gpu());
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

/// Two `Gpu`s opened on the same backends share one wgpu instance, so a cache or buffer of one is
/// refused by the other as another device's: with an instance each, their device and buffer ids
/// coincided, the cache passed as the attention's own, and wgpu met the other instance's ids
/// (a panic, or another buffer of the same id bound in its place).
#[test]
fn caches_and_buffers_of_another_gpu_are_refused() {
    use kvgpu::{Attention, CacheSpec, DType, Error, HostSlab, KvCache, LayerSpec, Queries};
    let (a, b) = (
        Gpu::from_env_blocking().unwrap(),
        Gpu::from_env_blocking().unwrap(),
    );
    assert_ne!(a.device, b.device);
    let spec = CacheSpec::new(vec![LayerSpec::kv(1, 8, 8)], DType::F32, 4).unwrap();
    let mut ca = KvCache::new(&a.device, &a.queue, spec.clone()).unwrap();
    let mut cb = KvCache::new(&b.device, &b.queue, spec).unwrap();
    let row = [0.5f32; 8];
    for c in [&mut ca, &mut cb] {
        c.append(
            0,
            &[
                HostSlab::f32(&row, &[1, 1, 8]),
                HostSlab::f32(&row, &[1, 1, 8]),
            ],
        )
        .unwrap();
    }
    let buffer = |g: &Gpu| {
        g.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("queries or output"),
            size: 32,
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        })
    };
    let (qa, qb) = (buffer(&a), buffer(&b));
    let mut att = Attention::new(&a.device, &a.queue).unwrap();
    let e = att
        .gqa(
            &cb,
            0,
            Queries::new(&qa, 1, 1, 8),
            &buffer(&a),
            &Default::default(),
        )
        .unwrap_err();
    assert!(
        matches!(&e, Error::ForeignDevice { what, .. } if what.starts_with("cache")),
        "{e}"
    );
    for (queries, out, which) in [(&qb, &qa, "query"), (&qa, &qb, "output")] {
        let e = att
            .gqa(
                &ca,
                0,
                Queries::new(queries, 1, 1, 8),
                out,
                &Default::default(),
            )
            .unwrap_err();
        assert!(
            matches!(&e, Error::ForeignDevice { what, .. } if what.starts_with(which)),
            "{which}: {e}"
        );
    }
    // And the Attention still serves its own device.
    att.gqa(
        &ca,
        0,
        Queries::new(&qa, 1, 1, 8),
        &buffer(&a),
        &Default::default(),
    )
    .unwrap();
}

/// After the device is lost, no call panics (`shared.rs`; the browser suite runs it too).
#[test]
fn no_call_panics_after_the_device_is_lost() {
    pollster::block_on(common::shared::no_call_panics_after_the_device_is_lost(
        common::gpu(),
    ));
}

/// `Gpu::with_adapter` opens kvgpu's device on an adapter of the app's own instance: the adapter's
/// full limits and exactly the features `features_for` names (the ones of kvgpu's list the adapter
/// has), and a cache on it works.
#[test]
fn a_device_opens_on_an_adapter_the_app_chose() {
    use kvgpu::{CacheSpec, DType, HostSlab, KvCache, LayerSpec, features_for};
    let instance =
        wgpu::Instance::new(wgpu::InstanceDescriptor::new_without_display_handle_from_env());
    let adapter = pollster::block_on(instance.request_adapter(&Default::default())).unwrap();
    let wanted = features_for(&adapter);
    let listed = wgpu::Features::SHADER_F16
        | wgpu::Features::TIMESTAMP_QUERY
        | wgpu::Features::SUBGROUP
        | wgpu::Features::SHADER_INT64;
    assert_eq!(wanted, adapter.features() & listed);
    let g = pollster::block_on(Gpu::with_adapter(adapter.clone())).unwrap();
    assert_eq!(g.device.features(), wanted);
    assert_eq!(
        g.device.limits().max_storage_buffer_binding_size,
        adapter.limits().max_storage_buffer_binding_size
    );
    let spec = CacheSpec::new(vec![LayerSpec::mla(4, 2)], DType::F16, 4).unwrap();
    let mut c = KvCache::new(&g.device, &g.queue, spec).unwrap();
    let (x, y) = ([0.5f32; 8], [-2.0f32; 4]);
    c.append(0, &[HostSlab::f32(&x, &[2, 4]), HostSlab::f32(&y, &[2, 2])])
        .unwrap();
    assert_eq!(c.read_f32(0, 0).unwrap(), x);
    assert_eq!(c.read_f32(0, 1).unwrap(), y);
}
