//! Dropped caches and dropped source buffers release their memory, however long the `Attention` or
//! the cache that used them lives, over many cycles: run natively by `tests/memory.rs` and in the
//! browser by `tests/web.rs`, each counting live buffers its own way (see [`Residency`]).

use super::{append_random, values};
use kvgpu::reference;
use kvgpu::wgpu::{self, util::DeviceExt};
use kvgpu::*;

/// Counts the buffers that are still alive, after whatever nothing references has been freed.
/// Natively: wgpu's live-buffer counter of the device (every buffer of it; the `counters` feature),
/// after a poll that frees what nothing references. In the browser WebGPU has no such counter, and a
/// buffer's memory goes when its `GPUBuffer` object is garbage collected (nothing kvgpu calls frees it
/// sooner), so: the followed buffers whose `GPUBuffer` survives a full collection (Chromium's `gc()`,
/// exposed by `--js-flags=--expose-gc` in `webdriver.json`). kvgpu keeps a buffer only through a
/// `wgpu::Buffer` handle (its bind-group caches pin the buffers they bind), which holds the object.
pub struct Residency {
    device: wgpu::Device,
    #[cfg(target_arch = "wasm32")]
    followed: Vec<js_sys::WeakRef>,
}

impl Residency {
    pub fn new(g: &Gpu) -> Self {
        Self {
            device: g.device.clone(),
            #[cfg(target_arch = "wasm32")]
            followed: Vec::new(),
        }
    }

    /// Counts `buffer` from now on (natively every buffer of the device counts already).
    pub fn follow(&mut self, buffer: &wgpu::Buffer) {
        #[cfg(target_arch = "wasm32")]
        {
            let object: &js_sys::Object = buffer
                .as_webgpu()
                .expect("a buffer of the browser's WebGPU")
                .as_ref();
            self.followed.push(js_sys::WeakRef::new(object));
        }
        #[cfg(not(target_arch = "wasm32"))]
        let _ = buffer;
    }

    #[cfg(not(target_arch = "wasm32"))]
    pub async fn live(&self) -> isize {
        self.counters().buffers.read()
    }

    /// Natively, the bytes of every live buffer of the device (after the same poll).
    #[cfg(not(target_arch = "wasm32"))]
    pub async fn live_bytes(&self) -> isize {
        self.counters().buffer_memory.read()
    }

    /// Natively, the live buffers and their bytes, from one poll (OpenGL counts no buffer memory
    /// in wgpu: there the count tells).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn live_now(&self) -> (isize, isize) {
        let counters = self.counters();
        (counters.buffers.read(), counters.buffer_memory.read())
    }

    /// The device's counters after a poll that frees what nothing references.
    #[cfg(not(target_arch = "wasm32"))]
    fn counters(&self) -> wgpu::wgt::HalCounters {
        self.device
            .poll(wgpu::PollType::wait_indefinitely())
            .unwrap();
        self.device.get_internal_counters().hal
    }

    #[cfg(target_arch = "wasm32")]
    pub async fn live(&self) -> isize {
        use wasm_bindgen::{JsCast, JsValue};
        // A WeakRef keeps its target alive until the task that made or read it ends: collect in a
        // later task.
        next_task().await;
        let gc = js_sys::Reflect::get(&js_sys::global(), &JsValue::from_str("gc"))
            .ok()
            .and_then(|f| f.dyn_into::<js_sys::Function>().ok())
            .expect(
                "counting live buffers in the browser needs gc(): run Chromium with \
                 --js-flags=--expose-gc (webdriver.json)",
            );
        gc.call0(&JsValue::UNDEFINED).expect("gc() ran");
        let live = self.followed.iter().filter(|w| w.deref().is_some()).count();
        let _ = &self.device;
        live as isize
    }
}

/// Resolves in a later task (a `setTimeout` of 0 ms).
#[cfg(target_arch = "wasm32")]
async fn next_task() {
    let promise = js_sys::Promise::new(&mut |resolve, _| {
        web_sys::window()
            .expect("a window")
            .set_timeout_with_callback_and_timeout_and_arguments_0(&resolve, 0)
            .expect("setTimeout");
    });
    wasm_bindgen_futures::JsFuture::from(promise)
        .await
        .expect("setTimeout resolved");
}

/// One `Attention` serving 24 caches of 1 MiB and more per slot in turn, each dropped after its
/// call: after the first cycle (which sizes the attention's scratch) the live buffers never grow, so
/// the attention keeps none of the dropped caches. Each cache is 64 KiB per slot larger than the one
/// before: natively the live bytes stay at the first cycle's too, which they would not if the
/// attention kept the latest cache in place of the one before.
pub async fn one_attention_serving_many_dropped_caches_keeps_none_of_them(g: &Gpu) {
    let mut residency = Residency::new(g);
    let spec_of = |i: u64| {
        CacheSpec::new(
            vec![LayerSpec::kv(1, 64, 64)],
            DType::F32,
            4096 + 256 * i as usize,
        )
    };
    let spec = spec_of(0).unwrap();
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
    for buffer in [&q, &out] {
        verify_buffer(&g.device, buffer).await.unwrap();
    }
    let first = KvCache::new(&g.device, &g.queue, spec.clone()).unwrap();
    let mut attention = Attention::for_cache(&first);
    drop(first);
    let mut baseline = None;
    #[cfg(not(target_arch = "wasm32"))]
    let mut base_bytes = None;
    for i in 0..24 {
        let mut c = KvCache::new(&g.device, &g.queue, spec_of(i).unwrap()).unwrap();
        for s in 0..2 {
            residency.follow(c.full_view(0, s).unwrap().buffer);
        }
        append_random(&mut c, 0, 100, i);
        // wgpu counts buffer memory where its backend allocates it (Vulkan), not on OpenGL.
        #[cfg(not(target_arch = "wasm32"))]
        let counted = {
            let bytes = residency.live_bytes().await;
            let slots = spec_of(i).unwrap().total_bytes() as isize;
            if i == 0 && bytes < slots {
                super::skipped(&format!(
                    "live bytes not checked: {} counts {bytes} bytes of buffers with a cache of \
                     {slots} alive",
                    g.describe()
                ));
            }
            bytes >= slots
        };
        attention
            .gqa(&c, 0, Queries::new(&q, 1, 4, 64), &out, &Default::default())
            .unwrap();
        drop(c);
        let live = residency.live().await;
        // The first cycle sizes the attention's scratch; after it nothing may accumulate.
        let base = *baseline.get_or_insert(live);
        assert!(
            live <= base,
            "cycle {i}: {live} live buffers, {base} after the first"
        );
        // In the browser only the caches' slot buffers are counted, so none may be left (a count
        // against the first cycle's would pass an `Attention` that kept the latest cache).
        #[cfg(target_arch = "wasm32")]
        assert_eq!(live, 0, "cycle {i}: slot buffers of dropped caches alive");
        #[cfg(not(target_arch = "wasm32"))]
        {
            let bytes = residency.live_bytes().await;
            if counted {
                let base = *base_bytes.get_or_insert(bytes);
                assert!(
                    bytes <= base,
                    "cycle {i}: {bytes} live bytes, {base} after the first"
                );
            }
        }
    }
}

/// A cache appending from 24 pairs of sources of 8 MiB, one used by a strided (kernel-path) append
/// and one by a copy-path append, then dropped: the cache keeps at most a few within its pinning
/// bound (32 MiB for both paths together) alive, and dropping the cache frees its buffers.
pub async fn a_cache_appending_from_many_dropped_sources_keeps_few_of_them(g: &Gpu) {
    let mut residency = Residency::new(g);
    let spec = CacheSpec::new(vec![LayerSpec::kv(1, 64, 64)], DType::F16, 64).unwrap();
    let mut c = KvCache::new(&g.device, &g.queue, spec).unwrap();
    for s in 0..2 {
        residency.follow(c.full_view(0, s).unwrap().buffer);
    }
    let before = residency.live().await;
    for i in 0..24u64 {
        let mut sources = Vec::new();
        for _ in 0..2 {
            let src = g.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("8 MiB source"),
                size: 8 << 20,
                usage: wgpu::BufferUsages::STORAGE
                    | wgpu::BufferUsages::COPY_SRC
                    | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            });
            residency.follow(&src);
            verify_buffer(&g.device, &src).await.unwrap();
            sources.push(src);
        }
        let shape = [1, 1, 64];
        let strided = GpuSlab {
            buffer: &sources[0],
            dtype: DType::F32,
            offset: 64 * i,
            shape: &shape,
            strides: Some(&[128, 64, 1]),
        };
        let copied = GpuSlab {
            buffer: &sources[1],
            dtype: DType::F16,
            strides: None,
            ..strided
        };
        c.append_gpu(0, &[strided, copied]).unwrap();
        c.truncate(0).unwrap();
        drop(sources);
        let live = residency.live().await;
        assert!(
            live - before <= 32 / 8 + 2,
            "after {} dropped pairs of 8 MiB sources {} more buffers are alive",
            i + 1,
            live - before
        );
    }
    drop(c);
    assert!(
        residency.live().await < before,
        "dropping the cache freed its buffers"
    );
}

/// `Attention::release_memory` lets go of what an `Attention` keeps between calls. After a call of
/// 64 queries, whose scratch the calls that follow keep, and the app dropping its query and output
/// buffers, the attention's cached bind groups still hold those two, beside its scratch; after the
/// release neither is held and `scratch_bytes` is 0 (natively the device's live buffers fall by
/// those four at least, and where wgpu counts buffer memory, its bytes by the scratch's). The next
/// call, of one query, allocates less scratch again and matches the twin.
pub async fn release_memory_lets_go_of_the_scratch_and_the_app_buffers(g: &Gpu) {
    let mut residency = Residency::new(g);
    let spec = CacheSpec::new(vec![LayerSpec::kv(1, 64, 64)], DType::F32, 256).unwrap();
    let mut c = KvCache::new(&g.device, &g.queue, spec).unwrap();
    let rows = append_random(&mut c, 0, 200, 3);
    c.advance(200).unwrap();
    let mut attention = Attention::for_cache(&c);
    assert_eq!(attention.scratch_bytes(), 0, "before the first call");
    let n_q = 64;
    let (q, out) = (
        super::f32_buffer(&g.device, &values(4, n_q * 4 * 64)).await,
        super::output(&g.device, n_q * 4 * 64).await,
    );
    for b in [&q, &out] {
        residency.follow(b);
    }
    let options = AttentionOptions::default();
    attention
        .gqa(&c, 0, Queries::new(&q, n_q, 4, 64), &out, &options)
        .unwrap();
    let big = attention.scratch_bytes();
    // The partial results of one chunk at least.
    assert!(big >= (n_q * 4 * 64 * 4) as u64, "{big} bytes of scratch");
    drop((q, out));
    #[cfg(not(target_arch = "wasm32"))]
    let (live, bytes) = residency.live_now();
    #[cfg(target_arch = "wasm32")]
    assert_eq!(
        residency.live().await,
        2,
        "the app's buffers, kept by the attention"
    );
    attention.release_memory();
    assert_eq!(attention.scratch_bytes(), 0, "after the release");
    #[cfg(not(target_arch = "wasm32"))]
    {
        let (after, after_bytes) = residency.live_now();
        assert!(
            after <= live - 4,
            "{after} live buffers after the release, {live} before"
        );
        // wgpu counts buffer memory where its backend allocates it (Vulkan), not on OpenGL.
        if bytes >= big as isize {
            assert!(
                after_bytes <= bytes - big as isize,
                "{after_bytes} live bytes after the release, {bytes} before"
            );
        } else {
            super::skipped(&format!(
                "live bytes not checked: {} counts {bytes} bytes with {big} of scratch alive",
                g.describe()
            ));
        }
    }
    #[cfg(target_arch = "wasm32")]
    assert_eq!(
        residency.live().await,
        0,
        "the app's buffers after the release"
    );
    // The next call allocates again, as much as it needs.
    let (q, out) = (
        super::f32_buffer(&g.device, &values(5, 4 * 64)).await,
        super::output(&g.device, 4 * 64).await,
    );
    attention
        .gqa(&c, 0, Queries::new(&q, 1, 4, 64), &out, &options)
        .unwrap();
    let small = attention.scratch_bytes();
    assert!(
        small > 0 && small < big,
        "{small} bytes of scratch, {big} before"
    );
    let want = reference::attention_gqa(
        &values(5, 4 * 64),
        [1, 4, 64],
        &rows[0],
        &rows[1],
        1,
        64,
        &options,
    );
    super::assert_close(&super::read_f32(g, &out).await, &want, "after the release");
}
