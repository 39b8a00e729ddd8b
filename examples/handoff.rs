//! Hands a prefilled context from one process to another through a snapshot file: `prefill` fills a
//! cache with a long prompt of a real model's shapes and writes its snapshot; `decode`, run later
//! (on this or another backend), restores it and decodes. Both check attention against the CPU
//! twins over rows regenerated on the host, and print the snapshot's size and throughput.
//!
//! ```text
//! cargo run --release --example handoff -- prefill --out /tmp/ctx.kvgpu --prompt 512
//! WGPU_BACKEND=gl cargo run --release --example handoff -- decode --in /tmp/ctx.kvgpu --tokens 16
//! ```
// Native only: it uses the blocking helpers and files.
#![cfg_attr(target_arch = "wasm32", no_main)]
#![cfg(not(target_arch = "wasm32"))]

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use clap::{Parser, Subcommand};
use wgpu::util::DeviceExt;

#[path = "shared/cli.rs"]
mod cli;
use cli::{
    Model, SlotStorage, Storage, count, describe_storage, query_heads, slot_storage,
    with_slot_storage,
};
use kvgpu::{
    Attention, AttentionOptions, CacheSpec, DType, Gpu, HostData, HostSlab, KvCache, MlaQueries,
    Queries, SnapshotHeader, reference,
};

/// Outputs may differ from the f64 CPU reference by this much, scaled by `1 + |reference|`.
const TOLERANCE: f32 = 1e-4;
/// The largest `--prompt` and `--tokens`.
const MAX_PROMPT: usize = 8192;
const MAX_TOKENS: usize = 1024;

/// Moves a prefilled KV cache between processes through a snapshot file: `prefill` fills a cache
/// with a prompt of a real model's cache shapes and writes its snapshot; `decode` restores it (on
/// any backend) and decodes. Both check attention against the CPU twins. No model weights run: the
/// rows are deterministic pseudo-random values that both processes can regenerate.
///
/// The adapter is chosen with WGPU_BACKEND (vulkan, gl, metal, dx12).
#[derive(Parser, Debug)]
#[command(
    name = "handoff",
    allow_negative_numbers = true,
    after_help = "The last line is `verified: <checks> checks, max scaled error <e>`; the exit status \
                  is non-zero on a mismatch or a refused snapshot."
)]
struct Args {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Fill a cache with a prompt, check attention over it, and write its snapshot to a file
    Prefill {
        /// The snapshot file to write
        #[arg(long)]
        out: PathBuf,
        /// Model whose cache shapes and query heads to use
        #[arg(long, value_enum, default_value_t = Model::Llama3_8b)]
        model: Model,
        /// Prompt tokens, 1 to 8192
        #[arg(long, default_value_t = 256, value_parser = |s: &str| count(s, MAX_PROMPT))]
        prompt: usize,
        /// Element type the cache stores
        #[arg(long, value_enum, default_value_t = Storage::F16)]
        dtype: Storage,
        /// A slot stored in its own type, SLOT=TYPE (repeatable), such as v=q4_0
        #[arg(long = "slot-dtype", value_name = "SLOT=TYPE", value_parser = slot_storage)]
        slot_dtype: Vec<SlotStorage>,
    },
    /// Restore a snapshot file into a new cache, check its rows, and decode
    Decode {
        /// The snapshot file to read
        #[arg(long = "in")]
        input: PathBuf,
        /// The model the snapshot was prefilled for (a snapshot of another shape is refused)
        #[arg(long, value_enum, default_value_t = Model::Llama3_8b)]
        model: Model,
        /// Decode steps after the restored prompt, 1 to 1024
        #[arg(long, default_value_t = 16, value_parser = |s: &str| count(s, MAX_TOKENS))]
        tokens: usize,
    },
}

fn main() -> ExitCode {
    // Clap prints --help, or the refused value and what is allowed, and exits before any adapter opens.
    let args = Args::parse();
    let result = match &args.command {
        Command::Prefill {
            out,
            model,
            prompt,
            dtype,
            slot_dtype,
        } => prefill(out, *model, *prompt, (*dtype).into(), slot_dtype),
        Command::Decode {
            input,
            model,
            tokens,
        } => decode(input, *model, *tokens),
    };
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

/// The values of rows `[from, from + n)` of a slot: every row has its own seed, so any process
/// regenerates any rows.
fn rows(layer: usize, slot: usize, from: usize, n: usize, width: usize) -> Vec<f32> {
    (from..from + n)
        .flat_map(|r| reference::pseudo_random((r * 64 + layer * 2 + slot) as u64, width, 1.0))
        .collect()
}

/// Appends rows `[from, from + n)` to every layer with slots and commits them.
fn append(cache: &mut KvCache, from: usize, n: usize) -> kvgpu::Result<()> {
    let spec = cache.spec().clone();
    for (l, layer) in spec.layers().iter().enumerate() {
        if layer.slots.is_empty() {
            continue;
        }
        let shapes: Vec<Vec<usize>> = layer
            .slots
            .iter()
            .map(|s| [&[n][..], &s.trailing].concat())
            .collect();
        let data: Vec<Vec<f32>> = (0..layer.slots.len())
            .map(|s| rows(l, s, from, n, layer.slots[s].row_elems()))
            .collect();
        let slabs: Vec<HostSlab> = data
            .iter()
            .zip(&shapes)
            .map(|(d, sh)| HostSlab::f32(d, sh))
            .collect();
        cache.append(l, &slabs)?;
    }
    cache.advance(n)
}

/// Attention of the newest row of every attention layer, against the twins over the rows
/// regenerated and rounded through the storage type: the layers checked, the largest scaled error,
/// and whether every output is within [`TOLERANCE`].
fn check(gpu: &Gpu, cache: &KvCache, model: Model, step: u64) -> kvgpu::Result<(usize, f32, bool)> {
    let (n_heads, scale) = query_heads(model);
    let options = AttentionOptions {
        scale,
        ..Default::default()
    };
    let mut attention = Attention::for_cache(cache);
    let spec = cache.spec();
    let len = cache.len();
    let stored = |l: usize, s: usize| -> Vec<f32> {
        let width = spec.layers()[l].slots[s].row_elems();
        let slot = &spec.layers()[l].slots[s];
        let dtype = spec.slot_dtype(l, s).expect("a slot of the spec");
        let bits = reference::scaled_host_bits(
            HostData::F32(&rows(l, s, 0, len, width)),
            dtype,
            slot.scale,
        );
        let words = reference::pack_rows(&bits, dtype, width);
        reference::decode_scaled_rows(&words, dtype, width, slot.scale)
    };
    let buffer = |data: &[f32]| {
        gpu.device
            .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: Some("handoff queries"),
                contents: bytemuck::cast_slice(data),
                usage: wgpu::BufferUsages::STORAGE,
            })
    };
    let (mut checked, mut worst, mut ok) = (0, 0f32, true);
    for (l, layer) in spec.layers().iter().enumerate() {
        let [a, b] = &layer.slots[..] else { continue };
        checked += 1;
        let q = reference::pseudo_random(step * 1000 + l as u64, n_heads * a.row_elems(), 1.0);
        let (want, d_out) = if a.trailing.len() == 2 {
            // GQA: K [n_kv, d_k], V [n_kv, d_v].
            let (n_kv, d_k, d_v) = (a.trailing[0], a.trailing[1], b.trailing[1]);
            let want = reference::attention_gqa(
                &q,
                [1, n_heads, d_k],
                &stored(l, 0),
                &stored(l, 1),
                n_kv,
                d_v,
                &options,
            );
            (want, d_v)
        } else {
            // MLA: compressed_kv [r], k_pe [p].
            let (r, p) = (a.row_elems(), b.row_elems());
            let rope = reference::pseudo_random(step * 1000 + 500 + l as u64, n_heads * p, 1.0);
            let want = reference::attention_mla(
                &q,
                &rope,
                [1, n_heads, r],
                &stored(l, 0),
                &stored(l, 1),
                p,
                &options,
            );
            (want, r)
        };
        let out = gpu.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("handoff output"),
            size: (n_heads * d_out * 4) as u64,
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        });
        let qb = buffer(&q);
        if a.trailing.len() == 2 {
            let queries = Queries::new(&qb, 1, n_heads, a.trailing[1]);
            attention.gqa(cache, l, queries, &out, &options)?;
        } else {
            let rope = reference::pseudo_random(
                step * 1000 + 500 + l as u64,
                n_heads * b.row_elems(),
                1.0,
            );
            let rb = buffer(&rope);
            let queries = MlaQueries {
                latent: Queries::new(&qb, 1, n_heads, a.row_elems()),
                rope: Queries::new(&rb, 1, n_heads, b.row_elems()),
            };
            attention.mla(cache, l, queries, &out, &options)?;
        }
        let bytes = kvgpu::read_buffer(&gpu.device, &gpu.queue, &out, 0, out.size())?;
        let got: Vec<f32> = bytemuck::pod_collect_to_vec(&bytes);
        for (g, w) in got.iter().zip(&want) {
            let err = (g - w).abs() / (1.0 + w.abs());
            worst = worst.max(err);
            ok &= err <= TOLERANCE;
        }
        ok &= got.len() == want.len();
    }
    Ok((checked, worst, ok))
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1 << 20) as f64
}

fn prefill(
    out: &Path,
    model: Model,
    prompt: usize,
    dtype: DType,
    slots: &[SlotStorage],
) -> Result<bool> {
    // The spec first: a slot name the model lacks is refused before an adapter opens.
    let spec = with_slot_storage(CacheSpec::preset(model.name(), dtype, prompt)?, slots)?;
    let gpu = Gpu::from_env_blocking()?;
    println!("adapter: {}", gpu.describe());
    let storage = describe_storage(&spec);
    let mut cache = KvCache::new(&gpu.device, &gpu.queue, spec)?;
    let start = Instant::now();
    append(&mut cache, 0, prompt)?;
    let (checks, worst, ok) = check(&gpu, &cache, model, 0)?;
    println!(
        "prefill: {} {storage}, {prompt} tokens in {:.2} s (with the check)",
        model.name(),
        start.elapsed().as_secs_f64()
    );
    let start = Instant::now();
    let mut file = std::io::BufWriter::new(std::fs::File::create(out)?);
    let written = cache.export(&mut file)?;
    drop(file);
    let secs = start.elapsed().as_secs_f64();
    println!(
        "snapshot: {} bytes ({:.2} MiB, {} bytes/token) written to {} in {:.3} s ({:.1} MiB/s)",
        written,
        mib(written),
        cache.spec().bytes_per_token(),
        out.display(),
        secs,
        mib(written) / secs.max(1e-9)
    );
    println!("verified: {checks} checks, max scaled error {worst:.3e}");
    Ok(ok)
}

fn decode(input: &Path, model: Model, tokens: usize) -> Result<bool> {
    let start = Instant::now();
    // The header (the first few KiB) says the storage type and length...
    let mut prefix = Vec::new();
    std::fs::File::open(input)?
        .take(1 << 20)
        .read_to_end(&mut prefix)?;
    let header = SnapshotHeader::parse(&prefix)?;
    let (len, dtype) = (header.len, header.spec.dtype());
    // ...and the cache has the model's own shapes, each slot stored (and scaled) as the snapshot's,
    // with room for the decode: a snapshot of another model is refused as soon as its header arrives.
    let mut layers = CacheSpec::preset(model.name(), dtype, 1)?.layers().to_vec();
    for (l, layer) in layers.iter_mut().enumerate() {
        for (s, slot) in layer.slots.iter_mut().enumerate() {
            slot.dtype = header.spec.slot_dtype(l, s).ok();
            slot.scale = header.spec.slot_scale(l, s).ok().flatten();
        }
    }
    let spec = CacheSpec::new(layers, dtype, len + tokens)?;
    // A missing file, or a snapshot of another model, is refused before an adapter opens.
    header.check_compatible(&spec)?;
    let gpu = Gpu::from_env_blocking()?;
    println!("adapter: {}", gpu.describe());
    let storage = describe_storage(&spec);
    let mut cache = KvCache::new(&gpu.device, &gpu.queue, spec)?;
    // Streamed from the file in pieces, checked as they arrive, committed once the checksum holds.
    cache.import_from(std::fs::File::open(input)?)?;
    gpu.device.poll(wgpu::PollType::wait_indefinitely())?;
    let secs = start.elapsed().as_secs_f64();
    let size = header.total_bytes();
    println!(
        "restore: {size} bytes ({:.2} MiB), {len} tokens of {} {storage} streamed and uploaded in \
         {:.3} s ({:.1} MiB/s)",
        mib(size),
        model.name(),
        secs,
        mib(size) / secs.max(1e-9)
    );
    // Every restored row, bit for bit, against the rows regenerated on the host.
    let mut ok = true;
    for (l, layer) in cache.spec().layers().iter().enumerate() {
        for (s, slot) in layer.slots.iter().enumerate() {
            let dtype = cache.spec().slot_dtype(l, s)?;
            let data = rows(l, s, 0, len, slot.row_elems());
            let bits = reference::scaled_host_bits(HostData::F32(&data), dtype, slot.scale);
            ok &= cache.read_words(l, s)? == reference::pack_rows(&bits, dtype, slot.row_elems());
        }
    }
    println!(
        "restored rows: {}",
        if ok { "identical" } else { "MISMATCH" }
    );
    let (mut worst, mut checks) = (0f32, 0);
    let start = Instant::now();
    for step in 1..=tokens {
        append(&mut cache, len + step - 1, 1)?;
        let (n, w, good) = check(&gpu, &cache, model, step as u64)?;
        worst = worst.max(w);
        ok &= good;
        checks += n;
    }
    println!(
        "decode: {tokens} tokens in {:.2} s (with the checks)",
        start.elapsed().as_secs_f64()
    );
    println!("verified: {checks} checks, max scaled error {worst:.3e}");
    Ok(ok)
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;
    use clap::error::ErrorKind;

    use super::*;

    fn parse(args: &[&str]) -> std::result::Result<Args, clap::Error> {
        Args::try_parse_from(std::iter::once("handoff").chain(args.iter().copied()))
    }

    #[test]
    fn command_is_well_formed() {
        Args::command().debug_assert();
    }

    #[test]
    fn defaults_and_both_value_forms() {
        let a = parse(&["prefill", "--out", "x.kvgpu"]).unwrap();
        match a.command {
            Command::Prefill {
                out,
                model,
                prompt,
                dtype,
                slot_dtype,
            } => {
                assert_eq!(out, PathBuf::from("x.kvgpu"));
                assert!(slot_dtype.is_empty());
                assert_eq!(
                    (model, prompt, dtype),
                    (Model::Llama3_8b, 256, Storage::F16)
                );
            }
            c => panic!("{c:?}"),
        }
        let a = parse(&["decode", "--in=x", "--tokens=3", "--model", "hybrid"]).unwrap();
        match a.command {
            Command::Decode {
                input,
                model,
                tokens,
            } => assert_eq!(
                (input, model, tokens),
                (PathBuf::from("x"), Model::Hybrid, 3)
            ),
            c => panic!("{c:?}"),
        }
    }

    #[test]
    fn help_is_printed_instead_of_running() {
        let e = parse(&["--help"]).expect_err("help");
        assert_eq!(e.kind(), ErrorKind::DisplayHelp);
        let help = e.to_string();
        for want in [
            "snapshot file",
            "prefill",
            "decode",
            "verified: <checks> checks",
        ] {
            assert!(help.contains(want), "--help lacks {want:?}:\n{help}");
        }
        let e = parse(&["prefill", "--help"]).expect_err("help");
        for want in [
            "--out <OUT>",
            "--prompt <PROMPT>",
            "[default: 256]",
            "1 to 8192",
        ] {
            assert!(
                e.to_string().contains(want),
                "prefill --help lacks {want:?}:\n{e}"
            );
        }
        let e = parse(&["decode", "--help"]).expect_err("help");
        for want in [
            "--in <INPUT>",
            "--tokens <TOKENS>",
            "[default: 16]",
            "1 to 1024",
        ] {
            assert!(
                e.to_string().contains(want),
                "decode --help lacks {want:?}:\n{e}"
            );
        }
    }

    #[test]
    fn bad_command_lines_are_refused() {
        for (args, kind) in [
            (&["prefill"][..], ErrorKind::MissingRequiredArgument),
            (&["decode"][..], ErrorKind::MissingRequiredArgument),
            (
                &["prefill", "--out", "x", "--prompt", "0"][..],
                ErrorKind::ValueValidation,
            ),
            (
                &["decode", "--in", "x", "--tokens", "1025"][..],
                ErrorKind::ValueValidation,
            ),
            (
                &["prefill", "--out", "x", "--dtype", "f64"][..],
                ErrorKind::InvalidValue,
            ),
            (&[][..], ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand),
            (&["serve"][..], ErrorKind::InvalidSubcommand),
        ] {
            assert_eq!(parse(args).expect_err("refused").kind(), kind, "{args:?}");
        }
    }

    /// Both halves in one test process, through a file in the temporary directory: the snapshot (of
    /// a cache whose rope key has its own type) restores and decodes, and a snapshot of another model
    /// is refused.
    #[test]
    fn prefill_then_decode_through_a_file() {
        let file = std::env::temp_dir().join(format!("kvgpu-handoff-{}.kvgpu", std::process::id()));
        let k_pe = [cli::slot_storage("k_pe=fp8").unwrap()];
        assert!(prefill(&file, Model::DeepseekV2Lite, 9, DType::BF16, &k_pe).unwrap());
        assert!(decode(&file, Model::DeepseekV2Lite, 2).unwrap());
        let e = decode(&file, Model::Hybrid, 1).unwrap_err();
        assert!(e.to_string().contains("snapshot"), "{e}");
        std::fs::remove_file(&file).unwrap();
    }
}
