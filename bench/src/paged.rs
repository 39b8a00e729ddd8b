//! The paged pool at serving scale, Llama-3-8B layer shapes in f16 (8 KV heads of 128, 16-row pages):
//! - batched decode attention over 1 to 128 sequences of ragged lengths, one query each, in one
//!   dispatch pair: KV bytes per second against the streaming-read roofline, and time against the
//!   single-sequence kernel over a contiguous cache holding the same rows (the cost of paging);
//! - a decode append step of 32 sequences into 32 layers, scattered into their pages (one upload and
//!   one dispatch per layer and slot), against one `write_buffer` of the same bytes and against one
//!   append per sequence;
//! - fork (and removal) of a sequence across prefix lengths: pages are shared, nothing is copied.

use anyhow::Result;
use half::f16;
use kvgpu::reference::Xorshift;
use kvgpu::{
    Attention, AttentionOptions, CacheSpec, DType, Gpu, GpuSlab, HostSlab, Kv, KvCache, LayerSpec,
    PagedCache, Queries, ScatterChoice, SeqId,
};

use crate::Config;
use crate::refs::{StreamRead, storage};
use crate::report::{Goal, Row};
use crate::timing::{Clock, Timer, interleaved};

const PAGE: usize = 16;
const HEADS: usize = 32;
const KV_HEADS: usize = 8;
const DIM: usize = 128;
/// Elements of one row of one slot.
const ROW: usize = KV_HEADS * DIM;
/// The longest sequence of a batch of eight or more.
const LONGEST: usize = 8192;

fn values(n: usize, seed: usize) -> Vec<f32> {
    (0..n)
        .map(|i| (((i * 2_654_435_761 + seed) >> 7) % 2001) as f32 * 1e-3 - 1.0)
        .collect()
}

fn layer() -> LayerSpec {
    LayerSpec::kv(KV_HEADS, DIM, DIM)
}

/// Ragged lengths: uniform in `[16, 2 · mean - 16]`, and one sequence of `LONGEST` rows in batches
/// of eight or more; a lone sequence has `mean` rows.
fn lengths(n: usize, mean: usize) -> Vec<usize> {
    if n == 1 {
        return vec![mean];
    }
    let mut rng = Xorshift::new(n as u64 * 7919 + mean as u64);
    (0..n)
        .map(|i| {
            if i == 0 && n >= 8 {
                LONGEST
            } else {
                16 + rng.below(2 * mean - 31)
            }
        })
        .collect()
}

/// Appends `rows` rows of `layer` to `seq` in chunks (pages scattered by the pool), uncommitted.
fn fill_layer(pool: &mut PagedCache, seq: SeqId, layer: usize, rows: usize) -> Result<()> {
    let chunk = 1024;
    let data = values(chunk * ROW, layer);
    let mut done = 0;
    while done < rows {
        let n = chunk.min(rows - done);
        let shape = [n, KV_HEADS, DIM];
        let slab = HostSlab::f32(&data[..n * ROW], &shape);
        pool.append(seq, layer, &[slab, slab])?;
        done += n;
    }
    Ok(())
}

/// `KVGPU_BENCH_PAGED=decode,append,fork` picks parts (default: all).
pub fn run(gpu: &Gpu, timer: &Timer, cfg: &Config, rows: &mut Vec<Row>) -> Result<()> {
    let parts = std::env::var("KVGPU_BENCH_PAGED").unwrap_or_else(|_| "decode,append,fork".into());
    let wanted = |p: &str| parts.split(',').any(|x| x == p);
    if wanted("decode") {
        batched_decode(gpu, timer, cfg, rows)?;
    }
    if wanted("append") {
        append_step(gpu, timer, cfg, rows)?;
    }
    if wanted("fork") {
        fork_cost(gpu, cfg, rows)?;
    }
    Ok(())
}

fn batched_decode(gpu: &Gpu, timer: &Timer, cfg: &Config, rows: &mut Vec<Row>) -> Result<()> {
    // 128 sequences of mean 1k would need 256 MiB per slot, twice one storage binding: that batch
    // is measured at a mean of 256.
    let batches = [(1, 1024), (8, 1024), (32, 1024), (128, 256)];
    let row_bytes = (2 * ROW * 2) as u64;
    let most = batches
        .iter()
        .map(|&(n, mean)| lengths(n, mean).iter().sum::<usize>())
        .max()
        .unwrap_or(1);
    let limit = gpu.device.limits().max_storage_buffer_binding_size;
    let roof_cap = (most as u64 * row_bytes).min(limit);
    let roof = StreamRead::new(&gpu.device, &gpu.queue, roof_cap);
    let (warm, reps) = (cfg.warm.min(2), cfg.reps.min(7));
    let opts = AttentionOptions::default();
    for (n, mean) in batches {
        let lens = lengths(n, mean);
        let total: usize = lens.iter().sum();
        let pages: usize = lens.iter().map(|l| l.div_ceil(PAGE)).sum();
        let spec = CacheSpec::new(vec![layer()], DType::F16, LONGEST.max(2 * mean))?;
        let mut pool = PagedCache::new(&gpu.device, &gpu.queue, spec, PAGE, pages)?;
        let mut seqs = Vec::with_capacity(n);
        for &len in &lens {
            let s = pool.add_sequence()?;
            fill_layer(&mut pool, s, 0, len)?;
            pool.advance(s, len)?;
            seqs.push(s);
        }
        let contiguous_spec = CacheSpec::new(vec![layer()], DType::F16, total)?;
        let mut cache = KvCache::with_kernels(pool.kernels().clone(), contiguous_spec)?;
        let data = values(1024 * ROW, 1);
        let mut done = 0;
        while done < total {
            let k = 1024.min(total - done);
            let shape = [k, KV_HEADS, DIM];
            let slab = HostSlab::f32(&data[..k * ROW], &shape);
            cache.append(0, &[slab, slab])?;
            cache.advance(k)?;
            done += k;
        }
        let q = storage(&gpu.device, (n * HEADS * DIM * 4) as u64, "bench q");
        let out = storage(&gpu.device, (n * HEADS * DIM * 4) as u64, "bench out");
        gpu.queue
            .write_buffer(&q, 0, bytemuck::cast_slice(&values(n * HEADS * DIM, 11)));
        let batch: Vec<(SeqId, usize)> = seqs.iter().map(|&s| (s, 1)).collect();
        let mut attn = Attention::with_kernels(pool.kernels().clone());
        let attn = std::cell::RefCell::new(&mut attn);
        let mut k_batch = || -> Result<f64> {
            let mut res = Ok(());
            let t = timer.gpu(|enc| {
                res = attn.borrow_mut().record_gqa(
                    enc,
                    Kv::Batch(&pool, &batch),
                    0,
                    Queries::new(&q, n, HEADS, DIM),
                    &out,
                    &opts,
                )
            })?;
            res.map(|_| t).map_err(Into::into)
        };
        let mut k_contiguous = || -> Result<f64> {
            let mut res = Ok(());
            let t = timer.gpu(|enc| {
                res = attn.borrow_mut().record_gqa(
                    enc,
                    &cache,
                    0,
                    Queries::new(&q, 1, HEADS, DIM),
                    &out,
                    &opts,
                )
            })?;
            res.map(|_| t).map_err(Into::into)
        };
        let bytes = total as u64 * row_bytes;
        // The roofline over at most one binding's bytes (its fastest grid shape, found first),
        // timed interleaved with the kernels and scaled to the batch's bytes.
        let read = bytes.min(roof_cap);
        let ([tb, tc], tr) = roof.best(timer, read)?.interleaved_with(
            timer,
            warm,
            reps,
            [&mut k_batch, &mut k_contiguous],
        )?;
        let tr = tr * bytes as f64 / read as f64;
        let roof_what = if read == bytes {
            "stream_read of the same bytes".to_string()
        } else {
            format!(
                "stream_read of one binding's {} MiB, scaled to the batch's bytes",
                read >> 20
            )
        };
        let (lo, hi) = (
            lens.iter().min().copied().unwrap_or(0),
            lens.iter().max().copied().unwrap_or(0),
        );
        let what = format!(
            "batched decode GQA f16, {n} sequences, {total} rows (lengths {lo}-{hi}, mean {})",
            total / n
        );
        rows.push(
            Row::new(
                format!("{what}: KV bandwidth"),
                bytes as f64 / tb / 1e9,
                "GB/s",
                timer.clock(),
            )
            .ratio(
                tr / tb,
                format!("{roof_what} ({:.2} GB/s)", bytes as f64 / tr / 1e9),
                Goal::AtMost(1.0),
            ),
        );
        rows.push(
            Row::new(format!("{what}: time"), tb * 1e6, "us", timer.clock()).ratio(
                tb / tc,
                format!(
                    "one query over a contiguous cache of the same rows ({:.1} us)",
                    tc * 1e6
                ),
                Goal::AtMost(1.1),
            ),
        );
        eprintln!(
            "  {n} sequences, {total} rows: batch {:.1} us, contiguous {:.1} us, roofline {:.1} us",
            tb * 1e6,
            tc * 1e6,
            tr * 1e6
        );
    }
    Ok(())
}

fn append_step(gpu: &Gpu, timer: &Timer, cfg: &Config, rows: &mut Vec<Row>) -> Result<()> {
    const LAYERS: usize = 32;
    const SEQS: usize = 32;
    const LEN: usize = 100;
    let spec = CacheSpec::new(vec![layer(); LAYERS], DType::F16, 2 * LEN)?;
    // Every sequence's rows so far, and a page for the row of the step.
    let mut pool = PagedCache::new(&gpu.device, &gpu.queue, spec, PAGE, SEQS * (LEN / PAGE + 1))?;
    let mut seqs = Vec::with_capacity(SEQS);
    for _ in 0..SEQS {
        let s = pool.add_sequence()?;
        for layer in 0..LAYERS {
            fill_layer(&mut pool, s, layer, LEN)?;
        }
        pool.advance(s, LEN)?;
        seqs.push(s);
    }
    let k: Vec<f16> = values(SEQS * ROW, 3)
        .into_iter()
        .map(f16::from_f32)
        .collect();
    let v: Vec<f16> = values(SEQS * ROW, 5)
        .into_iter()
        .map(f16::from_f32)
        .collect();
    let batch: Vec<(SeqId, usize)> = seqs.iter().map(|&s| (s, 1)).collect();
    let step_bytes = (LAYERS * 2 * SEQS * ROW * 2) as u64;
    // The references: the step's bytes in one write_buffer, and one append per sequence and layer.
    let raw = storage(&gpu.device, step_bytes, "bench raw step");
    let mut all: Vec<f16> = Vec::with_capacity(LAYERS * 2 * SEQS * ROW);
    for _ in 0..LAYERS {
        all.extend_from_slice(&k);
        all.extend_from_slice(&v);
    }
    // The same rows in a GPU buffer of the storage type (a model's K and V output).
    let kv_gpu = storage(
        &gpu.device,
        2 * (SEQS * ROW * 2) as u64,
        "bench step K and V",
    );
    gpu.queue.write_buffer(&kv_gpu, 0, bytemuck::cast_slice(&k));
    gpu.queue
        .write_buffer(&kv_gpu, (SEQS * ROW * 2) as u64, bytemuck::cast_slice(&v));
    pollster::block_on(kvgpu::verify_buffer(&gpu.device, &kv_gpu))?;
    let v_offset = (SEQS * ROW) as u64;
    let pool = std::cell::RefCell::new(pool);
    // One step, from the host or recorded from the GPU buffer; batched, or one call per sequence.
    // Each starts from the same lengths: the rollback is not timed.
    let step = |choice: ScatterChoice, from_gpu: bool, batched: bool| -> Result<f64> {
        let pool = &mut *pool.borrow_mut();
        for &s in &seqs {
            pool.truncate(s, LEN)?;
        }
        pool.set_scatter(choice);
        timer.host(|| {
            let mut enc = gpu
                .device
                .create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None });
            let parts: Vec<(usize, &[(SeqId, usize)])> = if batched {
                vec![(0, &batch[..])]
            } else {
                (0..SEQS).map(|i| (i, &batch[i..i + 1])).collect()
            };
            for layer in 0..LAYERS {
                for &(first, part) in &parts {
                    let shape = [part.len(), KV_HEADS, DIM];
                    let at = first * ROW;
                    if from_gpu {
                        let slab = |offset: u64| GpuSlab {
                            buffer: &kv_gpu,
                            dtype: DType::F16,
                            offset: offset + at as u64,
                            shape: &shape,
                            strides: None,
                        };
                        pool.record_append_gpu_batch(
                            &mut enc,
                            layer,
                            part,
                            &[slab(0), slab(v_offset)],
                        )?;
                    } else {
                        let n = part.len() * ROW;
                        let slabs = [
                            HostSlab::f16(&k[at..at + n], &shape),
                            HostSlab::f16(&v[at..at + n], &shape),
                        ];
                        pool.append_batch(layer, part, &slabs)?;
                    }
                }
            }
            for &s in &seqs {
                pool.advance(s, 1)?;
            }
            gpu.queue.submit([enc.finish()]);
            Ok(())
        })
    };
    let mut one_write = || -> Result<f64> {
        timer.host(|| {
            gpu.queue.write_buffer(&raw, 0, bytemuck::cast_slice(&all));
            Ok(())
        })
    };
    let reps = cfg.step_reps.min(30);
    let what = format!("paged append step, {SEQS} sequences x 1 row, {LAYERS} layers, f16");
    for (from_gpu, source) in [(false, "host rows"), (true, "rows of an f16 GPU buffer")] {
        let [auto, always, each, tw] = interleaved(
            cfg.warm,
            reps,
            [
                &mut || step(ScatterChoice::Auto, from_gpu, true),
                &mut || step(ScatterChoice::Always, from_gpu, true),
                &mut || step(ScatterChoice::Never, from_gpu, false),
                &mut one_write,
            ],
        )?;
        for (choice, t) in [("Auto", auto), ("Always (scattered)", always)] {
            rows.push(
                Row::new(
                    format!("{what}, {source}, one batch per layer, scatter {choice}"),
                    t * 1e6,
                    "us",
                    Clock::HostWall,
                )
                .ratio(
                    t / tw,
                    format!(
                        "one write_buffer of the same {step_bytes} bytes ({:.1} us)",
                        tw * 1e6
                    ),
                    Goal::Info,
                ),
            );
        }
        rows.push(
            Row::new(
                format!("{what}, {source}, one batch per layer, scatter Auto"),
                auto * 1e6,
                "us",
                Clock::HostWall,
            )
            .ratio(
                auto / each,
                format!("one append per sequence and layer ({:.1} us)", each * 1e6),
                Goal::AtMost(1.0),
            ),
        );
        eprintln!(
            "  append step, {source}: batch (auto) {:.1} us, batch scattered {:.1} us, one per sequence {:.1} us, one write_buffer {:.1} us",
            auto * 1e6,
            always * 1e6,
            each * 1e6,
            tw * 1e6
        );
    }
    Ok(())
}

fn fork_cost(gpu: &Gpu, cfg: &Config, rows: &mut Vec<Row>) -> Result<()> {
    let prefixes = [512, 4096, 16384];
    let longest = prefixes[prefixes.len() - 1];
    let spec = CacheSpec::new(vec![layer()], DType::F16, longest + PAGE)?;
    let mut pool = PagedCache::new(
        &gpu.device,
        &gpu.queue,
        spec,
        PAGE,
        longest / PAGE + prefixes.len() + 1,
    )?;
    let parent = pool.add_sequence()?;
    fill_layer(&mut pool, parent, 0, longest)?;
    pool.advance(parent, longest)?;
    // The parent's rows published under token ids, for starting sequences from them.
    let tokens: Vec<u32> = (0..longest as u32).collect();
    pool.publish_prefix(parent, &tokens)?;
    let reps = cfg.step_reps * 5;
    let pool = std::cell::RefCell::new(pool);
    let fork = |at: usize| {
        let pool = &pool;
        move || -> Result<f64> {
            let pool = &mut *pool.borrow_mut();
            let t = std::time::Instant::now();
            let child = pool.fork(parent, at)?;
            pool.remove(child)?;
            Ok(t.elapsed().as_secs_f64())
        }
    };
    let prefixed = |at: usize| {
        let (pool, tokens) = (&pool, &tokens);
        move || -> Result<f64> {
            let pool = &mut *pool.borrow_mut();
            let t = std::time::Instant::now();
            let (child, len) = pool.add_sequence_with_prefix(&tokens[..at])?;
            anyhow::ensure!(len == at, "{len} of {at} rows matched");
            pool.remove(child)?;
            Ok(t.elapsed().as_secs_f64())
        }
    };
    // Every length of both in one interleaved loop: each row's ratio is to the fork at the first
    // length, timed beside it.
    let [a, b, c] = prefixes;
    let (mut f0, mut f1, mut f2) = (fork(a), fork(b), fork(c));
    let (mut p0, mut p1, mut p2) = (prefixed(a), prefixed(b), prefixed(c));
    let [t0, t1, t2, m0, m1, m2] = interleaved(
        cfg.warm,
        reps,
        [&mut f0, &mut f1, &mut f2, &mut p0, &mut p1, &mut p2],
    )?;
    let (times, matched) = ([t0, t1, t2], [m0, m1, m2]);
    let base = format!(
        "fork + remove at {} rows ({:.2} us)",
        prefixes[0],
        times[0] * 1e6
    );
    for (what, samples, name) in [
        (
            "add_sequence_with_prefix + remove",
            &matched,
            "published rows",
        ),
        ("fork + remove", &times, "rows of the parent"),
    ] {
        for (&at, &t) in prefixes.iter().zip(samples) {
            rows.push(
                Row::new(
                    format!("{what}, {at} {name} ({} pages), GQA f16", at / PAGE),
                    t * 1e6,
                    "us",
                    Clock::Cpu,
                )
                .ratio(t / times[0], base.clone(), Goal::Info),
            );
        }
        let each: Vec<String> = prefixes
            .iter()
            .zip(samples)
            .map(|(a, t)| format!("{a} rows {:.2} us", t * 1e6))
            .collect();
        eprintln!("  {what}: {}", each.join(", "));
    }
    Ok(())
}
