//! Snapshots: exporting a cache (readback, format, checksum) against reading the same rows back
//! with one plain readback per slot buffer (a copy into one reused staging buffer and a map), and importing it into an empty cache (parse, checks,
//! checksum, upload, submit and wait) against `write_buffer` of the same bytes. Llama-3-8B layer
//! shapes in f16, 8 layers.

use anyhow::Result;
use kvgpu::{CacheSpec, DType, Gpu, HostSlab, KvCache, LayerSpec};

use crate::Config;
use crate::report::{Goal, Row};
use crate::timing::{Clock, Timer, interleaved};

const LAYERS: usize = 8;
const KV_HEADS: usize = 8;
const DIM: usize = 128;

pub fn run(gpu: &Gpu, timer: &Timer, cfg: &Config, rows: &mut Vec<Row>) -> Result<()> {
    let len = if cfg.quick { 1024 } else { 4096 };
    let spec = CacheSpec::new(
        vec![LayerSpec::kv(KV_HEADS, DIM, DIM); LAYERS],
        DType::F16,
        len,
    )?;
    let mut cache = KvCache::new(&gpu.device, &gpu.queue, spec.clone())?;
    let row = KV_HEADS * DIM;
    let data: Vec<f32> = (0..len * row)
        .map(|i| ((i * 2_654_435_761) >> 7) as f32 % 2001.0 * 1e-3 - 1.0)
        .collect();
    let shape = [len, KV_HEADS, DIM];
    for layer in 0..LAYERS {
        let slab = HostSlab::f32(&data, &shape);
        cache.append(layer, &[slab, slab])?;
    }
    cache.advance(len)?;
    let mut bytes = cache.snapshot()?;
    let rows_bytes = spec.bytes_per_token() * len as u64;
    // The slot buffers and the bytes of their rows, for the plain readback and upload. Viewing them
    // makes each export ask whether the app destroyed them: 16 checks of about 0.6 us, against
    // milliseconds of readback.
    let mut slots = Vec::new();
    for layer in 0..LAYERS {
        for slot in 0..2 {
            let view = cache.view(layer, slot)?;
            slots.push((view.buffer.clone(), view.size));
        }
    }
    let plain: Vec<Vec<u8>> = slots
        .iter()
        .map(|(b, size)| kvgpu::read_buffer(&gpu.device, &gpu.queue, b, 0, *size))
        .collect::<kvgpu::Result<_>>()?;
    let mut target = KvCache::new(&gpu.device, &gpu.queue, spec)?;
    let (warm, reps) = (cfg.warm.min(2), cfg.reps.min(7));
    let mut export = || -> Result<f64> {
        timer.host(|| {
            bytes.clear();
            cache.export(&mut bytes)?;
            Ok(())
        })
    };
    // The plain readback an app would write: one staging buffer made once and reused, per slot a
    // copy into it, a submit, a map and a copy out of the mapped bytes (as `read_buffer` returns
    // them, but without its new staging buffer per call).
    let largest = slots.iter().map(|(_, size)| *size).max().unwrap_or(4);
    let staging = gpu.device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("bench readback staging"),
        size: largest,
        usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    });
    let mut readback = || -> Result<f64> {
        timer.host(|| {
            for (b, size) in &slots {
                let mut enc = gpu
                    .device
                    .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                        label: Some("bench readback"),
                    });
                enc.copy_buffer_to_buffer(b, 0, &staging, 0, *size);
                gpu.queue.submit([enc.finish()]);
                let slice = staging.slice(..*size);
                let (tx, rx) = std::sync::mpsc::channel();
                slice.map_async(wgpu::MapMode::Read, move |r| {
                    let _ = tx.send(r);
                });
                gpu.device.poll(wgpu::PollType::wait_indefinitely())?;
                rx.recv()??;
                std::hint::black_box(slice.get_mapped_range()?.to_vec());
                staging.unmap();
            }
            Ok(())
        })
    };
    let [te, tr] = interleaved(warm, reps, [&mut export, &mut readback])?;
    let target = std::cell::RefCell::new(&mut target);
    let mut import = || -> Result<f64> {
        let target = &mut **target.borrow_mut();
        target.truncate(0)?;
        timer.host(|| {
            target.import(&bytes)?;
            Ok(())
        })
    };
    let mut upload = || -> Result<f64> {
        timer.host(|| {
            for ((b, _), rows) in slots.iter().zip(&plain) {
                gpu.queue.write_buffer(b, 0, rows);
            }
            Ok(())
        })
    };
    let [ti, tw] = interleaved(warm, reps, [&mut import, &mut upload])?;
    let mib = rows_bytes as f64 / (1 << 20) as f64;
    let what = format!("{LAYERS} layers x {len} rows, GQA f16 ({mib:.0} MiB of rows)");
    let rate = |t: f64| rows_bytes as f64 / t / 1e9;
    rows.push(
        Row::new(
            format!("snapshot export, {what}"),
            rate(te),
            "GB/s",
            Clock::HostWall,
        )
        .ratio(
            tr / te,
            format!(
                "one copy and map per slot into a reused staging buffer, the same rows ({:.2} GB/s)",
                rate(tr)
            ),
            Goal::AtLeast(0.8),
        ),
    );
    rows.push(
        Row::new(
            format!("snapshot import, {what}"),
            rate(ti),
            "GB/s",
            Clock::HostWall,
        )
        .ratio(
            tw / ti,
            format!(
                "one write_buffer per slot of the same rows ({:.2} GB/s)",
                rate(tw)
            ),
            Goal::AtLeast(0.8),
        ),
    );
    eprintln!(
        "  export {:.2} GB/s (readback {:.2}), import {:.2} GB/s (write_buffer {:.2})",
        rate(te),
        rate(tr),
        rate(ti),
        rate(tw)
    );
    Ok(())
}
