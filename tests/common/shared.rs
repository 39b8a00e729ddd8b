//! Test bodies shared by the native suites and the browser suite (`tests/web.rs`): async functions over
//! a [`Gpu`] that the browser harness awaits and a native harness can run with `pollster::block_on`,
//! and the one attention tolerance every suite uses. Include it with
//! `#[path = "common/shared.rs"] mod shared;`. Nothing here is native-only or browser-only except the
//! log line and the clock.
#![allow(dead_code)]

use kvgpu::reference::{self, CpuCache};
use kvgpu::wgpu::{self, util::DeviceExt};
use kvgpu::{
    Attention, AttentionOptions, CacheSpec, DType, Error, Gpu, GpuSlab, HostSlab, Kernels, KvCache,
    LayerSpec, MlaQueries, Queries, SlotSpec, read_buffer_async, verify_buffer,
};

/// Attention outputs may differ from the CPU twins by `|gpu - cpu| <= TOL · (1 + |cpu|)`: the twins
/// read back the values the cache stores and accumulate in f64, the GPU accumulates in f32 with its
/// own `exp`, so 1e-5 relative to the values' scale (|v| < 2), and never looser for larger outputs.
pub const TOL: f32 = 1e-5;

/// One token of an MLA layer of a latent of 4 and a rope key of 2, f32, read from `buffer`: its
/// latent from element `offset`, its rope key right after. The source of the mapping tests
/// (tests/hostile.rs, tests/web.rs).
pub fn mla_4_2_token(buffer: &wgpu::Buffer, offset: u64) -> [GpuSlab<'_>; 2] {
    let slab = |offset, shape| GpuSlab {
        buffer,
        dtype: DType::F32,
        offset,
        shape,
        strides: None,
    };
    [slab(offset, &[1, 4]), slab(offset + 4, &[1, 2])]
}

/// A line on stderr natively, on the browser console (shown with `-- --nocapture`) in the browser.
macro_rules! note {
    ($($arg:tt)*) => {{
        #[cfg(target_arch = "wasm32")]
        wasm_bindgen_test::console_log!($($arg)*);
        #[cfg(not(target_arch = "wasm32"))]
        eprintln!($($arg)*);
    }};
}
// For the harnesses; a harness that logs nothing itself leaves it unused.
#[allow(unused_imports)]
pub(crate) use note;

/// Says that part of a test was skipped here, and why: in the test's output (the browser suite's
/// log; natively only a failing test's output is shown), and natively also as a line appended to
/// the file `KVGPU_SKIPS` names, with the backend and the test, which `.ci/run` lists at its end.
pub fn skipped(why: &str) {
    note!("skipped here: {why}");
    #[cfg(not(target_arch = "wasm32"))]
    if let Some(path) = std::env::var_os("KVGPU_SKIPS") {
        use std::io::Write;
        let backend = std::env::var("WGPU_BACKEND").unwrap_or_default();
        let thread = std::thread::current();
        let test = thread.name().unwrap_or("a test");
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path);
        // One write per line: tests running at once append whole lines.
        let line = format!("[{backend}] {test}: {why}\n");
        let written = file.and_then(|mut f| f.write_all(line.as_bytes()));
        assert!(written.is_ok(), "KVGPU_SKIPS={path:?}: {written:?}");
    }
}

// The scenario bodies, one file per subject (this file keeps the helpers and the defect checks).
#[path = "attention_bodies.rs"]
pub mod attention_bodies;
#[path = "cache_bodies.rs"]
pub mod cache_bodies;
#[path = "memory_bodies.rs"]
pub mod memory_bodies;
#[path = "model_bodies.rs"]
pub mod model_bodies;
#[path = "paged_bodies.rs"]
pub mod paged_bodies;
#[path = "quant_bodies.rs"]
pub mod quant_bodies;
#[path = "snapshot_bodies.rs"]
pub mod snapshot_bodies;
#[path = "source_bodies.rs"]
pub mod source_bodies;

/// Wall-clock seconds since it was started: `performance.now()` in the browser, where
/// `std::time::Instant` panics.
pub struct Stopwatch(f64);

impl Stopwatch {
    pub fn start() -> Self {
        Self(now_ms())
    }

    pub fn seconds(&self) -> f64 {
        (now_ms() - self.0) / 1e3
    }
}

#[cfg(target_arch = "wasm32")]
fn now_ms() -> f64 {
    web_sys::window()
        .and_then(|w| w.performance())
        .map_or(0.0, |p| p.now())
}

#[cfg(not(target_arch = "wasm32"))]
fn now_ms() -> f64 {
    static ORIGIN: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    ORIGIN
        .get_or_init(std::time::Instant::now)
        .elapsed()
        .as_secs_f64()
        * 1e3
}

/// A cache of `spec` on `g`'s device.
pub fn cache_on(g: &Gpu, spec: CacheSpec) -> KvCache {
    KvCache::with_kernels(kernels_for(g), spec).expect("cache fits the device")
}

/// The one kernel registry of `g`'s device for the whole test run: the bodies' caches and attention
/// share it, so each pipeline variant compiles once per run, not once per test (a cold OpenGL compile
/// costs up to seconds). Tests of `Kernels::new`, `KvCache::new` and `Attention::new` themselves make
/// their own.
pub fn kernels_for(g: &Gpu) -> std::sync::Arc<kvgpu::Kernels> {
    type Registries = Vec<(wgpu::Device, std::sync::Arc<kvgpu::Kernels>)>;
    fn find_or_make(all: &mut Registries, g: &Gpu) -> std::sync::Arc<kvgpu::Kernels> {
        if let Some((_, k)) = all.iter().find(|(d, _)| d == &g.device) {
            return k.clone();
        }
        let k = kvgpu::Kernels::new(&g.device, &g.queue).expect("the device's own queue");
        all.push((g.device.clone(), k.clone()));
        k
    }
    #[cfg(not(target_arch = "wasm32"))]
    {
        static ALL: std::sync::Mutex<Registries> = std::sync::Mutex::new(Vec::new());
        let mut all = ALL
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        find_or_make(&mut all, g)
    }
    #[cfg(target_arch = "wasm32")]
    {
        thread_local! {
            static ALL: std::cell::RefCell<Registries> = const { std::cell::RefCell::new(Vec::new()) };
        }
        ALL.with(|all| find_or_make(&mut all.borrow_mut(), g))
    }
}

/// A second device with WebGPU's default limits (what a page gets when it asks for nothing: 128 MiB
/// per storage binding, 256 MiB per buffer). Natively it comes from `g`'s adapter; a browser adapter
/// makes one device, so there it gets an adapter of its own.
pub async fn default_limits_gpu(g: &Gpu) -> Gpu {
    gpu_with_limits(g, wgpu::Limits::default()).await
}

/// A second device with `limits` (lower ones make size limits cheap to reach).
pub async fn gpu_with_limits(g: &Gpu, limits: wgpu::Limits) -> Gpu {
    gpu_with(g, limits, wgpu::Features::empty()).await
}

/// A second device with `limits` and `features` (which the adapter must offer).
pub async fn gpu_with(g: &Gpu, limits: wgpu::Limits, features: wgpu::Features) -> Gpu {
    #[cfg(target_arch = "wasm32")]
    let adapter = {
        let _ = g;
        wgpu::Instance::new(wgpu::InstanceDescriptor {
            backends: wgpu::Backends::BROWSER_WEBGPU,
            ..wgpu::InstanceDescriptor::new_without_display_handle_from_env()
        })
        .request_adapter(&Default::default())
        .await
        .expect("a second WebGPU adapter")
    };
    #[cfg(not(target_arch = "wasm32"))]
    let adapter = g.adapter.clone();
    let (device, queue) = adapter
        .request_device(&wgpu::DeviceDescriptor {
            required_limits: limits,
            required_features: features,
            ..Default::default()
        })
        .await
        .expect("a device with the limits asked for");
    let gpu = Gpu {
        adapter,
        device,
        queue,
    };
    keep_for_the_suite(&gpu);
    gpu
}

/// In the browser every device a test opens lives until the suite ends: a full garbage collection
/// (the memory tests call `gc()`) that collected a dropped `GPUDevice` stalled Chromium's renderer
/// for minutes (Chromium 156, SwiftShader). Natively nothing is kept. In the browser the errors
/// WebGPU reports on the device that no error scope catches are collected for
/// [`assert_no_uncaptured_errors`] (natively wgpu panics on them itself).
pub fn keep_for_the_suite(gpu: &Gpu) {
    #[cfg(target_arch = "wasm32")]
    {
        thread_local!(static KEPT: std::cell::RefCell<Vec<Gpu>> = Default::default());
        KEPT.with(|kept| kept.borrow_mut().push(gpu.clone()));
        gpu.device.on_uncaptured_error(std::sync::Arc::new(|e| {
            uncaptured().push(e.to_string());
        }));
    }
    #[cfg(not(target_arch = "wasm32"))]
    let _ = gpu;
}

/// The errors WebGPU reported that no error scope caught, since the last check.
#[cfg(target_arch = "wasm32")]
fn uncaptured() -> std::sync::MutexGuard<'static, Vec<String>> {
    static UNCAPTURED: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
    UNCAPTURED
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// In the browser, fails with every error WebGPU reported that no error scope caught since the last
/// check (a validation error kvgpu triggered, a refused allocation): kvgpu must trigger none. A
/// scope pushed and popped on `gpu`'s device answers once the device has checked the work before
/// it, so that work's errors are in by then. `when` says what ran before.
#[cfg(target_arch = "wasm32")]
pub async fn assert_no_uncaptured_errors(gpu: &Gpu, when: &str) {
    let _ = gpu
        .device
        .push_error_scope(wgpu::ErrorFilter::Validation)
        .pop()
        .await;
    let errors = std::mem::take(&mut *uncaptured());
    // A second device's errors may come after the round trip on `gpu`'s: they then fail the next
    // check, which says so.
    assert!(
        errors.is_empty(),
        "WebGPU reported errors that no scope caught {when} (or, from a second device, late from \
         an earlier test): {errors:#?}"
    );
}

/// Largest `|got - want| / (1 + |want|)`, after checking every element is within [`TOL`].
pub fn assert_close(got: &[f32], want: &[f32], what: &str) -> f32 {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let mut worst = 0f32;
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let err = (g - w).abs() / (1.0 + w.abs());
        assert!(
            err <= TOL,
            "{what}: element {i}: gpu {g} vs cpu {w} (scaled error {err:e} > {TOL:e})"
        );
        worst = worst.max(err);
    }
    worst
}

/// Deterministic pseudo-random values in [-2, 2).
pub fn values(seed: u64, n: usize) -> Vec<f32> {
    reference::pseudo_random(seed, n, 2.0)
}

pub const USAGE: wgpu::BufferUsages = wgpu::BufferUsages::STORAGE
    .union(wgpu::BufferUsages::COPY_SRC)
    .union(wgpu::BufferUsages::COPY_DST);

/// A buffer of `device` holding `words`, verified for its device (so a browser's synchronous calls
/// take it; see `kvgpu::verify_buffer`).
pub async fn buffer_with(
    device: &wgpu::Device,
    words: &[u32],
    usage: wgpu::BufferUsages,
) -> wgpu::Buffer {
    let buffer = device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
        label: Some("test source"),
        contents: bytemuck::cast_slice(words),
        usage,
    });
    kvgpu::verify_buffer(device, &buffer)
        .await
        .expect("a buffer of its own device is verified");
    buffer
}

/// A verified storage buffer holding `data`, readable with [`read_f32`].
pub async fn f32_buffer(device: &wgpu::Device, data: &[f32]) -> wgpu::Buffer {
    let words: Vec<u32> = data.iter().map(|x| x.to_bits()).collect();
    buffer_with(device, &words, USAGE).await
}

/// An output buffer of `n` f32 filled with a sentinel, so untouched outputs are visible.
pub async fn output(device: &wgpu::Device, n: usize) -> wgpu::Buffer {
    f32_buffer(device, &vec![-7.0; n]).await
}

/// An f32 buffer of the test (an attention output) copied to the host.
pub async fn read_f32(g: &Gpu, buffer: &wgpu::Buffer) -> Vec<f32> {
    let bytes = kvgpu::read_buffer_async(&g.device, &g.queue, buffer, 0, buffer.size())
        .await
        .expect("read back a test buffer");
    bytemuck::pod_collect_to_vec(&bytes)
}

/// Every word of every slot buffer, read back from the GPU.
pub async fn snapshot(cache: &KvCache) -> Vec<Vec<Vec<u32>>> {
    let mut out = Vec::new();
    for (l, layer) in cache.spec().layers().iter().enumerate() {
        let mut slots = Vec::new();
        for s in 0..layer.slots.len() {
            slots.push(cache.read_full_words_async(l, s).await.unwrap());
        }
        out.push(slots);
    }
    out
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

/// Appends `n` rows of pseudo-random f32 data to every slot of `layer`, on the GPU and in the model.
pub fn append_both(c: &mut KvCache, m: &mut CpuCache, layer: usize, n: usize, seed: u64) {
    let start = c.visible(layer).unwrap();
    for (s, d) in append_random(c, layer, n, seed).iter().enumerate() {
        model_rows(m, layer, s, start, d);
    }
}

/// f32 rows written into slot `slot` of `layer` of the model from row `at`, as the slot stores them.
pub fn model_rows(m: &mut CpuCache, layer: usize, slot: usize, at: usize, data: &[f32]) {
    let dtype = m.dtype(layer, slot).expect("the model has the slot");
    let bits: Vec<u32> = data
        .iter()
        .map(|&x| reference::f32_to_bits(x, dtype))
        .collect();
    m.write_rows(layer, slot, at, &bits);
}

/// Every slot buffer on the GPU equals the model, word for word, at full capacity.
pub async fn assert_matches(c: &KvCache, m: &CpuCache) {
    assert_eq!(
        snapshot(c).await,
        m.words,
        "GPU buffers differ from the CPU model"
    );
}

/// A cache of one layer with one slot of `row` elements.
fn one_slot(kernels: &std::sync::Arc<Kernels>, row: usize, dtype: DType, cap: usize) -> KvCache {
    let spec = CacheSpec::new(
        vec![LayerSpec::new(vec![SlotSpec::new("x", &[row])])],
        dtype,
        cap,
    )
    .unwrap();
    KvCache::with_kernels(kernels.clone(), spec).expect("cache fits the device")
}

/// A 16-bit GPU source of 6 bytes holding `[1, 3]` elements: its last word would reach byte 8, so it
/// is refused with `SourceWordTail` before anything is recorded, changing nothing, while a valid append
/// to another cache recorded earlier in the same encoder survives. f16 and bf16 caches only: the good
/// append is a copy of same-typed 16-bit rows, which quantized storage cannot have.
pub async fn a_16_bit_source_ending_inside_a_word_is_refused_before_recording(g: &Gpu) {
    let kernels = Kernels::new(&g.device, &g.queue).unwrap();
    for dtype in [DType::F16, DType::BF16] {
        let mut bad_cache = one_slot(&kernels, 3, dtype, 4);
        let mut good_cache = one_slot(&kernels, 3, dtype, 4);
        let mut model = CpuCache::new(good_cache.spec());
        let six = g.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("six bytes"),
            size: 6,
            usage: USAGE,
            mapped_at_creation: false,
        });
        let shape = [1, 3];
        let slab = GpuSlab {
            buffer: &six,
            dtype,
            offset: 0,
            shape: &shape,
            strides: None,
        };
        let bits = [1.5, -2.0, 0.25].map(|x| reference::f32_to_bits(x, dtype));
        let good_src = buffer_with(&g.device, &reference::pack_rows(&bits, dtype, 3), USAGE).await;
        let good = GpuSlab {
            buffer: &good_src,
            ..slab
        };
        let ledger = bad_cache.ledger().clone();
        let mut encoder = g.device.create_command_encoder(&Default::default());
        good_cache
            .record_append_gpu(&mut encoder, 0, &[good])
            .unwrap();
        let e = bad_cache
            .record_append_gpu(&mut encoder, 0, &[slab])
            .unwrap_err();
        assert!(
            matches!(
                e,
                Error::SourceWordTail {
                    layer: 0,
                    slot: 0,
                    needed: 8,
                    size: 6
                }
            ),
            "{dtype}: {e}"
        );
        assert_eq!(
            bad_cache.ledger(),
            &ledger,
            "{dtype}: the refusal changed the ledger"
        );
        g.queue.submit([encoder.finish()]);
        good_cache.advance(1).unwrap();
        model.write_rows(0, 0, 0, &bits);
        assert_eq!(snapshot(&good_cache).await, model.words, "{dtype}");
        assert_eq!(
            bad_cache.append_gpu(0, &[slab]).unwrap_err(),
            e,
            "{dtype}: append_gpu"
        );
        assert_eq!(bad_cache.ledger(), &ledger);
        let untouched = CpuCache::new(bad_cache.spec());
        assert_eq!(
            snapshot(&bad_cache).await,
            untouched.words,
            "{dtype}: the refused cache's memory"
        );
        note!("{dtype}: refused as expected: {e}");
    }
}

/// App buffers of another device are refused before anything is recorded, and nothing changes:
/// `verify_buffer` names them (`ForeignBuffer`); GPU append sources on the copy path (same type,
/// contiguous) and the kernel path (f32 into 16-bit storage), attention queries and outputs are
/// refused as `ForeignDevice` natively, where the call checks them itself, and as
/// `UnverifiedBuffer` in a browser, where WebGPU answers only asynchronously and the call takes
/// only verified buffers; a readback refuses them too. For every storage type the ledger and GPU
/// memory stay as they were, and the cache and the attention still take buffers of their own device
/// (in a browser once verified). Quantized storage has no copy path (GPU sources hold elements), so
/// there the second source is an f16 one, on the kernel path too; the block types take heads of 32.
pub async fn app_buffers_of_another_device_are_refused(g: &Gpu) {
    let other = default_limits_gpu(g).await;
    let web = cfg!(target_arch = "wasm32");
    // The refusal of a synchronous call: checked by the call natively, unverified in a browser.
    let refused = |e: &Error, part: &str| match e {
        Error::ForeignDevice { layer: 0, what } if !web => what.contains(part),
        Error::UnverifiedBuffer { layer: 0, what } if web => what.contains(part),
        _ => false,
    };
    let mut attention = Attention::with_kernels(kernels_for(g));
    for dtype in DType::STORAGE {
        let d = dtype.block().unwrap_or(4);
        let spec = CacheSpec::new(vec![LayerSpec::kv(2, d, d)], dtype, 4).unwrap();
        let mut c = cache_on(g, spec.clone());
        // The type of the first source: the storage type, or f16 for quantized storage.
        let held = if dtype.is_quantized() {
            DType::F16
        } else {
            dtype
        };
        let bits: Vec<u32> = values(3, 4 * d)
            .iter()
            .map(|&x| reference::f32_to_bits(x, held))
            .collect();
        let words = reference::pack_rows(&bits, held, 2 * d);
        // Same type and contiguous: the copy path; f32 into 16-bit (or quantized) storage: the
        // kernel path.
        let same = buffer_with(&other.device, &words, USAGE).await;
        let f32_words: Vec<u32> = values(4, 4 * d).iter().map(|x| x.to_bits()).collect();
        let converted = buffer_with(&other.device, &f32_words, USAGE).await;
        for foreign in [&same, &converted] {
            let e = verify_buffer(&g.device, foreign).await.unwrap_err();
            assert!(matches!(e, Error::ForeignBuffer { .. }), "{dtype}: {e}");
        }
        let shape = [2, 2, d];
        let copy = GpuSlab::contiguous(&same, held, &shape);
        let kernel_strides = [2 * d, d, 1];
        let kernel = GpuSlab {
            buffer: &converted,
            dtype: DType::F32,
            offset: 0,
            shape: &shape,
            strides: Some(&kernel_strides),
        };
        let before = snapshot(&c).await;
        let ledger = c.ledger().clone();
        for slabs in [[copy, copy], [kernel, kernel], [copy, kernel]] {
            let e = c.append_gpu(0, &slabs).unwrap_err();
            assert!(refused(&e, "source"), "{dtype}: {e}");
            assert_eq!(
                c.ledger(),
                &ledger,
                "{dtype}: the refusal changed the ledger"
            );
        }
        assert_eq!(snapshot(&c).await, before);
        // A buffer of its own device, not verified: taken natively; in a browser refused until
        // verified.
        let own = g
            .device
            .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: Some("own, unverified"),
                contents: bytemuck::cast_slice(&f32_words),
                usage: USAGE,
            });
        let slab = GpuSlab {
            buffer: &own,
            ..kernel
        };
        if web {
            let e = c.append_gpu(0, &[slab, slab]).unwrap_err();
            assert!(refused(&e, "source"), "{dtype}: {e}");
            assert_eq!(
                c.ledger(),
                &ledger,
                "{dtype}: the refusal changed the ledger"
            );
        }
        verify_buffer(&g.device, &own).await.unwrap();
        c.append_gpu(0, &[slab, slab]).unwrap();
        c.advance(2).unwrap();
        assert_eq!(c.visible(0).unwrap(), 2);

        // Attention: queries or output of the other device, then (in a browser) unverified ones of
        // its own.
        let q_words: Vec<u32> = values(5, 2 * d).iter().map(|x| x.to_bits()).collect();
        let zeros = vec![0; 2 * d];
        let q_foreign = buffer_with(&other.device, &q_words, USAGE).await;
        let out_foreign = buffer_with(&other.device, &zeros, USAGE).await;
        let q = buffer_with(&g.device, &q_words, USAGE).await;
        let out = buffer_with(&g.device, &zeros, USAGE).await;
        let fresh = |words: &[u32]| {
            g.device
                .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                    label: Some("own, unverified"),
                    contents: bytemuck::cast_slice(words),
                    usage: USAGE,
                })
        };
        let (q_fresh, out_fresh) = (fresh(&q_words), fresh(&zeros));
        let mut calls = vec![(&q_foreign, &out, "query"), (&q, &out_foreign, "output")];
        if web {
            calls.extend([(&q_fresh, &out, "query"), (&q, &out_fresh, "output")]);
        }
        let options = AttentionOptions::default();
        for (q_buf, out_buf, part) in calls {
            let e = attention
                .gqa(&c, 0, Queries::new(q_buf, 1, 2, d), out_buf, &options)
                .unwrap_err();
            assert!(refused(&e, part), "{dtype}: {e}");
        }
        assert_eq!(
            read_f32(g, &out).await,
            vec![0.0; 2 * d],
            "{dtype}: output written"
        );
        attention
            .gqa(&c, 0, Queries::new(&q, 1, 2, d), &out, &options)
            .unwrap();
        let want = reference::attention_gqa(
            &values(5, 2 * d),
            [1, 2, d],
            &c.read_f32_async(0, 0).await.unwrap(),
            &c.read_f32_async(0, 1).await.unwrap(),
            2,
            d,
            &options,
        );
        assert_close(&read_f32(g, &out).await, &want, &format!("{dtype}: output"));

        // A readback of the other device's buffer through this device.
        let e = read_buffer_async(&g.device, &g.queue, &same, 0, 4)
            .await
            .unwrap_err();
        assert!(matches!(e, Error::Device { .. }), "{dtype}: {e}");
    }
}

/// A device handed the queue of another device is refused as `QueueMismatch` everywhere a queue
/// comes in: a cache, a kernel registry (so `KvCache::with_kernels` cannot get the pair either), an
/// `Attention` and a readback. Each pair of its own works, and a cache made from it writes and reads.
pub async fn a_queue_of_another_device_is_refused(g: &Gpu) {
    let other = default_limits_gpu(g).await;
    let spec = CacheSpec::new(vec![LayerSpec::mla(4, 2)], DType::F16, 4).unwrap();
    for (device, queue) in [(&g.device, &other.queue), (&other.device, &g.queue)] {
        let e = KvCache::new(device, queue, spec.clone()).unwrap_err();
        assert_eq!(e, Error::QueueMismatch);
        assert_eq!(
            Kernels::new(device, queue).unwrap_err(),
            Error::QueueMismatch
        );
        assert_eq!(
            Attention::new(device, queue).unwrap_err(),
            Error::QueueMismatch
        );
        let b = f32_buffer(device, &[1.0; 4]).await;
        assert_eq!(
            kvgpu::read_buffer_async(device, queue, &b, 0, 16)
                .await
                .unwrap_err(),
            Error::QueueMismatch
        );
        note!("refused as expected: {e}");
    }
    for gpu in [g, &other] {
        let kernels = Kernels::new(&gpu.device, &gpu.queue).unwrap();
        let mut c = KvCache::with_kernels(kernels, spec.clone()).unwrap();
        assert_eq!(c.queue(), &gpu.queue);
        let (x, y) = (values(1, 4), values(2, 2));
        c.append(0, &[HostSlab::f32(&x, &[1, 4]), HostSlab::f32(&y, &[1, 2])])
            .unwrap();
        c.advance(1).unwrap();
        let want: Vec<f32> = x
            .iter()
            .map(|&v| reference::round_trip(v, DType::F16))
            .collect();
        assert_eq!(c.read_f32_async(0, 0).await.unwrap(), want);
        Attention::new(&gpu.device, &gpu.queue).unwrap();
    }
}

/// After the device is lost (`Device::destroy`, as a driver loss would), no call panics, on a device
/// of its own. wgpu 30 reports nothing a lost device fails to make and hands out invalid buffers,
/// whose first write or mapping was a wgpu validation error, natively a panic without an app's
/// handler: every readback and export, every call that made a buffer (the parameter ring,
/// attention's scratch, an upload, a new cache, pool or registry). Natively those now refuse with
/// `Error::DeviceLost`, and calls whose buffers were all made before the loss write nothing
/// and return. In the browser readbacks and exports fail, the rest return, and WebGPU reports no
/// error (the suite's check). Two rounds: nothing made before the loss, and every kind of buffer
/// made before it.
pub async fn no_call_panics_after_the_device_is_lost(g: &Gpu) {
    use kvgpu::{Kv, PagedCache};
    let native = cfg!(not(target_arch = "wasm32"));
    let lost = |e: &Error| !native || matches!(e, Error::DeviceLost { .. });
    for used_before in [false, true] {
        let g = default_limits_gpu(g).await;
        let spec = CacheSpec::new(vec![LayerSpec::kv(2, 8, 8)], DType::F16, 64).unwrap();
        let mut c = KvCache::new(&g.device, &g.queue, spec.clone()).unwrap();
        let mut p = PagedCache::new(&g.device, &g.queue, spec.clone(), 4, 8).unwrap();
        let s = p.add_sequence().unwrap();
        let x = [0.25f32; 16];
        let rows = [HostSlab::f32(&x, &[1, 2, 8]), HostSlab::f32(&x, &[1, 2, 8])];
        c.append(0, &rows).unwrap();
        c.advance(1).unwrap();
        p.append(s, 0, &rows).unwrap();
        p.advance(s, 1).unwrap();
        let snapshot = c.snapshot_async().await.unwrap();
        let pool_snapshot = p.snapshot_sequence_async(s).await.unwrap();
        let (q, out, src) = (
            f32_buffer(&g.device, &[1.0; 64]).await,
            output(&g.device, 64).await,
            f32_buffer(&g.device, &[0.5; 64]).await,
        );
        let shape = [1, 2, 8];
        let slab = GpuSlab::contiguous(&src, DType::F32, &shape);
        let opts = AttentionOptions::default();
        let mut att = Attention::for_cache(&c);
        let batch = [(s, 1)];
        if used_before {
            att.gqa(&c, 0, Queries::new(&q, 1, 2, 8), &out, &opts)
                .unwrap();
            let queries = Queries::new(&q, 1, 2, 8);
            att.gqa(Kv::Batch(&p, &batch), 0, queries, &out, &opts)
                .unwrap();
            c.append_gpu(0, &[slab, slab]).unwrap();
            c.append_layers(&[&rows[..]]).unwrap();
            c.advance(2).unwrap();
            c.truncate_and_scrub(1).unwrap();
            assert_eq!(c.read_f32_async(0, 0).await.unwrap(), vec![0.25; 16]);
        }
        g.device.destroy();
        let round = if used_before {
            "made before"
        } else {
            "nothing made"
        };
        for (what, e) in [
            ("read_f32", c.read_f32_async(0, 0).await.unwrap_err()),
            ("read_words", c.read_words_async(0, 1).await.unwrap_err()),
            ("export", c.snapshot_async().await.unwrap_err()),
            ("pool read", p.read_f32_async(s, 0, 0).await.unwrap_err()),
            (
                "pool export",
                p.snapshot_sequence_async(s).await.unwrap_err(),
            ),
        ] {
            assert!(lost(&e), "{round}: {what}: {e}");
        }
        // Made now: natively refused.
        for (what, result) in [
            (
                "new cache",
                KvCache::new(&g.device, &g.queue, spec.clone()).map(|_| ()),
            ),
            (
                "new pool",
                PagedCache::new(&g.device, &g.queue, spec.clone(), 4, 8).map(|_| ()),
            ),
            (
                "new registry",
                Kernels::new(&g.device, &g.queue).map(|_| ()),
            ),
        ] {
            match result {
                Err(e) => assert!(lost(&e), "{round}: {what}: {e}"),
                Ok(()) => assert!(!native, "{round}: {what} passed"),
            }
        }
        // Calls that make their buffers now are refused natively; with them made before, they
        // return. (`destroy` also destroyed the app's buffers, which a call may refuse first.)
        let refused = |e: &Error| lost(e) || e.to_string().contains("destroyed");
        let mut fresh = Attention::for_cache(&c);
        let made_now = [
            (
                "new attention",
                fresh.gqa(&c, 0, Queries::new(&q, 1, 2, 8), &out, &opts),
            ),
            ("append_gpu", c.append_gpu(0, &[slab, slab]).map(|_| ())),
            ("append_layers", c.append_layers(&[&rows[..]])),
            (
                "gqa",
                att.gqa(&c, 0, Queries::new(&q, 1, 2, 8), &out, &opts),
            ),
            (
                "pool gqa",
                att.gqa(
                    Kv::Batch(&p, &batch),
                    0,
                    Queries::new(&q, 1, 2, 8),
                    &out,
                    &opts,
                ),
            ),
            ("truncate_and_scrub", c.truncate_and_scrub(0)),
            ("reset", c.reset()),
        ];
        for (what, result) in made_now {
            match result {
                Err(e) => assert!(refused(&e), "{round}: {what}: {e}"),
                Ok(()) => assert!(used_before || !native, "{round}: {what} passed"),
            }
        }
        // Writes into buffers made before the loss: nothing to refuse, nothing written.
        c.append(0, &rows).unwrap();
        p.append(s, 0, &rows).unwrap();
        c.view(0, 0).unwrap();
        if let Ok(mut empty) = KvCache::with_kernels(c.kernels().clone(), spec.clone()) {
            let _ = empty.import(&snapshot);
        }
        let _ = p.import_sequence(&pool_snapshot);
        let _ = att.prepare(&c, 2);
    }
}

/// 4,100 kernel appends recorded before one submission: each reads the parameters it was recorded
/// with, word for word against the CPU model.
pub async fn thousands_of_recorded_appends_in_one_encoder_keep_their_own_parameters(g: &Gpu) {
    let n = 4100;
    let kernels = Kernels::new(&g.device, &g.queue).unwrap();
    let mut c = one_slot(&kernels, 3, DType::F16, n);
    let mut m = CpuCache::new(c.spec());
    let src: Vec<u32> = values(9, 64).iter().map(|x| x.to_bits()).collect();
    let buf = buffer_with(&g.device, &src, USAGE).await;
    let mut encoder = g.device.create_command_encoder(&Default::default());
    let shape = [1, 3];
    for i in 0..n {
        let offset = i % 61;
        let slab = GpuSlab {
            buffer: &buf,
            dtype: DType::F32,
            offset: offset as u64,
            shape: &shape,
            strides: Some(&[3, 1]),
        };
        c.record_append_gpu(&mut encoder, 0, &[slab]).unwrap();
        let bits: Vec<u32> = src[offset..offset + 3]
            .iter()
            .map(|&b| reference::convert_bits(b, DType::F32, DType::F16))
            .collect();
        m.write_rows(0, 0, i, &bits);
    }
    g.queue.submit([encoder.finish()]);
    c.advance(n).unwrap();
    assert_eq!(snapshot(&c).await, m.words);
}

/// f16 / bf16 rows of 7 elements (4 words, one padding half) from an f32 source, or a source of the
/// storage type, whose rows start on 16-byte boundaries (row stride 8): the path that moves whole
/// 16-byte vectors must leave the padding half of every row zero. The whole buffer is compared with
/// the CPU twin. Only f16 and bf16: the test is about the padding half of 16-bit rows on the 16-byte
/// path, which quantized storage does not take.
pub async fn the_16_byte_path_leaves_the_padding_half_zero(g: &Gpu) {
    let kernels = Kernels::new(&g.device, &g.queue).unwrap();
    for (dtype, from) in [
        (DType::F16, DType::F32),
        (DType::BF16, DType::F32),
        (DType::F16, DType::F16),
        (DType::BF16, DType::BF16),
    ] {
        let n = 5;
        let mut c = one_slot(&kernels, 7, dtype, 8);
        let mut m = CpuCache::new(c.spec());
        // Rows of 8 elements, the 8th of each a non-zero value that must not land in the padding.
        let values: Vec<u32> = (0..n * 8)
            .map(|i| reference::f32_to_bits(1.0 + i as f32, from))
            .collect();
        let src = reference::pack_rows(&values, from, 8);
        let buf = buffer_with(&g.device, &src, USAGE).await;
        let shape = [n, 7];
        c.append_gpu(
            0,
            &[GpuSlab {
                buffer: &buf,
                dtype: from,
                offset: 0,
                shape: &shape,
                strides: Some(&[8, 1]),
            }],
        )
        .unwrap();
        let bits = reference::slab_write(&values, from, 0, &shape, &[8, 1], dtype);
        m.words[0][0][..bits.len()].copy_from_slice(&bits);
        assert_eq!(snapshot(&c).await, m.words, "{dtype} from {from}");
        let words = c.read_full_words_async(0, 0).await.unwrap();
        for row in 0..n {
            assert_eq!(
                words[row * 4 + 3] >> 16,
                0,
                "{dtype} from {from}: padding half of row {row}"
            );
        }
    }
}

/// MLA with DeepSeek-V2-Lite's shapes (16 heads, compressed_kv 512, k_pe 64): `n_q` queries over
/// `visible` rows (`visible - n_q` committed, `n_q` appended this step), against
/// `reference::attention_mla`; returns the worst scaled error.
pub async fn deepseek_v2_lite_mla_matches_the_reference(
    g: &Gpu,
    dtype: DType,
    visible: usize,
    n_q: usize,
) -> f32 {
    let (n_heads, r, p, seed) = (16, 512, 64, 80);
    let spec = CacheSpec::new(vec![LayerSpec::mla(r, p)], dtype, visible).unwrap();
    // The run's shared kernel registry: `attention_over_4096_rows_splits_the_sequence` runs the shape.
    let mut c = cache_on(g, spec);
    append_random(&mut c, 0, visible - n_q, seed);
    c.advance(visible - n_q).unwrap();
    append_random(&mut c, 0, n_q, seed + 1);
    assert_eq!(c.visible(0).unwrap(), visible);
    let ql = values(seed + 77, n_q * n_heads * r);
    let qr = values(seed + 78, n_q * n_heads * p);
    let (qlb, qrb) = (
        f32_buffer(&g.device, &ql).await,
        f32_buffer(&g.device, &qr).await,
    );
    let out = output(&g.device, n_q * n_heads * r).await;
    let options = AttentionOptions {
        scale: Some(0.07),
        ..Default::default()
    };
    let clock = Stopwatch::start();
    Attention::for_cache(&c)
        .mla(
            &c,
            0,
            MlaQueries {
                latent: Queries::new(&qlb, n_q, n_heads, r),
                rope: Queries::new(&qrb, n_q, n_heads, p),
            },
            &out,
            &options,
        )
        .unwrap();
    let got = read_f32(g, &out).await;
    let gpu_s = clock.seconds();
    let clock = Stopwatch::start();
    let want = reference::attention_mla(
        &ql,
        &qr,
        [n_q, n_heads, r],
        &c.read_f32_async(0, 0).await.unwrap(),
        &c.read_f32_async(0, 1).await.unwrap(),
        p,
        &options,
    );
    let cpu_s = clock.seconds();
    let worst = assert_close(
        &got,
        &want,
        &format!("{dtype} MLA, {n_q} queries, {visible} rows"),
    );
    note!(
        "{dtype}: MLA {n_q} queries x {n_heads} heads over {visible} rows: worst scaled error \
         {worst:e} (GPU {gpu_s:.1} s, CPU twin {cpu_s:.1} s)"
    );
    worst
}

/// Rows `r` of `[0, n)` whose bit `e` is set.
pub fn ones_below(n: usize, e: usize) -> usize {
    if e >= 40 {
        return 0;
    }
    let (n, period) = (n as u64, 2u64 << e);
    (n / period * (period / 2) + (n % period).saturating_sub(period / 2)) as usize
}

/// 16 queries (4 heads on 1 KV head, d = 64) over `visible` rows with K = 0, so every visible row
/// weighs the same, and V's element `e` = bit `e` of the row index: each output is the share of the
/// query's rows with that bit set. Times the rows seen, it is that count of rows to within half a
/// row (the counts are sums of 0 and 1 below 2^24, exact in f32; only the last division rounds). A
/// dropped or repeated run of rows moves the count of each bit set throughout the run by about half
/// the run's length or more, so runs of a few rows show; the relative tolerance alone let a run of
/// over a dozen rows go at 2^19 rows. K and V are stored as `types`; on the run's shared kernel registry
/// (`gqa_matches` runs the same shape); V's type must store 0 and 1 exactly.
pub async fn many_queries_over_a_long_context_see_every_row(
    g: &Gpu,
    types: [DType; 2],
    visible: usize,
) {
    let (n_kv, group, d, n_q) = (1, 4, 64, 16);
    let ones = reference::round_trip_rows(&[1.0; 64], types[1], 64);
    assert!(
        ones.iter().all(|&x| x == 1.0),
        "{types:?}: V must store 1 exactly"
    );
    let layer = attention_bodies::stored_as(LayerSpec::kv(n_kv, d, d), types);
    let spec = CacheSpec::new(vec![layer], types[0], visible).unwrap();
    let mut c = cache_on(g, spec);
    let block = 16_384.min(visible);
    let zeros = vec![0f32; block * d];
    let mut v = vec![0f32; block * d];
    let mut row = 0;
    let clock = Stopwatch::start();
    while row < visible {
        let n = block.min(visible - row);
        for (i, x) in v[..n * d].iter_mut().enumerate() {
            // u64: bit 63 of a row index must be 0 on wasm32 too.
            *x = ((row + i / d) as u64 >> (i % d) & 1) as f32;
        }
        let shape = [n, n_kv, d];
        c.append(
            0,
            &[
                HostSlab::f32(&zeros[..n * d], &shape),
                HostSlab::f32(&v[..n * d], &shape),
            ],
        )
        .unwrap();
        c.advance(n).unwrap();
        row += n;
    }
    let fill_s = clock.seconds();
    let n_heads = n_kv * group;
    let qb = f32_buffer(&g.device, &values(5, n_q * n_heads * d)).await;
    let out = output(&g.device, n_q * n_heads * d).await;
    let clock = Stopwatch::start();
    Attention::for_cache(&c)
        .gqa(
            &c,
            0,
            Queries::new(&qb, n_q, n_heads, d),
            &out,
            &Default::default(),
        )
        .unwrap();
    let got = read_f32(g, &out).await;
    let attention_s = clock.seconds();
    let (mut worst, mut worst_rows) = (0f64, 0f64);
    for qi in 0..n_q {
        let seen = visible - n_q + qi + 1;
        for h in 0..n_heads {
            for e in 0..d {
                let ones = ones_below(seen, e) as f64;
                let want = ones / seen as f64;
                let g = got[(qi * n_heads + h) * d + e] as f64;
                let err = (g - want).abs() / (1.0 + want);
                let rows_off = (g * seen as f64 - ones).abs();
                assert!(
                    err <= TOL as f64 && rows_off < 0.5,
                    "{types:?}, {visible} rows: query {qi} head {h} element {e}: {g} vs {want} \
                     ({rows_off} rows off)"
                );
                worst = worst.max(err);
                worst_rows = worst_rows.max(rows_off);
            }
        }
    }
    note!(
        "{types:?}: {n_q} queries over {visible} rows see every row: worst scaled error {worst:e}, \
         {worst_rows:.3} rows off at most (fill {fill_s:.1} s, attention + readback \
         {attention_s:.1} s)"
    );
}

/// Buffers the app makes through `kvgpu::create_buffer` / `create_buffer_init` are taken by the
/// synchronous calls without `verify_buffer`, in a browser too: a GPU append source, and attention's
/// queries and output, against the twin; descriptors wgpu would refuse are refused first. A buffer of the same contents made with the device's own
/// `create_buffer_init` is refused there as unverified, with the cache unchanged, and as attention's
/// query or output before any pipeline is built (natively every call checks its buffers itself and
/// takes it).
pub async fn buffers_made_through_kvgpu_need_no_verifying(g: &Gpu) {
    let web = cfg!(target_arch = "wasm32");
    let spec = CacheSpec::new(vec![LayerSpec::kv(1, 4, 4)], DType::F32, 4).unwrap();
    let mut c = cache_on(g, spec);
    let rows = values(7, 2 * 4);
    let init = wgpu::util::BufferInitDescriptor {
        label: Some("test source"),
        contents: bytemuck::cast_slice(&rows),
        usage: USAGE,
    };
    let shape = [2, 1, 4];
    let plain = g.device.create_buffer_init(&init);
    let plain_slab = GpuSlab::contiguous(&plain, DType::F32, &shape);
    if web {
        let e = c.append_gpu(0, &[plain_slab, plain_slab]).unwrap_err();
        assert!(matches!(e, Error::UnverifiedBuffer { layer: 0, .. }), "{e}");
        assert_eq!(c.visible(0).unwrap(), 0);
    }
    let made = kvgpu::create_buffer_init(&g.device, &init).unwrap();
    let slab = GpuSlab::contiguous(&made, DType::F32, &shape);
    c.append_gpu(0, &[slab, slab]).unwrap();
    c.advance(2).unwrap();
    let q_rows = values(8, 4);
    let q = kvgpu::create_buffer_init(
        &g.device,
        &wgpu::util::BufferInitDescriptor {
            label: Some("test queries"),
            contents: bytemuck::cast_slice(&q_rows),
            usage: USAGE,
        },
    )
    .unwrap();
    let desc = |size, usage, mapped_at_creation| wgpu::BufferDescriptor {
        label: Some("test output"),
        size,
        usage,
        mapped_at_creation,
    };
    let out = kvgpu::create_buffer(&g.device, &desc(16, USAGE, false)).unwrap();
    // Descriptors wgpu would refuse (natively with a panic) are refused first, nothing made.
    let max = g.device.limits().max_buffer_size;
    let map_read = wgpu::BufferUsages::MAP_READ;
    for (size, usage, mapped) in [
        (16, wgpu::BufferUsages::empty(), false),
        (16, map_read | wgpu::BufferUsages::STORAGE, false),
        (max + 4, USAGE, false),
        (6, USAGE, true),
    ] {
        let e = kvgpu::create_buffer(&g.device, &desc(size, usage, mapped)).unwrap_err();
        assert!(
            matches!(e, Error::BufferDescriptor { .. }),
            "{size} {usage:?} {mapped}: {e}"
        );
    }
    let readable = kvgpu::create_buffer(
        &g.device,
        &desc(16, map_read | wgpu::BufferUsages::COPY_DST, false),
    );
    assert!(readable.is_ok(), "{readable:?}");
    let options = AttentionOptions::default();
    // A fresh registry: an unverified query or output is refused before any pipeline is built.
    let mut att = Attention::new(&g.device, &g.queue).unwrap();
    if web {
        for (q, o) in [(&plain, &out), (&q, &plain)] {
            let e = att
                .gqa(&c, 0, Queries::new(q, 1, 1, 4), o, &options)
                .unwrap_err();
            assert!(matches!(e, Error::UnverifiedBuffer { layer: 0, .. }), "{e}");
            assert_eq!(att.kernels().attention_pipelines(), 0);
        }
    }
    att.gqa(&c, 0, Queries::new(&q, 1, 1, 4), &out, &options)
        .unwrap();
    assert!(att.kernels().attention_pipelines() > 0);
    let want = reference::attention_gqa(&q_rows, [1, 1, 4], &rows, &rows, 1, 4, &options);
    assert_close(
        &read_f32(g, &out).await,
        &want,
        "attention over kvgpu-made buffers",
    );
}
