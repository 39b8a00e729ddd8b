//! Simulates autoregressive decoding with a real model's cache shapes: a prompt prefill, then N decode
//! steps. Each step, every attention layer appends deterministic pseudo-random K/V (or MLA latents) and
//! runs attention on the GPU over the visible rows; a sample of steps is checked against the CPU twins.
//!
//! `cargo run --release --example decode -- --help` lists the flags and their defaults.
//!
//! The last line is `verified: <steps> steps, max abs error <e>`; the exit status is non-zero when an
//! output differs from the reference by more than `1e-4 · (1 + |reference|)`.
// Native only: it uses the blocking helpers. The browser demo is examples/web.
#![cfg_attr(target_arch = "wasm32", no_main)]
#![cfg(not(target_arch = "wasm32"))]

use std::io::{IsTerminal, Write};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Parser;

#[path = "shared/check.rs"]
mod check;
#[path = "shared/cli.rs"]
mod cli;
use cli::{
    Model, SlotStorage, Storage, count, describe_storage, query_heads, slot_storage,
    with_slot_storage,
};
use kvgpu::{
    Attention, AttentionOptions, CacheSpec, DType, Gpu, HostSlab, KvCache, MlaQueries, Queries,
    reference,
};

/// The largest `--prompt`: the CPU check of the prefill grows with its square (every prompt token
/// attends to every earlier one, in every layer).
const MAX_PROMPT: usize = 4096;
/// The largest `--tokens` (decode steps).
const MAX_TOKENS: usize = 4096;

/// Deterministic pseudo-random values in [-1, 1).
fn values(seed: u64, n: usize) -> Vec<f32> {
    kvgpu::reference::pseudo_random(seed, n, 1.0)
}

/// Simulates LLM decoding with a real model's KV-cache shapes on the default GPU adapter: a prompt
/// prefill, then one decode step per token, each appending K/V (or MLA latents) to every attention
/// layer and running attention on the GPU. A sample of steps is checked against the CPU reference.
/// No model weights run: the times and tokens/s it reports are the cache's and attention's alone, not
/// a model's throughput.
///
/// The adapter is chosen with WGPU_BACKEND (vulkan, gl, metal, dx12).
#[derive(Parser, Debug)]
#[command(
    name = "decode",
    allow_negative_numbers = true,
    after_help = "The last line is `verified: <steps> steps, max abs error <e>`; the exit status is \
                  non-zero when an output differs from the CPU reference by more than \
                  1e-4 * (1 + |reference|)."
)]
struct Args {
    /// Model whose cache shapes and query heads to use
    #[arg(long, value_enum, default_value_t = Model::Llama3_8b)]
    model: Model,
    /// Decode steps (one token each) after the prompt, 1 to 4096
    #[arg(long, default_value_t = 64, value_parser = |s: &str| count(s, MAX_TOKENS))]
    tokens: usize,
    /// Prompt tokens written and attended in the prefill, 1 to 4096 (the CPU check of the prefill grows
    /// with its square)
    #[arg(long, default_value_t = 64, value_parser = |s: &str| count(s, MAX_PROMPT))]
    prompt: usize,
    /// Element type the cache stores (attention computes in f32)
    #[arg(long, value_enum, default_value_t = Storage::F16)]
    dtype: Storage,
    /// A slot stored in its own type, SLOT=TYPE (repeatable): `v=q4_0` keeps values in q4_0 whatever
    /// --dtype says, `k_pe=f16` DeepSeek's rope key in f16
    #[arg(long = "slot-dtype", value_name = "SLOT=TYPE", value_parser = slot_storage)]
    slot_dtype: Vec<SlotStorage>,
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
    // Clap prints --help, or the refused value and what is allowed, and exits before any adapter opens.
    let args = Args::parse();
    match run(&args) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Where the run's time went; `summary` names the rest "other".
#[derive(Default)]
struct Times {
    setup: Duration,
    pipelines: Duration,
    prefill: Duration,
    append: Duration,
    attend: Duration,
    verify: Duration,
}

fn run(args: &Args) -> kvgpu::Result<bool> {
    let start = Instant::now();
    let (prompt, tokens) = (args.prompt, args.tokens);
    let dtype = DType::from(args.dtype);
    let mut times = Times::default();
    let capacity = prompt + tokens;
    // The spec first: a slot name the model lacks is refused before an adapter opens.
    let spec = with_slot_storage(
        CacheSpec::preset(args.model.name(), dtype, capacity)?,
        &args.slot_dtype,
    )?;
    let gpu = Gpu::from_env_blocking()?;
    let cache = KvCache::new(&gpu.device, &gpu.queue, spec.clone())?;
    let (n_heads, scale) = query_heads(args.model);
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
    // Every layer's queries and output for the whole prompt (up to about 7 GiB at the longest):
    // made under the out-of-memory check, so a device without room refuses the run instead of
    // wgpu panicking.
    let scope = gpu.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
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
        let rows = prompt * n_heads;
        l.q = l.q_dims().iter().map(|d| storage(rows * d * 4)).collect();
        l.out = storage(rows * l.d_out() * 4);
        layers.push(l);
    }
    if let Some(e) = pollster::block_on(scope.pop()) {
        return Err(kvgpu::Error::Device {
            reason: format!("the queries and outputs of a {prompt}-token prompt: {e}"),
        });
    }
    let mut run = Run {
        attention: Attention::for_cache(&cache),
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
        args.model.name(),
        spec.n_layers(),
        run.layers.len(),
        describe_storage(&spec),
    );
    println!(
        "cache: {:.1} MiB ({capacity} tokens x {:.1} KiB/token)",
        spec.total_bytes() as f64 / (1 << 20) as f64,
        spec.bytes_per_token() as f64 / 1024.0
    );
    times.setup = start.elapsed();

    // Build (compile) the attention pipelines before the first token: seconds on a software adapter,
    // more on OpenGL with a cold Mesa shader cache.
    eprintln!("building attention pipelines for {shape}…");
    let t = Instant::now();
    let built = run.attention.prepare(&run.cache, n_heads)?;
    times.pipelines = t.elapsed();
    println!(
        "pipelines: {built} built in {:.1} ms (Attention::prepare)",
        ms(times.pipelines)
    );

    // Steps checked against the CPU twins: the prefill, the first, last and a few decode steps between.
    let checked = |step: usize| {
        step == 0 || step == 1 || step == tokens || step.is_multiple_of((tokens / 4).max(1))
    };
    let (mut verified, mut max_err, mut ok) = (0usize, 0f32, true);
    let mut check = |run: &Run, step: usize, times: &mut Times| -> kvgpu::Result<()> {
        if checked(step) {
            let t = Instant::now();
            let progress = (step == 0).then(|| {
                Progress::new(
                    "checking the prefill on the CPU",
                    run.layers.len(),
                    "layers",
                )
            });
            let (err, good) = verify(run, if step == 0 { prompt } else { 1 }, progress)?;
            times.verify += t.elapsed();
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
    let progress = Progress::new(
        &format!("prefill of {prompt} tokens"),
        run.layers.len(),
        "layers",
    );
    let (a, b) = step(&mut run, 0, prompt, Some(progress))?;
    times.prefill = t.elapsed();
    println!(
        "prefill: {prompt} tokens in {:.1} ms (append {:.1} ms, attention {:.1} ms)",
        ms(times.prefill),
        ms(a),
        ms(b)
    );
    check(&run, 0, &mut times)?;
    run.cache.advance(prompt)?;

    let progress = Progress::new("decode", tokens, "steps");
    for s in 1..=tokens {
        let (a, b) = step(&mut run, s, 1, None)?;
        times.append += a;
        times.attend += b;
        check(&run, s, &mut times)?;
        run.cache.advance(1)?;
        progress.update(s);
    }
    progress.finish();
    let n = tokens as f64;
    let total = (times.append + times.attend).as_secs_f64();
    println!(
        "decode: {tokens} steps, per step {:.2} ms = append {:.2} ms + attention {:.2} ms; {:.1} tokens/s \
         (cache appends + attention only; no model weights run, so not a model's throughput)",
        total * 1e3 / n,
        ms(times.append) / n,
        ms(times.attend) / n,
        if total > 0.0 { n / total } else { 0.0 }
    );
    println!("{}", summary(&times, start.elapsed()));
    println!("verified: {verified} steps, max abs error {max_err:e}");
    Ok(ok)
}

/// One line accounting for the whole run: its parts and the rest ("other": advancing the cache,
/// progress output, dropping buffers).
fn summary(t: &Times, total: Duration) -> String {
    let parts = [
        ("setup (adapter, cache, buffers)", t.setup),
        ("attention pipelines", t.pipelines),
        ("prefill", t.prefill),
        ("decode appends", t.append),
        ("decode attention", t.attend),
        ("CPU verification", t.verify),
    ];
    let known: Duration = parts.iter().map(|(_, d)| *d).sum();
    let mut line = format!("time: {:.2} s =", total.as_secs_f64());
    for (name, d) in parts {
        line += &format!(" {name} {:.2} s +", d.as_secs_f64());
    }
    line + &format!(" other {:.2} s", total.saturating_sub(known).as_secs_f64())
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
/// GPU), then attention of all layers runs (timed until it finishes). Without `progress` all layers go
/// in one submission; with it (the prefill) each layer is submitted and waited for, and counted.
fn step(
    run: &mut Run,
    step: usize,
    n: usize,
    progress: Option<Progress>,
) -> kvgpu::Result<(Duration, Duration)> {
    let t0 = Instant::now();
    // Every layer's rows (none for layers without slots), then all of them in one upload.
    let rows: Vec<Vec<(Vec<usize>, Vec<f32>)>> = run
        .cache
        .spec()
        .layers()
        .iter()
        .enumerate()
        .map(|(layer, spec)| {
            let seed = (step as u64) << 20 | (layer as u64) << 4;
            (spec.slots.iter().enumerate())
                .map(|(i, s)| {
                    let shape = [&[n][..], &s.trailing].concat();
                    let data = values(seed + i as u64, shape.iter().product());
                    (shape, data)
                })
                .collect()
        })
        .collect();
    let slabs: Vec<Vec<HostSlab>> = (rows.iter())
        .map(|slots| slots.iter().map(|(sh, d)| HostSlab::f32(d, sh)).collect())
        .collect();
    let lists: Vec<&[HostSlab]> = slabs.iter().map(Vec::as_slice).collect();
    run.cache.append_layers(&lists)?;
    wait(&run.gpu)?;
    let t1 = Instant::now();

    let encoder = |gpu: &Gpu| {
        gpu.device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                label: Some("decode step"),
            })
    };
    let mut e = encoder(&run.gpu);
    let h = run.n_heads;
    for (done, l) in run.layers.iter_mut().enumerate() {
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
                &mut e,
                &run.cache,
                l.index,
                Queries::new(&l.q[0], n, h, d_k),
                &l.out,
                &run.options,
            )?,
            Kind::Mla { r, p } => run.attention.record_mla(
                &mut e,
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
        if let Some(progress) = &progress {
            let full = std::mem::replace(&mut e, encoder(&run.gpu));
            run.gpu.queue.submit([full.finish()]);
            wait(&run.gpu)?;
            progress.update(done + 1);
        }
    }
    run.gpu.queue.submit([e.finish()]);
    wait(&run.gpu)?;
    if let Some(progress) = progress {
        progress.finish();
    }
    Ok((t1 - t0, t1.elapsed()))
}

/// Compares this step's outputs of every attention layer with the CPU twins over the rows the cache
/// stores; returns the largest absolute error and whether every output is within the tolerance.
fn verify(run: &Run, n_q: usize, progress: Option<Progress>) -> kvgpu::Result<(f32, bool)> {
    let (mut worst, mut good) = (0f32, true);
    let h = run.n_heads;
    for (done, l) in run.layers.iter().enumerate() {
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
        let (err, within) = check::compare(&got, &want);
        worst = worst.max(err);
        good &= within;
        if let Some(progress) = &progress {
            progress.update(done + 1);
        }
    }
    if let Some(progress) = progress {
        progress.finish();
    }
    Ok((worst, good))
}

fn read_buffer(gpu: &Gpu, buffer: &wgpu::Buffer, n: usize) -> kvgpu::Result<Vec<f32>> {
    let bytes = kvgpu::read_buffer(&gpu.device, &gpu.queue, buffer, 0, (n * 4) as u64)?;
    Ok(bytemuck::pod_collect_to_vec(&bytes))
}

/// Progress on stderr with a rate and an ETA: a bar redrawn in place on a terminal; otherwise a line at
/// each quarter of a long run, and nothing for a short one.
struct Progress {
    label: String,
    total: usize,
    unit: &'static str,
    start: Instant,
    tty: bool,
}

impl Progress {
    fn new(label: &str, total: usize, unit: &'static str) -> Self {
        Self {
            label: label.into(),
            total,
            unit,
            start: Instant::now(),
            tty: std::io::stderr().is_terminal(),
        }
    }

    fn update(&self, done: usize) {
        let elapsed = self.start.elapsed().as_secs_f64();
        let rate = done as f64 / elapsed.max(1e-9);
        let eta = self.total.saturating_sub(done) as f64 / rate;
        let (label, total, unit) = (&self.label, self.total, self.unit);
        let status = format!("{done}/{total} {unit}, {rate:.1} {unit}/s, ETA {eta:.0} s");
        let mut err = std::io::stderr();
        if self.tty {
            let filled = done * 30 / total.max(1);
            let _ = write!(
                err,
                "\r{label}: [{}{}] {status} ",
                "#".repeat(filled),
                "-".repeat(30 - filled),
            );
        } else if total >= 8 && done < total && done.is_multiple_of(total / 4) {
            let _ = writeln!(err, "{label}: {status}");
        }
    }

    /// Ends the bar's line on a terminal; elsewhere says the total time.
    fn finish(&self) {
        let secs = self.start.elapsed().as_secs_f64();
        let mut err = std::io::stderr();
        if self.tty {
            let _ = writeln!(err);
        } else {
            let _ = writeln!(
                err,
                "{}: {} {} in {secs:.1} s",
                self.label, self.total, self.unit
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::error::ErrorKind;
    use clap::{CommandFactory, ValueEnum};

    use super::*;

    fn parse(args: &[&str]) -> Result<Args, clap::Error> {
        Args::try_parse_from(std::iter::once("decode").chain(args.iter().copied()))
    }

    /// The message clap would print for a refused command line.
    fn refusal(args: &[&str]) -> (ErrorKind, String) {
        let e = parse(args).expect_err("refused");
        (e.kind(), e.to_string())
    }

    #[test]
    fn command_is_well_formed() {
        Args::command().debug_assert();
    }

    #[test]
    fn defaults() {
        let a = parse(&[]).unwrap();
        assert_eq!(
            (a.model, a.tokens, a.prompt, a.dtype),
            (Model::Llama3_8b, 64, 64, Storage::F16)
        );
    }

    #[test]
    fn help_states_purpose_every_flag_default_and_bound() {
        let (kind, help) = refusal(&["--help"]);
        assert_eq!(kind, ErrorKind::DisplayHelp);
        for want in [
            "Simulates LLM decoding",
            "not a model's throughput",
            "--model <MODEL>",
            "[default: llama3-8b]",
            "--tokens <TOKENS>",
            &format!("1 to {MAX_TOKENS}"),
            "--prompt <PROMPT>",
            &format!("1 to {MAX_PROMPT}"),
            "[default: 64]",
            "--dtype <DTYPE>",
            "[default: f16]",
            "qwen3-0.6b",
            "deepseek-v2-lite",
            "hybrid",
            "bf16",
            "verified:",
        ] {
            assert!(help.contains(want), "--help lacks {want:?}:\n{help}");
        }
        assert_eq!(help.matches("[default: 64]").count(), 2, "{help}");
    }

    #[test]
    fn equals_and_space_forms_agree() {
        for model in Model::value_variants() {
            let name = model.name();
            let a = parse(&[&format!("--model={name}"), "--tokens=3", "--dtype=bf16"]).unwrap();
            let b = parse(&["--model", name, "--tokens", "3", "--dtype", "bf16"]).unwrap();
            assert_eq!((a.model, a.tokens, a.dtype), (*model, 3, Storage::Bf16));
            assert_eq!((b.model, b.tokens, b.dtype), (*model, 3, Storage::Bf16));
        }
        assert_eq!(parse(&["--prompt=1"]).unwrap().prompt, 1);
        assert_eq!(parse(&["--prompt", "4096"]).unwrap().prompt, MAX_PROMPT);
        assert_eq!(parse(&["--tokens", "4096"]).unwrap().tokens, MAX_TOKENS);
    }

    #[test]
    fn counts_out_of_bounds_are_refused_with_the_bounds() {
        for (flag, value) in [
            ("--tokens", "-5"),
            ("--tokens", "0"),
            ("--tokens", "4097"),
            ("--tokens", "18446744073709551615"),
            ("--tokens", "18446744073709551616"),
            ("--tokens", "1e3"),
            ("--tokens", ""),
            ("--prompt", "0"),
            ("--prompt", "-1"),
            ("--prompt", "4097"),
            ("--prompt", "99999999999999999999999999999999999999999"),
        ] {
            let (kind, msg) = refusal(&[flag, value]);
            assert_eq!(kind, ErrorKind::ValueValidation, "{flag} {value}: {msg}");
            assert!(
                msg.contains("expected a whole number from 1 to 4096"),
                "{flag} {value}: {msg}"
            );
            let (kind, _) = refusal(&[&format!("{flag}={value}")]);
            assert_eq!(kind, ErrorKind::ValueValidation, "{flag}={value}");
        }
    }

    #[test]
    fn unknown_model_lists_the_presets() {
        let (kind, msg) = refusal(&["--model", "gpt2"]);
        assert_eq!(kind, ErrorKind::InvalidValue);
        assert!(
            msg.contains("[possible values: llama3-8b, qwen3-0.6b, deepseek-v2-lite, hybrid]"),
            "{msg}"
        );
    }

    #[test]
    fn unknown_dtype_lists_the_types() {
        let (kind, msg) = refusal(&["--dtype", "f8"]);
        assert_eq!(kind, ErrorKind::InvalidValue);
        assert!(
            msg.contains("[possible values: f32, f16, bf16, q8_0, q4_0, fp8, fp8_e5m2]"),
            "{msg}"
        );
    }

    #[test]
    fn slots_take_their_own_types() {
        let a = parse(&[
            "--dtype",
            "q8_0",
            "--slot-dtype",
            "v=q4_0",
            "--slot-dtype=k=Fp8",
        ])
        .unwrap();
        assert_eq!(
            a.slot_dtype,
            [
                SlotStorage {
                    slot: "v".into(),
                    dtype: Storage::Q4_0
                },
                SlotStorage {
                    slot: "k".into(),
                    dtype: Storage::Fp8
                }
            ]
        );
        let spec = CacheSpec::llama3_8b(a.dtype.into(), 16).unwrap();
        let spec = with_slot_storage(spec, &a.slot_dtype).unwrap();
        assert_eq!(describe_storage(&spec), "q8_0 (k: fp8_e4m3, v: q4_0)");
        for bad in ["v", "v=q2_k", "=f16"] {
            assert!(parse(&["--slot-dtype", bad]).is_err(), "{bad}");
        }
        // A slot the model does not have is refused when the spec is built, by name.
        let e = with_slot_storage(spec, &[slot_storage("k_pe=f16").unwrap()]).unwrap_err();
        assert!(e.to_string().contains("\"k_pe\" (the slots: k, v)"), "{e}");
    }

    #[test]
    fn unknown_flag_and_missing_value_are_refused() {
        assert_eq!(refusal(&["--steps", "3"]).0, ErrorKind::UnknownArgument);
        assert!(parse(&["--tokens"]).is_err());
    }

    #[test]
    fn every_model_is_a_library_preset_at_the_largest_capacity() {
        // The names clap accepts are the ones CacheSpec::preset knows, and the bounds make a valid spec
        // (planning only; no adapter).
        for model in Model::value_variants() {
            let value = model.to_possible_value().unwrap();
            assert_eq!(value.get_name(), model.name());
            for dtype in [
                Storage::F32,
                Storage::F16,
                Storage::Bf16,
                Storage::Q8_0,
                Storage::Q4_0,
                Storage::Fp8,
            ] {
                let spec = CacheSpec::preset(model.name(), dtype.into(), MAX_PROMPT + MAX_TOKENS);
                assert!(spec.is_ok(), "{}: {spec:?}", model.name());
            }
        }
    }
}
