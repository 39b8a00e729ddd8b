//! GPU → GPU slab writes against the adapter's own copies, and the reference bandwidths of the run:
//! `copy_buffer_to_buffer`, the streaming-read roofline, host memcpy.

use anyhow::Result;
use kvgpu::{CacheSpec, DType, Gpu, GpuSlab, KvCache, LayerSpec, SlotSpec};

use crate::Config;
use crate::refs::{BoundKernel, StreamRead, storage};
use crate::report::{Goal, Row};
use crate::timing::{Timer, interleaved};

const KV_HEADS: usize = 8;
const HEAD_DIM: usize = 128;
const KV: usize = KV_HEADS * HEAD_DIM;
/// Llama-3-8B fused QKV output row: 32 query heads, then K and V of 8 heads, 128 dims each.
const Q_DIM: usize = 32 * HEAD_DIM;
const QKV: usize = Q_DIM + 2 * KV;

fn k_cache(gpu: &Gpu, rows: usize) -> Result<KvCache> {
    let spec = CacheSpec::new(
        vec![LayerSpec::new(vec![SlotSpec::new(
            "k",
            &[KV_HEADS, HEAD_DIM],
        )])],
        DType::F16,
        rows,
    )?;
    Ok(KvCache::new(&gpu.device, &gpu.queue, spec)?)
}

pub fn run(
    gpu: &Gpu,
    timer: &Timer,
    cfg: &Config,
    rows: &mut Vec<Row>,
    roof: &StreamRead,
) -> Result<()> {
    let n = cfg.slab_tokens;
    let dst_bytes = (n * KV * 2) as u64;
    let gbs = |bytes: u64, t: f64| bytes as f64 / t / 1e9;

    // Contiguous f16 source: kvgpu takes copy_buffer_to_buffer itself.
    let mut cache = k_cache(gpu, n)?;
    let src = storage(&gpu.device, dst_bytes, "bench f16 source");
    let plain = storage(&gpu.device, dst_bytes, "bench copy destination");
    let shape = [n, KV_HEADS, HEAD_DIM];
    let slab = GpuSlab::contiguous(&src, DType::F16, &shape);
    let [tk, tc] = {
        let mut kv = || -> Result<f64> {
            let mut res = Ok(());
            let t = timer.gpu(|enc| res = cache.record_append_gpu(enc, 0, &[slab]).map(drop))?;
            res?;
            cache.truncate(0)?;
            Ok(t)
        };
        let mut copy = || timer.gpu(|enc| enc.copy_buffer_to_buffer(&src, 0, &plain, 0, dst_bytes));
        interleaved(cfg.warm, cfg.reps, [&mut kv, &mut copy])?
    };
    rows.push(
        Row::new(
            format!("GPU slab write, contiguous f16, {n} tokens x 2 KiB"),
            gbs(dst_bytes, tk),
            "GB/s",
            timer.clock(),
        )
        .ratio(
            tc / tk,
            format!(
                "copy_buffer_to_buffer of the same bytes ({:.2} GB/s)",
                gbs(dst_bytes, tc)
            ),
            Goal::AtLeast(0.9),
        ),
    );
    rows.push(Row::new(
        "reference: copy_buffer_to_buffer bandwidth",
        gbs(dst_bytes, tc),
        "GB/s",
        timer.clock(),
    ));

    // Strided fused QKV f32 source, K converted to f16: the slab-write kernel against the best plain
    // copy kernel for the same rows.
    let qkv = storage(&gpu.device, (n * QKV * 4) as u64, "bench fused qkv f32");
    let init: Vec<f32> = (0..QKV * 64)
        .map(|i| ((i * 7919) % 2001) as f32 * 1e-3 - 1.0)
        .collect();
    for r in (0..n).step_by(64) {
        let m = 64.min(n - r);
        gpu.queue.write_buffer(
            &qkv,
            (r * QKV * 4) as u64,
            bytemuck::cast_slice(&init[..m * QKV]),
        );
    }
    let shape = [n, KV_HEADS, HEAD_DIM];
    let strides = [QKV, HEAD_DIM, 1];
    let slab = GpuSlab {
        buffer: &qkv,
        dtype: DType::F32,
        offset: Q_DIM as u64,
        shape: &shape,
        strides: Some(&strides),
    };
    let reference = BoundKernel::qkv_to_f16(
        &gpu.device,
        &qkv,
        &plain,
        n as u32,
        QKV as u32,
        Q_DIM as u32,
        KV as u32,
    );
    let scalar = BoundKernel::qkv_to_f16_scalar(
        &gpu.device,
        &qkv,
        &plain,
        n as u32,
        QKV as u32,
        Q_DIM as u32,
        KV as u32,
    );
    let moved = dst_bytes * 3; // 4 bytes read and 2 written per element
    let [tk, tr, ts] = {
        let mut kv = || -> Result<f64> {
            let mut res = Ok(());
            let t = timer.gpu(|enc| res = cache.record_append_gpu(enc, 0, &[slab]).map(drop))?;
            res?;
            cache.truncate(0)?;
            Ok(t)
        };
        let mut best = || timer.gpu(|enc| reference.record(enc));
        let mut narrow = || timer.gpu(|enc| scalar.record(enc));
        interleaved(cfg.warm, cfg.reps, [&mut kv, &mut best, &mut narrow])?
    };
    rows.push(
        Row::new(
            format!("GPU slab write, fused QKV f32 -> f16 K, {n} tokens"),
            gbs(moved, tk),
            "GB/s",
            timer.clock(),
        )
        .ratio(
            // The faster of the two plain kernels, the 16-byte one on the adapters measured so far.
            tr.min(ts) / tk,
            format!(
                "best plain copy kernel, pack2x16float, {} loads ({:.2} GB/s)",
                if ts < tr { "4-byte" } else { "16-byte" },
                gbs(moved, tr.min(ts))
            ),
            Goal::AtLeast(0.8),
        ),
    );
    rows.push(
        Row::new(
            "profile: the best kernel with 4-byte loads and stores, one word per invocation",
            gbs(moved, ts),
            "GB/s",
            timer.clock(),
        )
        .ratio(
            tr / ts,
            "the best plain copy kernel (16-byte loads and stores) above",
            Goal::Info,
        ),
    );
    drop(qkv);

    // Reference bandwidths: the streaming-read roofline and host memcpy.
    let bytes = 64u64 << 20;
    let roof_run = roof.best(timer, bytes)?;
    let host: Vec<u8> = vec![1; bytes as usize];
    let mut copy = vec![0u8; bytes as usize];
    let mut memcpy = || -> Result<f64> {
        let t = std::time::Instant::now();
        copy.copy_from_slice(&host);
        std::hint::black_box(&copy);
        Ok(t.elapsed().as_secs_f64())
    };
    let ([tm], tr) = roof_run.interleaved_with(timer, cfg.warm, cfg.reps.max(3), [&mut memcpy])?;
    rows.push(
        Row::new(
            "reference: streaming-read roofline kernel, 64 MiB",
            gbs(bytes, tr),
            "GB/s",
            timer.clock(),
        )
        .ratio(
            tm / (2.0 * tr),
            format!(
                "host memcpy 64 MiB ({:.2} GB/s moved, read + write)",
                gbs(2 * bytes, tm)
            ),
            Goal::Info,
        ),
    );
    Ok(())
}
