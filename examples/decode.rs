//! Simulates autoregressive decoding with a real model's cache shapes: a prompt prefill, then N decode
//! steps. Each step, every attention layer appends deterministic pseudo-random K/V (or MLA latents) and
//! runs attention on the GPU over the visible rows; a sample of steps is checked against the CPU twins.
//!
//! `cargo run --release --example decode -- [--model llama3-8b|qwen3-0.6b|deepseek-v2-lite|hybrid]
//! [--tokens N] [--dtype f32|f16|bf16] [--prompt P]`
//!
//! The last line is `verified: <steps> steps, max abs error <e>`; the exit status is non-zero when an
//! output differs from the reference by more than `1e-4 · (1 + |reference|)`.
// Native only: it uses the blocking helpers. The browser demo is examples/web.
#![cfg_attr(target_arch = "wasm32", no_main)]
#![cfg(not(target_arch = "wasm32"))]

use std::io::{IsTerminal, Write};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use kvgpu::{
    Attention, AttentionOptions, CacheSpec, DType, Gpu, HostSlab, KvCache, MlaQueries, Queries,
    reference,
};

/// Outputs may differ from the f64 CPU reference by this much, scaled by `1 + |reference|`.
const TOLERANCE: f32 = 1e-4;

/// Deterministic pseudo-random values in [-1, 1).
fn values(seed: u64, n: usize) -> Vec<f32> {
    kvgpu::reference::pseudo_random(seed, n, 1.0)
}

struct Args {
    model: String,
    tokens: usize,
    prompt: usize,
    dtype: DType,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        model: "llama3-8b".into(),
        tokens: 64,
        prompt: 64,
        dtype: DType::F16,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--model" => args.model = value()?,
            "--tokens" => args.tokens = value()?.parse().map_err(|e| format!("--tokens: {e}"))?,
            "--prompt" => args.prompt = value()?.parse().map_err(|e| format!("--prompt: {e}"))?,
            "--dtype" => {
                let v = value()?;
                args.dtype =
                    DType::parse(&v).ok_or(format!("--dtype {v}: use f32, f16 or bf16"))?;
            }
            "-h" | "--help" => {
                return Err(
                    "usage: decode [--model llama3-8b|qwen3-0.6b|deepseek-v2-lite|hybrid] \
                            [--tokens N] [--dtype f32|f16|bf16] [--prompt P]"
                        .into(),
                );
            }
            other => return Err(format!("unknown argument {other:?} (try --help)")),
        }
    }
    if args.prompt == 0 {
        return Err("--prompt must be at least 1".into());
    }
    Ok(args)
}

/// Query heads per layer of each preset, and MLA's softmax scale (DeepSeek-V2-Lite: 1/sqrt(128 + 64)).
fn query_heads(model: &str) -> (usize, Option<f32>) {
    match model {
        "llama3-8b" => (32, None),
        "qwen3-0.6b" => (16, None),
        "deepseek-v2-lite" => (16, Some(1.0 / 192f32.sqrt())),
        _ => (16, None),
    }
}

/// What one attention layer reads: GQA with `(n_kv, d_k, d_v)` or MLA with `(r, p)`.
#[derive(Clone, Copy)]
enum Kind {
    Gqa { n_kv: usize, d_k: usize, d_v: usize },
    Mla { r: usize, p: usize },
}

struct Layer {
    index: usize,
    kind: Kind,
    /// Query buffers (one for GQA, latent and rope for MLA) and the output, sized for the prompt.
    q: Vec<wgpu::Buffer>,
    out: wgpu::Buffer,
    /// This step's queries on the host, for the check.
    q_host: Vec<Vec<f32>>,
}

impl Layer {
    fn q_dims(&self) -> Vec<usize> {
        match self.kind {
            Kind::Gqa { d_k, .. } => vec![d_k],
            Kind::Mla { r, p } => vec![r, p],
        }
    }
    fn d_out(&self) -> usize {
        match self.kind {
            Kind::Gqa { d_v, .. } => d_v,
            Kind::Mla { r, .. } => r,
        }
    }
}

struct Run {
    gpu: Gpu,
    cache: KvCache,
    attention: Attention,
    layers: Vec<Layer>,
    n_heads: usize,
    options: AttentionOptions,
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
    };
    match run(&args) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: &Args) -> kvgpu::Result<bool> {
    let gpu = Gpu::from_env_blocking()?;
    let capacity = args.prompt + args.tokens;
    let spec = CacheSpec::preset(&args.model, args.dtype, capacity)?;
    let cache = KvCache::new(&gpu.device, &gpu.queue, spec.clone())?;
    let (n_heads, scale) = query_heads(&args.model);
    let storage = |bytes: usize| {
        gpu.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("decode"),
            size: bytes.max(4) as u64,
            usage: wgpu::BufferUsages::STORAGE
                | wgpu::BufferUsages::COPY_DST
                | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        })
    };
    let mut layers = Vec::new();
    for (index, layer) in spec.layers().iter().enumerate() {
        let shapes: Vec<&[usize]> = layer.slots.iter().map(|s| s.trailing.as_slice()).collect();
        let kind = match shapes.as_slice() {
            [] => continue,
            [[n_kv, d_k], [_, d_v]] => Kind::Gqa {
                n_kv: *n_kv,
                d_k: *d_k,
                d_v: *d_v,
            },
            [[r], [p]] => Kind::Mla { r: *r, p: *p },
            _ => unreachable!("presets have K/V or MLA layers"),
        };
        let mut l = Layer {
            index,
            kind,
            q: Vec::new(),
            out: storage(0),
            q_host: Vec::new(),
        };
        let rows = args.prompt * n_heads;
        l.q = l.q_dims().iter().map(|d| storage(rows * d * 4)).collect();
        l.out = storage(rows * l.d_out() * 4);
        layers.push(l);
    }
    let mut run = Run {
        attention: Attention::new(&gpu.device, &gpu.queue)?,
        gpu,
        cache,
        layers,
        n_heads,
        options: AttentionOptions {
            scale,
            ..Default::default()
        },
    };

    println!("adapter: {}", run.gpu.describe());
    let first = &run.layers[0];
    let shape = match first.kind {
        Kind::Gqa { n_kv, d_k, d_v } => {
            format!("GQA, {n_heads} query heads over {n_kv} KV heads, d_k {d_k}, d_v {d_v}")
        }
        Kind::Mla { r, p } => format!("MLA, {n_heads} heads over latents r {r} + rope {p}"),
    };
    println!(
        "model: {} ({} layers, {} with attention: {shape}), {} storage",
        args.model,
        spec.n_layers(),
        run.layers.len(),
        args.dtype
    );
    println!(
        "cache: {:.1} MiB ({capacity} tokens x {:.1} KiB/token)",
        spec.total_bytes() as f64 / (1 << 20) as f64,
        spec.bytes_per_token() as f64 / 1024.0
    );

    // Steps checked against the CPU twins: the prefill, the first, last and a few decode steps between.
    let checked = |step: usize| {
        step == 0
            || step == 1
            || step == args.tokens
            || step.is_multiple_of((args.tokens / 4).max(1))
    };
    let (mut verified, mut max_err, mut ok) = (0usize, 0f32, true);
    let mut check = |run: &Run, step: usize| -> kvgpu::Result<()> {
        if checked(step) {
            let (err, good) = verify(run, if step == 0 { args.prompt } else { 1 })?;
            verified += 1;
            max_err = max_err.max(err);
            if !good {
                eprintln!("MISMATCH at step {step}: max abs error {err:e}");
                ok = false;
            }
        }
        Ok(())
    };

    let t = Instant::now();
    let (a, b) = step(&mut run, 0, args.prompt)?;
    check(&run, 0)?;
    run.cache.advance(args.prompt)?;
    println!(
        "prefill: {} tokens in {:.1} ms (append {:.1} ms, attention {:.1} ms)",
        args.prompt,
        t.elapsed().as_secs_f64() * 1e3,
        ms(a),
        ms(b)
    );

    let progress = Progress::new(args.tokens);
    let (mut append, mut attend) = (Duration::ZERO, Duration::ZERO);
    for s in 1..=args.tokens {
        let (a, b) = step(&mut run, s, 1)?;
        append += a;
        attend += b;
        check(&run, s)?;
        run.cache.advance(1)?;
        progress.update(s, append + attend);
    }
    progress.finish();
    let n = args.tokens.max(1) as f64;
    let total = (append + attend).as_secs_f64();
    println!(
        "decode: {} steps, per step {:.2} ms = append {:.2} ms + attention {:.2} ms; {:.1} tokens/s",
        args.tokens,
        total * 1e3 / n,
        ms(append) / n,
        ms(attend) / n,
        if total > 0.0 {
            args.tokens as f64 / total
        } else {
            0.0
        }
    );
    println!("verified: {verified} steps, max abs error {max_err:e}");
    Ok(ok)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn wait(gpu: &Gpu) -> kvgpu::Result<()> {
    gpu.device
        .poll(wgpu::PollType::wait_indefinitely())
        .map(drop)
        .map_err(|e| kvgpu::Error::Device {
            reason: e.to_string(),
        })
}

/// One step of `n` tokens: every attention layer appends its rows (timed up to their arrival on the
/// GPU), then attention of all layers runs in one submission (timed until it finishes).
fn step(run: &mut Run, step: usize, n: usize) -> kvgpu::Result<(Duration, Duration)> {
    let t0 = Instant::now();
    for l in &run.layers {
        let seed = (step as u64) << 20 | (l.index as u64) << 4;
        let slots = &run.cache.spec().layers()[l.index].slots;
        let shapes: Vec<Vec<usize>> = slots
            .iter()
            .map(|s| [&[n][..], &s.trailing].concat())
            .collect();
        let data: Vec<Vec<f32>> = shapes
            .iter()
            .enumerate()
            .map(|(i, sh)| values(seed + i as u64, sh.iter().product()))
            .collect();
        let slabs: Vec<HostSlab> = data
            .iter()
            .zip(&shapes)
            .map(|(d, sh)| HostSlab::f32(d, sh))
            .collect();
        run.cache.append(l.index, &slabs)?;
    }
    run.gpu.queue.submit([]);
    wait(&run.gpu)?;
    let t1 = Instant::now();

    let mut encoder = run
        .gpu
        .device
        .create_command_encoder(&wgpu::CommandEncoderDescriptor {
            label: Some("decode step"),
        });
    let h = run.n_heads;
    for l in &mut run.layers {
        let seed = (step as u64) << 20 | (l.index as u64) << 4 | 8;
        l.q_host = l
            .q_dims()
            .iter()
            .enumerate()
            .map(|(i, d)| values(seed + i as u64, n * h * d))
            .collect();
        for (buffer, q) in l.q.iter().zip(&l.q_host) {
            run.gpu
                .queue
                .write_buffer(buffer, 0, bytemuck::cast_slice(q));
        }
        match l.kind {
            Kind::Gqa { d_k, .. } => run.attention.record_gqa(
                &mut encoder,
                &run.cache,
                l.index,
                Queries::new(&l.q[0], n, h, d_k),
                &l.out,
                &run.options,
            )?,
            Kind::Mla { r, p } => run.attention.record_mla(
                &mut encoder,
                &run.cache,
                l.index,
                MlaQueries {
                    latent: Queries::new(&l.q[0], n, h, r),
                    rope: Queries::new(&l.q[1], n, h, p),
                },
                &l.out,
                &run.options,
            )?,
        }
    }
    run.gpu.queue.submit([encoder.finish()]);
    wait(&run.gpu)?;
    Ok((t1 - t0, t1.elapsed()))
}

/// Compares this step's outputs of every attention layer with the CPU twins over the rows the cache
/// stores; returns the largest absolute error and whether every output is within the tolerance.
fn verify(run: &Run, n_q: usize) -> kvgpu::Result<(f32, bool)> {
    let (mut worst, mut good) = (0f32, true);
    let h = run.n_heads;
    for l in &run.layers {
        let a = run.cache.read_f32(l.index, 0)?;
        let b = run.cache.read_f32(l.index, 1)?;
        let want = match l.kind {
            Kind::Gqa { n_kv, d_k, d_v } => reference::attention_gqa(
                &l.q_host[0],
                [n_q, h, d_k],
                &a,
                &b,
                n_kv,
                d_v,
                &run.options,
            ),
            Kind::Mla { r, p } => reference::attention_mla(
                &l.q_host[0],
                &l.q_host[1],
                [n_q, h, r],
                &a,
                &b,
                p,
                &run.options,
            ),
        };
        let got = read_buffer(&run.gpu, &l.out, want.len())?;
        for (g, w) in got.iter().zip(&want) {
            let err = (g - w).abs();
            worst = worst.max(err);
            good &= err <= TOLERANCE * (1.0 + w.abs());
        }
    }
    Ok((worst, good))
}

fn read_buffer(gpu: &Gpu, buffer: &wgpu::Buffer, n: usize) -> kvgpu::Result<Vec<f32>> {
    let bytes = kvgpu::read_buffer(&gpu.device, &gpu.queue, buffer, 0, (n * 4) as u64)?;
    Ok(bytemuck::pod_collect_to_vec(&bytes))
}

/// A progress bar on stderr: redrawn in place on a terminal, a line per quarter otherwise.
struct Progress {
    total: usize,
    tty: bool,
}

impl Progress {
    fn new(total: usize) -> Self {
        Self {
            total,
            tty: std::io::stderr().is_terminal(),
        }
    }

    fn update(&self, done: usize, elapsed: Duration) {
        let rate = done as f64 / elapsed.as_secs_f64().max(1e-9);
        let mut err = std::io::stderr();
        if self.tty {
            let filled = done * 30 / self.total.max(1);
            let _ = write!(
                err,
                "\r[{}{}] {done}/{} steps, {rate:.1} tokens/s ",
                "#".repeat(filled),
                "-".repeat(30 - filled),
                self.total
            );
        } else if self.total >= 64 && done.is_multiple_of(self.total / 4) {
            let _ = writeln!(err, "{done}/{} steps, {rate:.1} tokens/s", self.total);
        }
    }

    fn finish(&self) {
        if self.tty {
            let _ = writeln!(std::io::stderr());
        }
    }
}
