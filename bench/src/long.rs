//! Decode attention at GPU-scale contexts (32k, 64k and 128k rows; 32k alone in quick mode) against
//! the device-to-device copy bandwidth measured side by side: #9's goal for real GPUs (GQA at least
//! 0.8 of it), where a 4k layer would sit in the processor's L2 cache and say nothing about memory.
//! The copy moves the same bytes the call reads (up to the device's largest buffer) and counts them
//! twice, read and written, as `torch_anchor.py` does for PyTorch on the same GPU. A context whose
//! layer does not fit the device's bindings is skipped, with the reason.

use anyhow::Result;
use kvgpu::{Attention, AttentionOptions, CacheSpec, DType, Gpu, KvCache};

use crate::Config;
use crate::attn::{Inputs, Kind, Shape, fill, kernel_choice};
use crate::report::{Goal, Row};
use crate::timing::{Timer, interleaved};

/// The largest copy of the reference, so that the long part's three buffers stay within a GPU's
/// memory beside the cache.
const MOST_COPY: u64 = 1 << 30;

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
                        eprintln!("  {} {dtype} ctx {ctx}: skipped: {e}", shape.label);
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
    Ok(())
}

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
    let (ctx, dtype) = (cache.len(), cache.spec().dtype());
    let bytes = ctx as u64 * cache.spec().bytes_per_token();
    let moved = bytes.min(MOST_COPY.min(gpu.device.limits().max_buffer_size)) & !3;
    let buffer = |label| {
        gpu.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size: moved,
            usage: wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        })
    };
    let (from, to) = (
        buffer("bench copy source"),
        buffer("bench copy destination"),
    );
    let inputs = Inputs::new(gpu, shape, 1);
    let mut attn = Attention::for_cache(cache);
    attn.set_kernel(kernel_choice()?);
    let opts = AttentionOptions::default();
    let mut kernel = || -> Result<f64> {
        let mut res = Ok(());
        let t =
            timer.gpu(|enc| res = inputs.record(kind, shape, &mut attn, cache, enc, 1, &opts))?;
        res.map(|_| t)
    };
    let mut copy = || timer.gpu(|enc| enc.copy_buffer_to_buffer(&from, 0, &to, 0, moved));
    let (warm, reps) = (cfg.warm.min(2), cfg.reps.min(9));
    let [tk, tc] = interleaved(warm, reps, [&mut kernel, &mut copy])?;
    let read = bytes as f64 / tk / 1e9;
    let copied = 2.0 * moved as f64 / tc / 1e9;
    let label = shape.label;
    rows.push(
        Row::new(
            format!("{label} attention {dtype}, ctx {ctx}: KV bandwidth"),
            read,
            "GB/s",
            timer.clock(),
        )
        .ratio(
            read / copied,
            format!(
                "device-to-device copy of {} MiB, read + write ({copied:.1} GB/s); the call took {:.1} us",
                moved >> 20,
                tk * 1e6
            ),
            goal,
        ),
    );
    eprintln!(
        "  {label} {dtype} ctx {ctx}: kernel {:.1} us ({read:.2} GB/s), copy {copied:.2} GB/s",
        tk * 1e6
    );
    Ok(())
}
