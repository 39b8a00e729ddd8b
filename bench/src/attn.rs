//! Decode attention (one query) over one cache layer: GQA (Llama-3-8B: 32 query heads, 8 KV heads,
//! 128 dims) and MLA (DeepSeek-V2-Lite: 16 heads, latent 512 + rope 64). Effective bandwidth (KV bytes
//! read / kernel time) against the streaming-read roofline over the same bytes, and wall time against
//! candle's CPU attention `softmax(q·Kᵀ·scale)·V`.

use anyhow::Result;
use candle_core::{Device, Tensor};
use kvgpu::{
    Attention, AttentionOptions, CacheSpec, DType, Gpu, HostSlab, KernelChoice, Kv, KvCache,
    LayerSpec, MlaQueries, PagedCache, Queries, SeqId,
};

use crate::Config;
use crate::decode::Series;
use crate::refs::{StreamRead, storage};
use crate::report::{Goal, Row};
use crate::timing::{Clock, Timer, interleaved};

fn values(n: usize, seed: usize) -> Vec<f32> {
    (0..n)
        .map(|i| (((i * 2_654_435_761 + seed) >> 7) % 2001) as f32 * 1e-3 - 1.0)
        .collect()
}

/// Fills `seq` of `pool` to `rows` rows, one page at a time, taking turns with `other` (which gets
/// as many rows), so that no two consecutive pages of `seq` are neighbours in the pool.
pub(crate) fn fill_paged(
    pool: &mut PagedCache,
    seq: SeqId,
    other: SeqId,
    rows: usize,
) -> Result<()> {
    let widths: Vec<Vec<usize>> = pool.spec().layers()[0]
        .slots
        .iter()
        .map(|s| s.trailing.clone())
        .collect();
    let page = pool.page_size();
    let mut done = 0;
    while done < rows {
        let n = page.min(rows - done);
        let shapes: Vec<Vec<usize>> = widths.iter().map(|w| [&[n][..], w].concat()).collect();
        let data: Vec<Vec<f32>> = shapes
            .iter()
            .enumerate()
            .map(|(i, s)| values(s.iter().product(), i))
            .collect();
        for s in [seq, other] {
            let slabs: Vec<HostSlab<'_>> = shapes
                .iter()
                .zip(&data)
                .map(|(s, d)| HostSlab::f32(d, s))
                .collect();
            pool.append(s, 0, &slabs)?;
            pool.advance(s, n)?;
        }
        done += n;
    }
    pool.queue().submit([]);
    Ok(())
}

/// Fills layer 0 of `cache` to `rows` rows, 256 at a time.
pub(crate) fn fill(cache: &mut KvCache, rows: usize) -> Result<()> {
    let widths: Vec<Vec<usize>> = cache.spec().layers()[0]
        .slots
        .iter()
        .map(|s| s.trailing.clone())
        .collect();
    let chunk = 256;
    let data: Vec<Vec<f32>> = widths
        .iter()
        .enumerate()
        .map(|(i, w)| values(chunk * w.iter().product::<usize>(), i))
        .collect();
    let mut done = 0;
    while done < rows {
        let n = chunk.min(rows - done);
        let shapes: Vec<Vec<usize>> = widths.iter().map(|w| [&[n][..], w].concat()).collect();
        let slabs: Vec<HostSlab<'_>> = shapes
            .iter()
            .zip(&data)
            .map(|(s, d)| HostSlab::f32(&d[..n * s[1..].iter().product::<usize>()], s))
            .collect();
        cache.append(0, &slabs)?;
        cache.advance(n)?;
        done += n;
    }
    cache.queue().submit([]);
    Ok(())
}

/// candle's decode attention for one query: `q [g, h, d]` against `k [g, n, d]`, `v [g, n, dv]`.
fn candle_attention(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> Result<Tensor> {
    let s = (q.matmul(&k.t()?)? * scale)?;
    let p = candle_nn::ops::softmax_last_dim(&s)?;
    Ok(p.matmul(v)?)
}

/// Seconds of one [`candle_attention`] call.
fn time_candle(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> Result<f64> {
    let t = std::time::Instant::now();
    std::hint::black_box(candle_attention(q, k, v, scale)?);
    Ok(t.elapsed().as_secs_f64())
}

/// Sets the attention kernel and workgroup target to measure, from `KVGPU_BENCH_KERNEL` (see
/// [`kernel_choice`]) and `KVGPU_BENCH_WORKGROUPS` (a positive number for
/// [`Attention::set_target_workgroups`]; unset, the adapter's default).
pub(crate) fn configure(attn: &mut Attention) -> Result<()> {
    attn.set_kernel(kernel_choice()?);
    if let Ok(n) = std::env::var("KVGPU_BENCH_WORKGROUPS") {
        let n = n.parse::<std::num::NonZeroUsize>().map_err(|e| {
            anyhow::anyhow!("KVGPU_BENCH_WORKGROUPS={n:?}: needs a positive number ({e})")
        })?;
        attn.set_target_workgroups(Some(n));
    }
    Ok(())
}

/// The pass-1 kernel to measure: `KVGPU_BENCH_KERNEL=auto|tiled|shared|subgroup|alone` (default auto).
fn kernel_choice() -> Result<KernelChoice> {
    Ok(
        match std::env::var("KVGPU_BENCH_KERNEL")
            .as_deref()
            .unwrap_or("auto")
        {
            "auto" => KernelChoice::Auto,
            "tiled" => KernelChoice::Tiled,
            "shared" => KernelChoice::StreamShared,
            "subgroup" => KernelChoice::StreamSubgroup,
            "alone" => KernelChoice::StreamAlone,
            other => {
                anyhow::bail!(
                    "KVGPU_BENCH_KERNEL={other:?}: use auto, tiled, shared, subgroup or alone"
                )
            }
        },
    )
}

/// Queries per call of the chunked-prefill rows, and the context they are measured at.
const PREFILL_QUERIES: [usize; 2] = [8, 64];
const PREFILL_CONTEXT: usize = 4096;

/// candle's inputs for the same shapes: the KV heads as the batch, each query head group (times the
/// queries) in it.
#[allow(clippy::too_many_arguments)]
fn candle_inputs(
    kind: &Kind,
    heads: usize,
    groups: usize,
    n_q: usize,
    ctx: usize,
    dk: usize,
    dr: usize,
    dv: usize,
    cdt: candle_core::DType,
) -> Result<(Tensor, Tensor, Tensor)> {
    let dev = Device::Cpu;
    let per = heads / groups * n_q;
    let qt = Tensor::new(values(heads * n_q * (dk + dr), 11), &dev)?
        .reshape((groups, per, dk + dr))?
        .to_dtype(cdt)?;
    let kt = Tensor::new(values(groups * ctx * (dk + dr), 3), &dev)?
        .reshape((groups, ctx, dk + dr))?
        .to_dtype(cdt)?;
    let vt = match kind {
        Kind::Gqa => Tensor::new(values(groups * ctx * dv, 5), &dev)?
            .reshape((groups, ctx, dv))?
            .to_dtype(cdt)?,
        // The latent's first `dv` elements of each row, read in place: candle reads the same bytes
        // as kvgpu (a copy of V would read 512 of every 1,088 elements a second time).
        Kind::Mla => kt.narrow(2, 0, dv)?,
    };
    Ok((qt, kt, vt))
}

pub(crate) enum Kind {
    Gqa,
    Mla,
}

pub fn run(
    gpu: &Gpu,
    timer: &Timer,
    cfg: &Config,
    rows: &mut Vec<Row>,
    series: &mut Series,
    roof: &StreamRead,
) -> Result<()> {
    for kind in [Kind::Gqa, Kind::Mla] {
        for dtype in [DType::F32, DType::F16] {
            one(gpu, timer, cfg, rows, series, roof, &kind, dtype)?;
        }
    }
    Ok(())
}

/// A layer shape of the attention parts: Llama-3-8B's GQA or DeepSeek-V2-Lite's MLA.
pub(crate) struct Shape {
    pub label: &'static str,
    pub layer: LayerSpec,
    pub heads: usize,
    /// KV heads (1 for MLA's shared latent).
    pub groups: usize,
    pub dk: usize,
    pub dv: usize,
    /// MLA's rope part of the keys (0 for GQA).
    pub dr: usize,
}

impl Shape {
    pub(crate) fn of(kind: &Kind) -> Shape {
        match kind {
            Kind::Gqa => Shape {
                label: "GQA Llama-3-8B layer",
                layer: LayerSpec::kv(8, 128, 128),
                heads: 32,
                groups: 8,
                dk: 128,
                dv: 128,
                dr: 0,
            },
            Kind::Mla => Shape {
                label: "MLA DeepSeek-V2-Lite layer",
                layer: LayerSpec::mla(512, 64),
                heads: 16,
                groups: 1,
                dk: 512,
                dv: 512,
                dr: 64,
            },
        }
    }
}

/// f32 query (and MLA rope query) buffers of up to `most` queries, filled, and an output buffer.
pub(crate) struct Inputs {
    pub q: wgpu::Buffer,
    pub q_rope: wgpu::Buffer,
    pub out: wgpu::Buffer,
}

impl Inputs {
    pub(crate) fn new(gpu: &Gpu, shape: &Shape, most: usize) -> Inputs {
        let Shape {
            heads, dk, dv, dr, ..
        } = *shape;
        let q = storage(&gpu.device, (most * heads * dk * 4) as u64, "bench q");
        let q_rope = storage(
            &gpu.device,
            (most * heads * dr.max(1) * 4) as u64,
            "bench q_rope",
        );
        let out = storage(
            &gpu.device,
            (most * heads * dv * 4) as u64,
            "bench attention out",
        );
        gpu.queue
            .write_buffer(&q, 0, bytemuck::cast_slice(&values(most * heads * dk, 11)));
        if dr > 0 {
            gpu.queue.write_buffer(
                &q_rope,
                0,
                bytemuck::cast_slice(&values(most * heads * dr, 13)),
            );
        }
        Inputs { q, q_rope, out }
    }

    /// Records one call of the first `n_q` queries over layer 0 of `kv` (a cache, a pool sequence
    /// or a batch).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn record(
        &self,
        kind: &Kind,
        shape: &Shape,
        attn: &mut Attention,
        kv: Kv<'_>,
        enc: &mut wgpu::CommandEncoder,
        n_q: usize,
        opts: &AttentionOptions,
    ) -> Result<()> {
        let Shape { heads, dk, dr, .. } = *shape;
        match kind {
            Kind::Gqa => attn.record_gqa(
                enc,
                kv,
                0,
                Queries::new(&self.q, n_q, heads, dk),
                &self.out,
                opts,
            )?,
            Kind::Mla => {
                let mla = MlaQueries {
                    latent: Queries::new(&self.q, n_q, heads, dk),
                    rope: Queries::new(&self.q_rope, n_q, heads, dr),
                };
                attn.record_mla(enc, kv, 0, mla, &self.out, opts)?
            }
        }
        Ok(())
    }
}

#[allow(clippy::too_many_arguments)]
fn one(
    gpu: &Gpu,
    timer: &Timer,
    cfg: &Config,
    rows: &mut Vec<Row>,
    series: &mut Series,
    roof: &StreamRead,
    kind: &Kind,
    dtype: DType,
) -> Result<()> {
    let max = *cfg.attn_contexts.iter().max().unwrap_or(&512);
    let shape = Shape::of(kind);
    let Shape {
        label,
        heads,
        groups,
        dk,
        dv,
        dr,
        ..
    } = shape;
    let spec = CacheSpec::new(vec![shape.layer.clone()], dtype, max)?;
    let row_bytes = spec.bytes_per_token();
    let mut cache = KvCache::new(&gpu.device, &gpu.queue, spec)?;
    fill(&mut cache, max)?;
    let mut attn = Attention::for_cache(&cache);
    configure(&mut attn)?;
    // Room for the most queries of a chunked-prefill call.
    let most = PREFILL_QUERIES[PREFILL_QUERIES.len() - 1];
    let inputs = Inputs::new(gpu, &shape, most);
    let opts = AttentionOptions::default();
    let cdt = if dtype == DType::F16 {
        candle_core::DType::F16
    } else {
        candle_core::DType::F32
    };
    let mut call_pts = Vec::new();
    let mut candle_pts = Vec::new();
    let mut ctxs = cfg.attn_contexts.clone();
    ctxs.sort_unstable_by(|a, b| b.cmp(a));
    let record_n =
        |attn: &mut Attention,
         cache: &KvCache,
         enc: &mut wgpu::CommandEncoder,
         n_q: usize|
         -> Result<()> { inputs.record(kind, &shape, attn, cache.into(), enc, n_q, &opts) };
    for &ctx in &ctxs {
        cache.truncate(ctx)?;
        let mut record =
            |enc: &mut wgpu::CommandEncoder| -> Result<()> { record_n(&mut attn, &cache, enc, 1) };
        let mut k_gpu = || -> Result<f64> {
            let mut res = Ok(());
            let t = timer.gpu(|enc| res = record(enc))?;
            res.map(|_| t)
        };
        // Attention is the slowest part on a software adapter: fewer repetitions. The roofline's
        // fastest grid shape for these bytes is found first (a few repetitions each), then timed
        // interleaved with the kernel.
        let (warm, reps) = (cfg.warm.min(2), cfg.reps.min(9));
        let bytes = ctx as u64 * row_bytes;
        let ([tk], tr) =
            roof.best(timer, bytes)?
                .interleaved_with(timer, warm, reps, [&mut k_gpu])?;
        let mut k_wall = || -> Result<f64> {
            timer.host(|| {
                let mut enc = gpu
                    .device
                    .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                        label: Some("bench attention"),
                    });
                record(&mut enc)?;
                gpu.queue.submit([enc.finish()]);
                Ok(())
            })
        };
        let (qt, kt, vt) = candle_inputs(kind, heads, groups, 1, ctx, dk, dr, dv, cdt)?;
        let scale = 1.0 / ((dk + dr) as f64).sqrt();
        let mut c_cpu = || time_candle(&qt, &kt, &vt, scale);
        // For MLA, also candle over V copied out of the latent (as this bench measured before
        // 2026-12-06: more bytes than kvgpu reads), for the record only.
        let vt_copied = match kind {
            Kind::Mla => Some(vt.contiguous()?),
            Kind::Gqa => None,
        };
        let mut c_copied = || match &vt_copied {
            Some(vt) => time_candle(&qt, &kt, vt, scale),
            None => Ok(0.0),
        };
        let [tw, tc, tc_copied] =
            interleaved(warm, reps, [&mut k_wall, &mut c_cpu, &mut c_copied])?;
        let gbs = |t: f64| bytes as f64 / t / 1e9;
        // #9's goals, at 4k and 16k: GQA at least 0.6 (f32) / 0.45 (16-bit) of the roofline; every
        // kernel at any context at most 1.0 of it (or the roofline is not one).
        let goal_ctx = ctx == 4096 || ctx == 16384;
        let goal = match (kind, dtype) {
            (Kind::Gqa, DType::F32) if goal_ctx => Goal::Within(0.6, 1.0),
            (Kind::Gqa, _) if goal_ctx => Goal::Within(0.45, 1.0),
            _ => Goal::AtMost(1.0),
        };
        rows.push(
            Row::new(
                format!("{label} attention {dtype}, ctx {ctx}: KV bandwidth"),
                gbs(tk),
                "GB/s",
                timer.clock(),
            )
            .ratio(
                tr / tk,
                format!(
                    "streaming-read roofline over the same {} KiB ({:.2} GB/s)",
                    bytes >> 10,
                    gbs(tr)
                ),
                goal,
            ),
        );
        // #9's goals against candle's time: GQA at most 0.8, MLA at most 1.0.
        let goal = match kind {
            Kind::Gqa if goal_ctx => Goal::AtMost(0.8),
            _ if goal_ctx => Goal::AtMost(1.0),
            _ => Goal::Info,
        };
        rows.push(
            Row::new(
                format!("kvgpu / candle CPU attention, {label} {dtype}, ctx {ctx}"),
                tw * 1e6,
                "us",
                Clock::HostWall,
            )
            .ratio(
                tw / tc,
                format!(
                    "candle softmax(q·Kᵀ·scale)·V, {dtype} CPU ({:.1} us)",
                    tc * 1e6
                ),
                goal,
            ),
        );
        // The whole call, as candle's point is its whole call (the kernels alone are the rows').
        call_pts.push((ctx, tw));
        candle_pts.push((ctx, tc));
        eprintln!(
            "  {label} {dtype} ctx {ctx}: kernel {:.1} us ({:.2} GB/s), roofline {:.2} GB/s, wall {:.1} us, candle {:.1} us{}",
            tk * 1e6,
            gbs(tk),
            gbs(tr),
            tw * 1e6,
            tc * 1e6,
            if vt_copied.is_some() {
                format!(" (with V copied out: {:.1} us)", tc_copied * 1e6)
            } else {
                String::new()
            }
        );
    }
    // Chunked prefill / verification: the last `n_q` rows' queries at once, causal, against candle
    // with the same queries (without the causal mask, which only removes work on its side).
    // (After the decode rows, which truncated the cache: it is filled again to the context.)
    if let Some(&ctx) = cfg.attn_contexts.iter().find(|&&c| c == PREFILL_CONTEXT) {
        cache.truncate(0)?;
        fill(&mut cache, ctx)?;
        let (warm, reps) = (cfg.warm.min(2), cfg.reps.min(5));
        for n_q in PREFILL_QUERIES {
            let (qt, kt, vt) = candle_inputs(kind, heads, groups, n_q, ctx, dk, dr, dv, cdt)?;
            let scale = 1.0 / ((dk + dr) as f64).sqrt();
            let mut c_cpu = || time_candle(&qt, &kt, &vt, scale);
            // The whole call, recorded, submitted and waited for, as the decode rows above time it
            // against candle's whole call; the kernels' time alone (GPU timestamps where the
            // adapter has them) is the profile row after it.
            let mut k_wall = || -> Result<f64> {
                timer.host(|| {
                    let mut enc =
                        gpu.device
                            .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                                label: Some("bench chunked prefill"),
                            });
                    record_n(&mut attn, &cache, &mut enc, n_q)?;
                    gpu.queue.submit([enc.finish()]);
                    Ok(())
                })
            };
            let [tw, tc] = interleaved(warm, reps, [&mut k_wall, &mut c_cpu])?;
            let mut k_gpu = || -> Result<f64> {
                let mut res = Ok(());
                let t = timer.gpu(|enc| res = record_n(&mut attn, &cache, enc, n_q))?;
                res.map(|_| t)
            };
            let [tk] = interleaved(0, reps, [&mut k_gpu])?;
            rows.push(
                Row::new(
                    format!(
                        "kvgpu attention / candle CPU attention, {label} {dtype}, {n_q} queries, ctx {ctx}"
                    ),
                    tw * 1e6,
                    "us",
                    Clock::HostWall,
                )
                .ratio(
                    tw / tc,
                    format!(
                        "candle softmax(q·Kᵀ·scale)·V of the {n_q} queries, {dtype} CPU ({:.1} us)",
                        tc * 1e6
                    ),
                    Goal::Info,
                ),
            );
            rows.push(Row::new(
                format!("profile: the kernels of that call alone, {label} {dtype}, {n_q} queries"),
                tk * 1e6,
                "us",
                timer.clock(),
            ));
            eprintln!(
                "  {label} {dtype} ctx {ctx}, {n_q} queries: call {:.1} us (kernels {:.1}), candle {:.1} us",
                tw * 1e6,
                tk * 1e6,
                tc * 1e6
            );
        }
    }
    // Paged: the same decode call over a sequence of a pool of 16-row pages that alternate with a
    // second sequence's, against the contiguous cache (filled to the same context above), kernel time
    // side by side: what reading rows through the page table costs.
    if let Some(&ctx) = cfg.attn_contexts.iter().find(|&&c| c == PREFILL_CONTEXT) {
        const PAGE: usize = 16;
        let spec = CacheSpec::new(vec![shape.layer.clone()], dtype, ctx)?;
        let mut pool =
            PagedCache::with_kernels(cache.kernels().clone(), spec.clone(), PAGE, 2 * ctx / PAGE)?;
        let (seq, other) = (pool.add_sequence()?, pool.add_sequence()?);
        fill_paged(&mut pool, seq, other, ctx)?;
        let record_paged = |attn: &mut Attention, enc: &mut wgpu::CommandEncoder| -> Result<()> {
            inputs.record(kind, &shape, attn, Kv::Sequence(&pool, seq), enc, 1, &opts)
        };
        let (warm, reps) = (cfg.warm.min(2), cfg.reps.min(9));
        let attn = std::cell::RefCell::new(&mut attn);
        let mut k_paged = || -> Result<f64> {
            let mut res = Ok(());
            let t = timer.gpu(|enc| res = record_paged(&mut attn.borrow_mut(), enc))?;
            res.map(|_| t)
        };
        let mut k_contiguous = || -> Result<f64> {
            let mut res = Ok(());
            let t = timer.gpu(|enc| res = record_n(&mut attn.borrow_mut(), &cache, enc, 1))?;
            res.map(|_| t)
        };
        let [tp, tk] = interleaved(warm, reps, [&mut k_paged, &mut k_contiguous])?;
        rows.push(
            Row::new(
                format!("paged attention, {label} {dtype}, ctx {ctx}, {PAGE}-row pages"),
                tp * 1e6,
                "us",
                timer.clock(),
            )
            .ratio(
                tp / tk,
                format!("the same call over a contiguous cache ({:.1} us)", tk * 1e6),
                Goal::Info,
            ),
        );
        eprintln!(
            "  {label} {dtype} ctx {ctx}: paged kernel {:.1} us, contiguous {:.1} us",
            tp * 1e6,
            tk * 1e6
        );
        // A serving step: SEQS sequences of ctx / SEQS rows each (the same bytes), one decode query
        // each, as one ragged batch (one dispatch pair) against one call per sequence in one encoder.
        const SEQS: usize = 8;
        let mut many = PagedCache::with_kernels(cache.kernels().clone(), spec, PAGE, ctx / PAGE)?;
        let seqs: Vec<SeqId> = (0..SEQS)
            .map(|_| many.add_sequence())
            .collect::<kvgpu::Result<_>>()?;
        for pair in seqs.chunks(2) {
            fill_paged(&mut many, pair[0], pair[1], ctx / SEQS)?;
        }
        let batch: Vec<(SeqId, usize)> = seqs.iter().map(|&s| (s, 1)).collect();
        let record_one = |attn: &mut Attention,
                          enc: &mut wgpu::CommandEncoder,
                          seq: Option<SeqId>|
         -> Result<()> {
            let (kv, n) = match seq {
                Some(s) => (Kv::Sequence(&many, s), 1),
                None => (Kv::Batch(&many, &batch), SEQS),
            };
            inputs.record(kind, &shape, attn, kv, enc, n, &opts)
        };
        let mut k_batch = || -> Result<f64> {
            let mut res = Ok(());
            let t = timer.gpu(|enc| res = record_one(&mut attn.borrow_mut(), enc, None))?;
            res.map(|_| t)
        };
        let mut k_each = || -> Result<f64> {
            let mut res = Ok(());
            let t = timer.gpu(|enc| {
                res = seqs
                    .iter()
                    .try_for_each(|&s| record_one(&mut attn.borrow_mut(), enc, Some(s)))
            })?;
            res.map(|_| t)
        };
        let [tb, te] = interleaved(warm, reps, [&mut k_batch, &mut k_each])?;
        rows.push(
            Row::new(
                format!(
                    "ragged batch attention, {label} {dtype}, {SEQS} sequences x {} rows, 1 query each",
                    ctx / SEQS
                ),
                tb * 1e6,
                "us",
                timer.clock(),
            )
            .ratio(
                tb / te,
                format!(
                    "one paged call per sequence, in one encoder ({:.1} us)",
                    te * 1e6
                ),
                Goal::Info,
            ),
        );
        eprintln!(
            "  {label} {dtype} {SEQS} x {}: batch {:.1} us, one call each {:.1} us",
            ctx / SEQS,
            tb * 1e6,
            te * 1e6
        );
    }
    let short = match kind {
        Kind::Gqa => "GQA",
        Kind::Mla => "MLA",
    };
    for (name, mut pts) in [
        (format!("kvgpu {short} {dtype} (call)"), call_pts),
        (format!("candle {short} {dtype} (CPU)"), candle_pts),
    ] {
        pts.sort_unstable_by_key(|p| p.0);
        series.push((name, pts));
    }
    Ok(())
}
