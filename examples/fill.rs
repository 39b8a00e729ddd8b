//! Fills a DeepSeek-V2-Lite MLA cache and a Llama-3-8B GQA cache on the default adapter, from the host
//! and from GPU buffers (K/V taken straight out of a fused QKV output), then checks every slot against
//! the plain-Rust model.
//!
//! `cargo run --release --example fill`

// Native only: it uses the blocking helpers. The browser demo is examples/web.
#![cfg_attr(target_arch = "wasm32", no_main)]
#![cfg(not(target_arch = "wasm32"))]

use std::process::ExitCode;

use kvgpu::reference::{self, CpuCache};
use kvgpu::{CacheSpec, DType, Gpu, GpuSlab, HostSlab, KvCache};
use wgpu::util::DeviceExt;

/// Deterministic pseudo-random values in [-1, 1).
fn values(seed: u64, n: usize) -> Vec<f32> {
    kvgpu::reference::pseudo_random(seed, n, 1.0)
}

fn main() -> ExitCode {
    match run() {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> kvgpu::Result<bool> {
    let gpu = Gpu::from_env_blocking()?;
    println!("adapter: {}", gpu.describe());
    let (prompt, steps) = (48, 16);
    let mut ok = true;

    // MLA: host appends, prompt then decode steps.
    let spec = CacheSpec::deepseek_v2_lite(DType::BF16, 256)?;
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
    let spec = CacheSpec::llama3_8b(DType::F16, 256)?;
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
        "{name}: {} layers, {} rows, {} bytes/token, {:.1} MiB allocated, {} slots mismatched",
        spec.n_layers(),
        cache.len(),
        spec.bytes_per_token(),
        spec.total_bytes() as f64 / (1 << 20) as f64,
        mismatched
    );
    Ok(mismatched == 0)
}
