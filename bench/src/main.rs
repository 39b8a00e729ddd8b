//! kvgpu benchmarks: every figure is a ratio to a reference measured in the same run on the same
//! adapter. `--quick` takes about a minute and a half on a software adapter (longer the first time,
//! while the driver compiles its shaders); the default is the full run.
//!
//! Writes `bench-results.json` and `bench-plot.svg` (override with `--json PATH` / `--plot PATH`).
//! `--plot-from JSON` redraws the plot from a recorded run without measuring (or opening an adapter).

mod attn;
mod decode;
mod long;
mod paged;
mod plot;
mod quant;
mod recorded;
mod refs;
mod report;
mod slab;
mod snapshot;
mod timing;

use anyhow::{Context, Result, bail};
use serde_json::json;

use crate::refs::StreamRead;
use crate::timing::Timer;

/// Sizes and repetitions of one run.
pub struct Config {
    pub quick: bool,
    pub warm: usize,
    /// Repetitions of the cheap measurements (decode steps).
    pub step_reps: usize,
    /// Repetitions of kernel measurements.
    pub reps: usize,
    /// Repetitions of the expensive ones (prefix-copy steps, whole-cache resets).
    pub slow_reps: usize,
    /// Contexts of the decode-step plot and the peer ratios.
    pub contexts: Vec<usize>,
    pub attn_contexts: Vec<usize>,
    /// Tokens per GPU slab write.
    pub slab_tokens: usize,
}

impl Config {
    fn new(quick: bool) -> Self {
        if quick {
            Self {
                quick,
                warm: 3,
                step_reps: 40,
                reps: 7,
                slow_reps: 3,
                contexts: vec![16, 1024, 4000],
                attn_contexts: vec![512, 4096],
                slab_tokens: 1024,
            }
        } else {
            Self {
                quick,
                warm: 5,
                step_reps: 200,
                reps: 15,
                slow_reps: 5,
                contexts: vec![16, 128, 512, 1024, 2048, 4000, 8000],
                attn_contexts: vec![512, 1024, 2048, 4096, 8192, 16384],
                slab_tokens: 4096,
            }
        }
    }
}

/// The parts `--only` can name.
const PARTS: [&str; 7] = [
    "slab",
    "decode",
    "attention",
    "long",
    "paged",
    "snapshot",
    "quant",
];

fn main() -> Result<()> {
    let mut quick = false;
    let mut json_path = "bench-results.json".to_string();
    let mut plot_path = "bench-plot.svg".to_string();
    let mut only: Option<String> = None;
    let mut plot_from: Option<String> = None;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--quick" => quick = true,
            "--json" => json_path = args.next().context("--json needs a path")?,
            "--plot" => plot_path = args.next().context("--plot needs a path")?,
            "--plot-from" => {
                plot_from = Some(args.next().context("--plot-from needs a JSON path")?)
            }
            "--only" => {
                let part = args.next().unwrap_or_default();
                if !PARTS.contains(&part.as_str()) {
                    bail!("--only needs one of {}, not {part:?}", PARTS.join(", "));
                }
                only = Some(part)
            }
            "-h" | "--help" => {
                println!(
                    "kvgpu-bench [--quick] [--json PATH] [--plot PATH] [--only slab|decode|attention|long|paged|snapshot|quant]\n  \
                     adapter from WGPU_BACKEND / WGPU_ADAPTER_NAME; the long part (32k-128k contexts, 32k\n  \
                     alone with --quick) runs without --only on GPUs only, and on any adapter with --only long\n\
                     kvgpu-bench --plot-from JSON [--plot PATH]\n  \
                     redraws the plot from a recorded run (a JSON written by --json) without measuring"
                );
                return Ok(());
            }
            other => bail!("unknown argument {other:?} (try --help)"),
        }
    }
    if let Some(json) = plot_from {
        let run = recorded::load(&json)?;
        plot::write(&plot_path, &run.title, &run.steps, &run.attention)?;
        eprintln!("wrote {plot_path} from {json}");
        return Ok(());
    }
    let cfg = Config::new(quick);
    let started = std::time::Instant::now();
    let gpu = kvgpu::Gpu::from_env_blocking().context("opening the adapter")?;
    let info = gpu.adapter.get_info();
    let timer = Timer::new(&gpu.device, &gpu.queue);
    eprintln!(
        "adapter: {} ({:?}); GPU work timed with {}; {} mode",
        info.name,
        info.backend,
        timer.clock().name(),
        if quick { "quick" } else { "full" }
    );
    let mut rows = Vec::new();
    let mut steps = Vec::new();
    let mut attention = Vec::new();
    let max_attn_bytes = *cfg.attn_contexts.iter().max().unwrap_or(&512) as u64 * 2 * 8 * 128 * 4;
    let roof = StreamRead::new(&gpu.device, &gpu.queue, max_attn_bytes.max(64 << 20));

    let wanted = |name: &str| only.as_deref().is_none_or(|o| o == name);
    if wanted("slab") {
        eprintln!("[1/8] slab writes and references");
        slab::run(&gpu, &timer, &cfg, &mut rows, &roof)?;
    }
    if wanted("decode") {
        eprintln!("[2/8] decode append steps, peers, reset");
        decode::run(&gpu, &timer, &cfg, &mut rows, &mut steps)?;
    }
    if wanted("attention") {
        eprintln!("[3/8] attention");
        attn::run(&gpu, &timer, &cfg, &mut rows, &mut attention, &roof)?;
    }
    drop(roof);
    // GPU-scale contexts: a 128k layer is 1 GiB of f32 KV, more than a software adapter's bindings
    // hold, and minutes of lavapipe's time for what fits.
    let on_gpu = info.device_type != wgpu::DeviceType::Cpu;
    if only.as_deref() == Some("long") || (only.is_none() && on_gpu) {
        eprintln!("[4/8] attention at 32k-128k contexts against the device-to-device copy");
        long::run(&gpu, &timer, &cfg, &mut rows)?;
    } else if only.is_none() {
        eprintln!(
            "[4/8] attention at 32k-128k contexts: skipped on a CPU adapter (--only long runs it)"
        );
    }
    if wanted("paged") {
        eprintln!("[5/8] the paged pool: batched decode, scattered append step, fork");
        paged::run(&gpu, &timer, &cfg, &mut rows)?;
    }

    if wanted("snapshot") {
        eprintln!("[6/8] snapshots: export and import against plain readback and upload");
        snapshot::run(&gpu, &timer, &cfg, &mut rows)?;
    }

    if wanted("quant") {
        eprintln!("[7/8] quantized storage: bytes, accuracy, attention and appends against f16");
        quant::run(&gpu, &timer, &cfg, &mut rows)?;
    }

    eprintln!("[8/8] report");
    let title = format!("kvgpu on {} ({:?})", info.name, info.backend);
    plot::write(&plot_path, &title, &steps, &attention)?;
    let table = report::table(&rows);
    println!("{table}");
    let doc = json!({
        "adapter": info.name,
        "backend": format!("{:?}", info.backend),
        "driver": format!("{} {}", info.driver, info.driver_info),
        "gpu_timing": timer.clock().name(),
        "mode": if quick { "quick" } else { "full" },
        // What the attention and long parts were told to measure (the default choice when unset).
        "kernel": std::env::var("KVGPU_BENCH_KERNEL").ok(),
        "workgroups": std::env::var("KVGPU_BENCH_WORKGROUPS").ok(),
        "seconds": started.elapsed().as_secs_f64(),
        "results": rows.iter().map(report::Row::json).collect::<Vec<_>>(),
        "series": recorded::series_json(&steps, &attention),
    });
    std::fs::write(&json_path, serde_json::to_string_pretty(&doc)?)
        .with_context(|| format!("writing {json_path}"))?;
    eprintln!(
        "wrote {json_path} and {plot_path} in {:.0} s",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}
