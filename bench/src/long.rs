//! Decode attention at GPU-scale contexts (32k, 64k and 128k rows; 32k alone in quick mode) against
//! the device-to-device copy bandwidth measured side by side: #9's goal for real GPUs (GQA at least
//! 0.8 of it), where a 4k layer would sit in the processor's L2 cache and say nothing about memory.
//! The copy moves the same bytes the call reads (up to 1 GiB), the faster of
//! `copy_buffer_to_buffer` and a copy kernel, and counts them twice, read and written, as
//! `bench/h200/anchor.py` does for PyTorch on the same GPU. Then GQA decode of a batch of 16
//! sequences of 4k and 16k rows each (4k alone in quick mode) from a paged pool, one query each:
//! PyTorch's batch-16 shape. A context whose layer or pool does not fit the device's bindings is
//! skipped, with the reason.

use anyhow::Result;
use kvgpu::{Attention, AttentionOptions, CacheSpec, DType, Gpu, Kv, KvCache, PagedCache, SeqId};

use crate::Config;
use crate::attn::{Inputs, Kind, Shape, configure, fill, fill_paged};
use crate::refs::BoundKernel;
use crate::report::{Goal, Row};
use crate::timing::{Timer, interleaved};

/// The largest copy of the reference, so that its two buffers stay within a GPU's memory beside
/// the cache.
const MOST_COPY: u64 = 1 << 30;
/// Sequences of the batched rows, and the rows of their pool's pages.
const BATCH: usize = 16;
const PAGE: usize = 64;
/// GPU time of one timed sample, and the most calls it records to get there.
const SAMPLE_SECONDS: f64 = 2e-3;
const MOST_CALLS: usize = 64;
/// Wall time of the warm-up before the samples of one row.
const WARM_SECONDS: f64 = 0.5;

pub fn run(gpu: &Gpu, timer: &Timer, cfg: &Config, rows: &mut Vec<Row>) -> Result<()> {
    let contexts: &[usize] = if cfg.quick {
        &[32_768]
    } else {
        &[32_768, 65_536, 131_072]
    };
    let on_gpu = gpu.adapter.get_info().device_type != wgpu::DeviceType::Cpu;
    for kind in [Kind::Gqa, Kind::Mla] {
        let shape = Shape::of(&kind);
        for dtype in [DType::F16, DType::F32] {
            for &ctx in contexts {
                let spec = CacheSpec::new(vec![shape.layer.clone()], dtype, ctx)?;
                let mut cache = match KvCache::new(&gpu.device, &gpu.queue, spec) {
                    Ok(cache) => cache,
                    Err(e) => {
                        eprintln!(
                            "  {} attention {dtype}, ctx {ctx}: skipped: {e}",
                            shape.label
                        );
                        continue;
                    }
                };
                fill(&mut cache, ctx)?;
                let goal = match kind {
                    Kind::Gqa if on_gpu => Goal::AtLeast(0.8),
                    _ => Goal::Info,
                };
                one(gpu, timer, cfg, rows, &kind, &shape, &cache, goal)?;
            }
        }
    }
    let shape = Shape::of(&Kind::Gqa);
    let per_sequence: &[usize] = if cfg.quick { &[4096] } else { &[4096, 16_384] };
    for dtype in [DType::F16, DType::F32] {
        for &ctx in per_sequence {
            let spec = CacheSpec::new(vec![shape.layer.clone()], dtype, ctx)?;
            let n_pages = BATCH * ctx / PAGE;
            let mut pool = match PagedCache::new(&gpu.device, &gpu.queue, spec, PAGE, n_pages) {
                Ok(pool) => pool,
                Err(e) => {
                    eprintln!(
                        "  {} attention {dtype}, {BATCH} sequences x {ctx} rows: skipped: {e}",
                        shape.label
                    );
                    continue;
                }
            };
            let seqs: Vec<SeqId> = (0..BATCH)
                .map(|_| pool.add_sequence())
                .collect::<kvgpu::Result<_>>()?;
            for pair in seqs.chunks(2) {
                fill_paged(&mut pool, pair[0], pair[1], ctx)?;
            }
            batch(gpu, timer, cfg, rows, &shape, &pool, &seqs, ctx)?;
        }
    }
    Ok(())
}

/// One decode query over the whole of `cache`.
#[allow(clippy::too_many_arguments)]
fn one(
    gpu: &Gpu,
    timer: &Timer,
    cfg: &Config,
    rows: &mut Vec<Row>,
    kind: &Kind,
    shape: &Shape,
    cache: &KvCache,
    goal: Goal,
) -> Result<()> {
    let ctx = cache.len();
    let bytes = ctx as u64 * cache.spec().bytes_per_token();
    let inputs = Inputs::new(gpu, shape, 1);
    let mut attn = Attention::for_cache(cache);
    configure(&mut attn)?;
    let opts = AttentionOptions::default();
    let mut kernel = |calls: usize| -> Result<f64> {
        let mut res = Ok(());
        let t = timer.gpu_calls(calls, |enc| {
            if res.is_ok() {
                res = inputs.record(kind, shape, &mut attn, cache.into(), enc, 1, &opts);
            }
        })?;
        res.map(|_| t)
    };
    let what = format!(
        "{} attention {}, ctx {ctx}",
        shape.label,
        cache.spec().dtype()
    );
    beside_copy(gpu, timer, cfg, rows, &what, bytes, goal, &mut kernel)
}

/// One decode query for each of `seqs` of `pool`, `ctx` rows each, as one ragged batch.
#[allow(clippy::too_many_arguments)]
fn batch(
    gpu: &Gpu,
    timer: &Timer,
    cfg: &Config,
    rows: &mut Vec<Row>,
    shape: &Shape,
    pool: &PagedCache,
    seqs: &[SeqId],
    ctx: usize,
) -> Result<()> {
    let n = seqs.len();
    let bytes = (n * ctx) as u64 * pool.spec().bytes_per_token();
    let inputs = Inputs::new(gpu, shape, n);
    let list: Vec<(SeqId, usize)> = seqs.iter().map(|&s| (s, 1)).collect();
    let mut attn = Attention::with_kernels(pool.kernels().clone());
    configure(&mut attn)?;
    let opts = AttentionOptions::default();
    let mut kernel = |calls: usize| -> Result<f64> {
        let mut res = Ok(());
        let t = timer.gpu_calls(calls, |enc| {
            if res.is_ok() {
                let kv = Kv::Batch(pool, &list);
                res = inputs.record(&Kind::Gqa, shape, &mut attn, kv, enc, n, &opts);
            }
        })?;
        res.map(|_| t)
    };
    let what = format!(
        "{} attention {}, {n} sequences x {ctx} rows",
        shape.label,
        pool.spec().dtype()
    );
    beside_copy(gpu, timer, cfg, rows, &what, bytes, Goal::Info, &mut kernel)
}

/// Times `kernel`, which reads `bytes` of KV per call (`kernel(n)` records `n` calls back to back and
/// returns the time of one), side by side with a device-to-device copy of as many bytes (up to
/// [`MOST_COPY`]), and reports the kernel's read bandwidth over the copy's.
///
/// A GPU raises its clocks only under sustained work, and one call of a few hundred microseconds
/// ends long before: on an H200 the first runs, one call per submission, swung by 2-8x between rows.
/// So each sample is [`SAMPLE_SECONDS`] of calls back to back in one submission (one call on a CPU
/// adapter, where a call takes longer), after at least [`WARM_SECONDS`] of the same work.
#[allow(clippy::too_many_arguments)]
fn beside_copy(
    gpu: &Gpu,
    timer: &Timer,
    cfg: &Config,
    rows: &mut Vec<Row>,
    what: &str,
    bytes: u64,
    goal: Goal,
    kernel: &mut dyn FnMut(usize) -> Result<f64>,
) -> Result<()> {
    let moved = bytes.min(MOST_COPY.min(gpu.device.limits().max_buffer_size)) & !3;
    let buffer = |label| {
        gpu.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size: moved,
            usage: wgpu::BufferUsages::COPY_SRC
                | wgpu::BufferUsages::COPY_DST
                | wgpu::BufferUsages::STORAGE,
            mapped_at_creation: false,
        })
    };
    let (from, to) = (
        buffer("bench copy source"),
        buffer("bench copy destination"),
    );
    let copies = |calls| {
        timer.gpu_calls(calls, |enc| {
            enc.copy_buffer_to_buffer(&from, 0, &to, 0, moved)
        })
    };
    // The same copy by compute invocations, where the device binds that many bytes.
    let by_kernel = BoundKernel::copy(&gpu.device, &from, &to, moved);
    let kernel_copies = |calls: usize| match &by_kernel {
        Some(copy) => timer.gpu_calls(calls, |enc| copy.record(enc)),
        None => Ok(f64::INFINITY),
    };
    let per_sample = |one: f64| ((SAMPLE_SECONDS / one).ceil() as usize).clamp(1, MOST_CALLS);
    let (nk, nc) = (per_sample(kernel(1)?), per_sample(copies(1)?));
    let nkc = per_sample(kernel_copies(1)?);
    let mut sampled = || kernel(nk);
    let mut copy = || copies(nc);
    let mut kernel_copy = || kernel_copies(nkc);
    let warming = std::time::Instant::now();
    let mut warmed = 0;
    while warmed < cfg.warm.min(2) || warming.elapsed().as_secs_f64() < WARM_SECONDS {
        sampled()?;
        copy()?;
        kernel_copy()?;
        warmed += 1;
    }
    let [tk, tc, tkc] = interleaved(
        0,
        cfg.reps.min(9),
        [&mut sampled, &mut copy, &mut kernel_copy],
    )?;
    let read = bytes as f64 / tk / 1e9;
    let rate = |t: f64| 2.0 * moved as f64 / t / 1e9;
    let copied = rate(tc.min(tkc));
    let how = match by_kernel {
        Some(_) => format!(
            "the faster of copy_buffer_to_buffer ({:.1} GB/s) and a copy kernel ({:.1} GB/s)",
            rate(tc),
            rate(tkc)
        ),
        None => "copy_buffer_to_buffer; the device cannot bind that many bytes for a copy kernel"
            .to_string(),
    };
    rows.push(
        Row::new(
            format!("{what}: KV bandwidth"),
            read,
            "GB/s",
            timer.clock(),
        )
        .ratio(
            read / copied,
            format!(
                "device-to-device copy of {} MiB, read + write ({copied:.1} GB/s, {how}); the call took {:.1} us",
                moved >> 20,
                tk * 1e6
            ),
            goal,
        ),
    );
    eprintln!(
        "  {what}: kernel {:.1} us ({read:.2} GB/s), copy {copied:.2} GB/s ({how})",
        tk * 1e6
    );
    Ok(())
}
