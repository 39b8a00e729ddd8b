//! Fills a DeepSeek-V2-Lite MLA cache and a Llama-3-8B GQA cache on the default adapter, from the host
//! and from GPU buffers (K/V taken straight out of a fused QKV output), then checks every slot against
//! the plain-Rust model.
//!
//! `cargo run --release --example fill -- --help` lists the flags and their defaults.

// Native only: it uses the blocking helpers. The browser demo is examples/web.
#![cfg_attr(target_arch = "wasm32", no_main)]
#![cfg(not(target_arch = "wasm32"))]

use std::process::ExitCode;

use clap::Parser;
use kvgpu::reference::{self, CpuCache};
use kvgpu::{CacheSpec, DType, Gpu, GpuSlab, HostSlab, KvCache};
use wgpu::util::DeviceExt;

/// Deterministic pseudo-random values in [-1, 1).
fn values(seed: u64, n: usize) -> Vec<f32> {
    kvgpu::reference::pseudo_random(seed, n, 1.0)
}

/// The largest `--prompt` and `--steps`.
const MAX_TOKENS: usize = 1024;

/// A count from `min` to `max`; anything else (negative, too large, not a number) is refused with the
/// bounds, never wrapped.
fn count(s: &str, min: usize, max: usize) -> Result<usize, String> {
    match s.trim().parse::<i128>() {
        Ok(n) if n >= min as i128 && n <= max as i128 => Ok(n as usize),
        _ => Err(format!("expected a whole number from {min} to {max}")),
    }
}

/// Fills two KV caches on the default GPU adapter and checks every slot against the plain-Rust model:
/// a DeepSeek-V2-Lite MLA cache (bf16) from host appends, and a Llama-3-8B GQA cache (f16) whose K and
/// V are copied and converted on the GPU straight out of a fused QKV projection buffer. Each gets a
/// prompt, then single-token decode steps; the caches hold exactly that many tokens.
///
/// The adapter is chosen with WGPU_BACKEND (vulkan, gl, metal, dx12).
#[derive(Parser, Debug)]
#[command(
    name = "fill",
    allow_negative_numbers = true,
    after_help = "The last line is `verified: all slots match the CPU model` (exit status 0) or \
                  `verified: MISMATCH` (exit status 1)."
)]
struct Args {
    /// Prompt tokens appended in one go, 1 to 1024
    #[arg(long, default_value_t = 48, value_parser = |s: &str| count(s, 1, MAX_TOKENS))]
    prompt: usize,
    /// Single-token appends after the prompt, 0 to 1024
    #[arg(long, default_value_t = 16, value_parser = |s: &str| count(s, 0, MAX_TOKENS))]
    steps: usize,
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

fn run(args: &Args) -> kvgpu::Result<bool> {
    let gpu = Gpu::from_env_blocking()?;
    println!("adapter: {}", gpu.describe());
    let (prompt, steps) = (args.prompt, args.steps);
    let capacity = prompt + steps;
    let mut ok = true;

    // MLA: host appends, prompt then decode steps.
    let spec = CacheSpec::deepseek_v2_lite(DType::BF16, capacity)?;
    let mut mla = KvCache::new(&gpu.device, &gpu.queue, spec.clone())?;
    let mut model = CpuCache::new(&spec);
    for (step, n) in std::iter::once(prompt)
        .chain(std::iter::repeat_n(1, steps))
        .enumerate()
    {
        for layer in 0..spec.n_layers() {
            let at = mla.visible(layer)?;
            let (ckv, kpe) = (
                values((step * 100 + layer) as u64, n * 512),
                values((step * 100 + layer) as u64 + 7, n * 64),
            );
            mla.append(
                layer,
                &[
                    HostSlab::f32(&ckv, &[n, 512]),
                    HostSlab::f32(&kpe, &[n, 64]),
                ],
            )?;
            for (slot, d) in [ckv, kpe].iter().enumerate() {
                let bits: Vec<u32> = d
                    .iter()
                    .map(|&x| reference::f32_to_bits(x, spec.dtype()))
                    .collect();
                model.write_rows(layer, slot, at, &bits);
            }
        }
        mla.advance(n)?;
    }
    ok &= report("deepseek-v2-lite (MLA, bf16, host appends)", &mla, &model)?;

    // GQA: K and V copied and converted on the GPU out of a fused QKV projection [n, q_dim + 2·kv_dim] f32.
    let spec = CacheSpec::llama3_8b(DType::F16, capacity)?;
    let mut gqa = KvCache::new(&gpu.device, &gpu.queue, spec.clone())?;
    let mut model = CpuCache::new(&spec);
    let (q_dim, kv_dim) = (32 * 128, 8 * 128);
    let width = q_dim + 2 * kv_dim;
    for (step, n) in std::iter::once(prompt)
        .chain(std::iter::repeat_n(1, steps))
        .enumerate()
    {
        let qkv: Vec<f32> = values(step as u64 + 1000, n * width);
        let buffer = gpu
            .device
            .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: Some("fused qkv"),
                contents: bytemuck::cast_slice(&qkv),
                usage: wgpu::BufferUsages::STORAGE,
            });
        let bits: Vec<u32> = qkv.iter().map(|x| x.to_bits()).collect();
        let (shape, strides) = ([n, 8, 128], [width, 128, 1]);
        let mut encoder = gpu.device.create_command_encoder(&Default::default());
        for layer in 0..spec.n_layers() {
            let at = gqa.visible(layer)?;
            let k = GpuSlab {
                buffer: &buffer,
                dtype: DType::F32,
                offset: q_dim as u64,
                shape: &shape,
                strides: Some(&strides),
            };
            let v = GpuSlab {
                offset: (q_dim + kv_dim) as u64,
                ..k
            };
            gqa.record_append_gpu(&mut encoder, layer, &[k, v])?;
            for (slot, offset) in [q_dim, q_dim + kv_dim].into_iter().enumerate() {
                let rows = reference::slab_write(
                    &bits,
                    DType::F32,
                    offset,
                    &shape,
                    &strides,
                    spec.dtype(),
                );
                let at_word = at * model.row_words(layer, slot);
                model.words[layer][slot][at_word..at_word + rows.len()].copy_from_slice(&rows);
            }
        }
        gpu.queue.submit([encoder.finish()]);
        gqa.advance(n)?;
    }
    ok &= report("llama3-8b (GQA, f16, fused-QKV GPU appends)", &gqa, &model)?;
    println!(
        "verified: {}",
        if ok {
            "all slots match the CPU model"
        } else {
            "MISMATCH"
        }
    );
    Ok(ok)
}

/// Prints the cache's accounting and compares every slot with the model.
fn report(name: &str, cache: &KvCache, model: &CpuCache) -> kvgpu::Result<bool> {
    let spec = cache.spec();
    let mut mismatched = 0;
    for layer in 0..spec.n_layers() {
        for slot in 0..spec.layers()[layer].slots.len() {
            if cache.read_full_words(layer, slot)? != model.words[layer][slot] {
                mismatched += 1;
            }
        }
    }
    println!(
        "{name}: {} layers, {} rows, {} bytes/token, {:.1} MiB of rows, {} slots mismatched",
        spec.n_layers(),
        cache.len(),
        spec.bytes_per_token(),
        spec.total_bytes() as f64 / (1 << 20) as f64,
        mismatched
    );
    Ok(mismatched == 0)
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;
    use clap::error::ErrorKind;

    use super::*;

    fn parse(args: &[&str]) -> Result<Args, clap::Error> {
        Args::try_parse_from(std::iter::once("fill").chain(args.iter().copied()))
    }

    #[test]
    fn command_is_well_formed() {
        Args::command().debug_assert();
    }

    #[test]
    fn defaults_and_both_value_forms() {
        let a = parse(&[]).unwrap();
        assert_eq!((a.prompt, a.steps), (48, 16));
        let a = parse(&["--prompt=3", "--steps", "0"]).unwrap();
        assert_eq!((a.prompt, a.steps), (3, 0));
        let a = parse(&["--prompt", "1024", "--steps=1024"]).unwrap();
        assert_eq!((a.prompt, a.steps), (MAX_TOKENS, MAX_TOKENS));
    }

    #[test]
    fn help_is_printed_instead_of_running() {
        // `fill --help` is a DisplayHelp "error": clap prints it and exits 0 before run() opens an adapter.
        let e = parse(&["--help"]).expect_err("help");
        assert_eq!(e.kind(), ErrorKind::DisplayHelp);
        let help = e.to_string();
        for want in [
            "Fills two KV caches",
            "--prompt <PROMPT>",
            "[default: 48]",
            &format!("1 to {MAX_TOKENS}"),
            "--steps <STEPS>",
            "[default: 16]",
            &format!("0 to {MAX_TOKENS}"),
            "verified: all slots match the CPU model",
        ] {
            assert!(help.contains(want), "--help lacks {want:?}:\n{help}");
        }
        assert_eq!(parse(&["-h"]).unwrap_err().kind(), ErrorKind::DisplayHelp);
    }

    #[test]
    fn out_of_bounds_counts_are_refused_with_the_bounds() {
        for (args, bounds) in [
            (["--prompt", "0"], "from 1 to 1024"),
            (["--prompt", "-5"], "from 1 to 1024"),
            (["--prompt", "1025"], "from 1 to 1024"),
            (["--steps", "-1"], "from 0 to 1024"),
            (["--steps", "18446744073709551615"], "from 0 to 1024"),
            (["--steps", "ten"], "from 0 to 1024"),
        ] {
            let e = parse(&args).expect_err("refused");
            assert_eq!(e.kind(), ErrorKind::ValueValidation, "{args:?}");
            assert!(e.to_string().contains(bounds), "{args:?}: {e}");
        }
        assert_eq!(
            parse(&["--model", "llama3-8b"]).unwrap_err().kind(),
            ErrorKind::UnknownArgument
        );
    }
}
