//! One run of the demo: a prefill and decode steps over a small model's cache, every step appending
//! K/V (or MLA latents) to every layer and running attention on WebGPU, checked against the CPU twins
//! of `kvgpu::reference` over a CPU model of the cache fed the same rows.

use std::future::poll_fn;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Poll, Waker};

use kvgpu::reference::{self, CpuCache, host_bits};
use kvgpu::wgpu;
use kvgpu::{
    Attention, AttentionOptions, CacheSpec, DType, Gpu, HostData, HostSlab, Kernels, KvCache,
    LayerSpec, MlaQueries, Queries,
};

use crate::chart::StepPoint;

/// Decode steps after the prefill; the prefill fills the rest of the context.
pub const DECODE_STEPS: usize = 32;
/// Outputs may differ from the f64 CPU twin by this much, scaled by `1 + |reference|`.
const TOLERANCE: f32 = 1e-4;

/// A model shape small enough for a software WebGPU adapter.
pub struct Preset {
    pub key: &'static str,
    pub title: &'static str,
    layer: LayerSpec,
    n_layers: usize,
    n_heads: usize,
}

/// The presets the page offers (the `<select id="preset">` values).
pub fn preset(key: &str) -> Option<Preset> {
    match key {
        "gqa" => Some(Preset {
            key: "gqa",
            title: "small GQA: 4 layers, 8 query heads over 2 KV heads of 64",
            layer: LayerSpec::kv(2, 64, 64),
            n_layers: 4,
            n_heads: 8,
        }),
        "mla" => Some(Preset {
            key: "mla",
            title: "small MLA: 4 layers, 8 heads over latents of 128 + rope 32",
            layer: LayerSpec::mla(128, 32),
            n_layers: 4,
            n_heads: 8,
        }),
        _ => None,
    }
}

/// What the page asked for.
pub struct Choice {
    pub preset: Preset,
    pub dtype: DType,
    pub context: usize,
}

/// What a run shows: one point per decode step, and the check's result.
pub struct Outcome {
    pub prefill: usize,
    pub prefill_ms: f64,
    pub steps: Vec<StepPoint>,
    pub allocated: u64,
    pub checked_steps: usize,
    pub max_err: f32,
}

/// Query buffers (`q`, or MLA's latent and rope), the output, and this step's queries on the host.
struct Layer {
    q: Vec<wgpu::Buffer>,
    out: wgpu::Buffer,
    q_host: Vec<Vec<f32>>,
}

struct Run<'a> {
    gpu: &'a Gpu,
    cache: KvCache,
    cpu: CpuCache,
    attention: Attention,
    layers: Vec<Layer>,
    preset: &'a Preset,
}

/// Deterministic pseudo-random values in [-1, 1).
fn values(seed: u64, n: usize) -> Vec<f32> {
    reference::pseudo_random(seed, n, 1.0)
}

/// Resolves once the GPU has finished the work submitted so far.
async fn gpu_done(queue: &wgpu::Queue) {
    let slot: Arc<Mutex<(bool, Option<Waker>)>> = Arc::default();
    let fired = slot.clone();
    queue.on_submitted_work_done(move || {
        let mut s = fired.lock().unwrap_or_else(PoisonError::into_inner);
        s.0 = true;
        if let Some(w) = s.1.take() {
            w.wake();
        }
    });
    poll_fn(|cx| {
        let mut s = slot.lock().unwrap_or_else(PoisonError::into_inner);
        if s.0 {
            Poll::Ready(())
        } else {
            s.1 = Some(cx.waker().clone());
            Poll::Pending
        }
    })
    .await
}

impl Run<'_> {
    /// Query dims of a layer: `[r, p]` for MLA, `[d_k]` for GQA.
    fn q_dims(&self) -> Vec<usize> {
        let slots = &self.preset.layer.slots;
        if self.is_mla() {
            vec![slots[0].trailing[0], slots[1].trailing[0]]
        } else {
            vec![slots[0].trailing[1]]
        }
    }

    /// MLA layers have two one-axis slots (`compressed_kv [r]`, `k_pe [p]`); GQA has K and V
    /// `[n_kv_heads, dim]`.
    fn is_mla(&self) -> bool {
        self.preset.layer.slots[0].trailing.len() == 1
    }

    /// One step of `n` tokens: every layer appends its rows (to the GPU cache and the CPU model), then
    /// attention of every layer for the `n` new rows is recorded in one encoder. Returns the
    /// milliseconds until the GPU has finished it all.
    async fn step(&mut self, step: usize, n: usize, now: &dyn Fn() -> f64) -> kvgpu::Result<f64> {
        let t0 = now();
        let dtype = self.cache.spec().dtype();
        let h = self.preset.n_heads;
        let dims = self.q_dims();
        let mut encoder = self
            .gpu
            .device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                label: Some("demo step"),
            });
        for l in 0..self.layers.len() {
            let seed = (step as u64) << 20 | (l as u64) << 4;
            let row = self.cache.visible(l)?;
            let slots = &self.preset.layer.slots;
            let shapes: Vec<Vec<usize>> = slots
                .iter()
                .map(|s| [&[n][..], &s.trailing].concat())
                .collect();
            let data: Vec<Vec<f32>> = shapes
                .iter()
                .enumerate()
                .map(|(i, sh)| values(seed + i as u64, sh.iter().product()))
                .collect();
            let slabs: Vec<HostSlab<'_>> = data
                .iter()
                .zip(&shapes)
                .map(|(d, sh)| HostSlab::f32(d, sh))
                .collect();
            self.cache.append(l, &slabs)?;
            for (s, d) in data.iter().enumerate() {
                self.cpu
                    .write_rows(l, s, row, &host_bits(HostData::F32(d), dtype));
            }

            let layer = &mut self.layers[l];
            layer.q_host = dims
                .iter()
                .enumerate()
                .map(|(i, d)| values(seed + 8 + i as u64, n * h * d))
                .collect();
            for (buffer, q) in layer.q.iter().zip(&layer.q_host) {
                self.gpu
                    .queue
                    .write_buffer(buffer, 0, bytemuck::cast_slice(q));
            }
            let opts = AttentionOptions::default();
            if let [r, p] = dims[..] {
                let q = MlaQueries {
                    latent: Queries::new(&layer.q[0], n, h, r),
                    rope: Queries::new(&layer.q[1], n, h, p),
                };
                self.attention
                    .record_mla(&mut encoder, &self.cache, l, q, &layer.out, &opts)?;
            } else {
                let q = Queries::new(&layer.q[0], n, h, dims[0]);
                self.attention
                    .record_gqa(&mut encoder, &self.cache, l, q, &layer.out, &opts)?;
            }
        }
        self.gpu.queue.submit([encoder.finish()]);
        gpu_done(&self.gpu.queue).await;
        Ok(now() - t0)
    }

    /// Compares the last step's outputs (`n_q` queries per layer) with the CPU twins over the CPU
    /// model's rows; returns the largest absolute error and whether all are within the tolerance.
    async fn check(&self, n_q: usize) -> kvgpu::Result<(f32, bool)> {
        let (mut worst, mut good) = (0f32, true);
        let h = self.preset.n_heads;
        let dims = self.q_dims();
        let opts = AttentionOptions::default();
        for (l, layer) in self.layers.iter().enumerate() {
            let visible = self.cache.visible(l)?;
            let a = self.cpu.read_f32(l, 0, visible);
            let b = self.cpu.read_f32(l, 1, visible);
            let want = if self.is_mla() {
                reference::attention_mla(
                    &layer.q_host[0],
                    &layer.q_host[1],
                    [n_q, h, dims[0]],
                    &a,
                    &b,
                    dims[1],
                    &opts,
                )
            } else {
                let n_kv = self.preset.layer.slots[0].trailing[0];
                let d_v = self.preset.layer.slots[1].trailing[1];
                reference::attention_gqa(
                    &layer.q_host[0],
                    [n_q, h, dims[0]],
                    &a,
                    &b,
                    n_kv,
                    d_v,
                    &opts,
                )
            };
            let bytes = kvgpu::read_buffer_async(
                &self.gpu.device,
                &self.gpu.queue,
                &layer.out,
                0,
                (want.len() * 4) as u64,
            )
            .await?;
            let got: Vec<f32> = bytemuck::pod_collect_to_vec(&bytes);
            // A twin that refused the shapes returns nothing: that is a failed check, not a pass.
            if want.is_empty() || got.len() != want.len() {
                return Ok((f32::INFINITY, false));
            }
            for (g, w) in got.iter().zip(&want) {
                let err = (g - w).abs();
                worst = worst.max(err);
                good &= err <= TOLERANCE * (1.0 + w.abs());
            }
        }
        Ok((worst, good))
    }

    /// Bytes the visible rows of every slot take: the sum of the cache's views.
    fn bytes_in_use(&self) -> kvgpu::Result<u64> {
        let mut sum = 0;
        for (l, layer) in self.cache.spec().layers().iter().enumerate() {
            for s in 0..layer.slots.len() {
                sum += self.cache.view(l, s)?.size;
            }
        }
        Ok(sum)
    }
}

/// Runs the prefill (`context - DECODE_STEPS` tokens, all attending causally in one call per layer) and
/// the decode steps, checks every step against the CPU twins, and compares the stored words with the
/// CPU model at the end. `log` gets a line per phase; `now` is the page's clock in milliseconds.
pub async fn run(
    gpu: &Gpu,
    kernels: &Arc<Kernels>,
    choice: &Choice,
    log: &mut dyn FnMut(&str),
    now: &dyn Fn() -> f64,
) -> Result<Outcome, String> {
    let e = |e: kvgpu::Error| e.to_string();
    let preset = &choice.preset;
    let context = choice.context;
    if context <= DECODE_STEPS {
        return Err(format!(
            "a context of {context} leaves no room for a prefill"
        ));
    }
    let prefill = context - DECODE_STEPS;
    let spec = CacheSpec::new(
        vec![preset.layer.clone(); preset.n_layers],
        choice.dtype,
        context,
    )
    .map_err(e)?;
    let cache = KvCache::with_kernels(kernels.clone(), spec.clone()).map_err(e)?;
    log(&format!(
        "cache: {}, {} storage, {context} tokens x {} bytes/token = {:.1} KiB of rows",
        preset.title,
        choice.dtype,
        spec.bytes_per_token(),
        spec.total_bytes() as f64 / 1024.0
    ));
    let storage = |bytes: usize| {
        gpu.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("demo"),
            size: bytes.max(4) as u64,
            usage: wgpu::BufferUsages::STORAGE
                | wgpu::BufferUsages::COPY_DST
                | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        })
    };
    let mut run = Run {
        gpu,
        cpu: CpuCache::new(&spec),
        attention: Attention::with_kernels(kernels.clone()),
        cache,
        layers: Vec::new(),
        preset,
    };
    let rows = prefill * preset.n_heads;
    let d_out = preset.layer.slots[if run.is_mla() { 0 } else { 1 }]
        .trailing
        .last()
        .copied()
        .unwrap_or(1);
    run.layers = (0..preset.n_layers)
        .map(|_| Layer {
            q: run.q_dims().iter().map(|d| storage(rows * d * 4)).collect(),
            out: storage(rows * d_out * 4),
            q_host: Vec::new(),
        })
        .collect();
    // WebGPU reports a buffer of another device only asynchronously, so the app's buffers are
    // verified once before the synchronous attention calls bind them.
    for layer in &run.layers {
        for buffer in layer.q.iter().chain([&layer.out]) {
            kvgpu::verify_buffer(&run.gpu.device, buffer)
                .await
                .map_err(e)?;
        }
    }

    let prefill_ms = run.step(0, prefill, now).await.map_err(e)?;
    log(&format!(
        "prefill: {prefill} tokens, each attending to the rows up to its own, in {prefill_ms:.1} ms \
         (the first run also builds the attention pipelines)"
    ));
    let (err, good) = run.check(prefill).await.map_err(e)?;
    let (mut max_err, mut all_good, mut checked) = (err, good, 1);
    run.cache.advance(prefill).map_err(e)?;

    let mut steps = Vec::with_capacity(DECODE_STEPS);
    for s in 1..=DECODE_STEPS {
        let ms = run.step(s, 1, now).await.map_err(e)?;
        let (err, good) = run.check(1).await.map_err(e)?;
        max_err = max_err.max(err);
        all_good &= good;
        checked += 1;
        run.cache.advance(1).map_err(e)?;
        steps.push(StepPoint {
            len: run.cache.len(),
            ms,
            bytes_in_use: run.bytes_in_use().map_err(e)?,
        });
    }
    let times: Vec<f64> = steps.iter().map(|p| p.ms).collect();
    let median = crate::chart::median(&times);
    log(&format!(
        "decode: {DECODE_STEPS} steps of one token, median {median:.2} ms per step (min {:.2}, max \
         {:.2}): appends to {} layers + attention over every visible row, until the GPU is done; \
         {:.0} tokens/s for the cache and attention alone (no model weights run). Pipelines are \
         built on first use and kept, so a first run's steps include building them: Run again for \
         warm times",
        times.iter().copied().fold(f64::INFINITY, f64::min),
        times.iter().copied().fold(0.0, f64::max),
        preset.n_layers,
        1e3 / median
    ));

    // The stored words, every slot of every layer, against the CPU model.
    let mut words = 0;
    for (l, layer) in spec.layers().iter().enumerate() {
        for s in 0..layer.slots.len() {
            let got = run.cache.read_full_words_async(l, s).await.map_err(e)?;
            if got != run.cpu.words[l][s] {
                return Err(format!(
                    "layer {l} slot {s}: the stored words differ from the CPU model"
                ));
            }
            words += got.len();
        }
    }
    log(&format!(
        "checked: the prefill and {DECODE_STEPS} decode steps of all {} layers against \
         kvgpu::reference (tolerance {TOLERANCE:e} x (1 + |reference|)); {words} stored words equal \
         the CPU model",
        preset.n_layers
    ));
    if !all_good {
        return Err(format!(
            "attention differs from the CPU twin: max abs error {max_err:e}"
        ));
    }
    Ok(Outcome {
        prefill,
        prefill_ms,
        allocated: spec.total_bytes(),
        steps,
        checked_steps: checked,
        max_err,
    })
}
