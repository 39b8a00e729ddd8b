//! Decode append: one token into every layer of a Llama-3-8B f16 cache, against a raw `write_buffer`
//! of the same bytes, across positions, and against the peers (candle-nn's `KvCache`, a prefix-copy
//! GPU cache, a flat `Vec<f32>` cache). Also the zeroing reset of the whole cache.

use anyhow::{Context, Result};
use half::f16;
use kvgpu::{CacheSpec, DType, Gpu, HostSlab, KvCache};

use crate::Config;
use crate::report::{Goal, Row};
use crate::timing::{Clock, Timer, interleaved};

const LAYERS: usize = 32;
const KV_HEADS: usize = 8;
const HEAD_DIM: usize = 128;
const ROW: usize = KV_HEADS * HEAD_DIM;

/// Step cost per context for the plot: (series name, [(context, seconds)]).
pub type Series = Vec<(String, Vec<(usize, f64)>)>;

fn fill(cache: &mut KvCache, rows: usize) -> Result<()> {
    let chunk = 512;
    let data: Vec<f16> = (0..chunk * ROW)
        .map(|i| f16::from_f32((i % 97) as f32 * 0.01))
        .collect();
    let mut done = 0;
    while done < rows {
        let n = chunk.min(rows - done);
        let shape = [n, KV_HEADS, HEAD_DIM];
        for layer in 0..LAYERS {
            let slab = HostSlab::f16(&data[..n * ROW], &shape);
            cache.append(layer, &[slab, slab])?;
        }
        cache.advance(n)?;
        done += n;
    }
    cache.queue().submit([]);
    Ok(())
}

/// One decode step: every layer appends one token's K and V, then the step commits.
fn step(cache: &mut KvCache, k: &[f16], v: &[f16]) -> Result<()> {
    let shape = [1, KV_HEADS, HEAD_DIM];
    for layer in 0..LAYERS {
        cache.append(layer, &[HostSlab::f16(k, &shape), HostSlab::f16(v, &shape)])?;
    }
    cache.advance(1)?;
    Ok(())
}

/// The same step through `append_layers`: every layer's rows in one upload, copied into place.
fn step_layers(cache: &mut KvCache, k: &[f16], v: &[f16]) -> Result<()> {
    let shape = [1, KV_HEADS, HEAD_DIM];
    let slabs = [HostSlab::f16(k, &shape), HostSlab::f16(v, &shape)];
    cache.append_layers(&[&slabs[..]; LAYERS])?;
    cache.advance(1)?;
    Ok(())
}

/// Buffers of a cache's size and usage, K and V of each layer in turn, with their row sizes: where
/// the raw step writes. Not the cache's own buffers: a slot whose view was handed out is asked
/// whether the app destroyed it on each use, which the measured steps must not pay.
fn raw_buffers(gpu: &Gpu, spec: &CacheSpec) -> Result<Vec<(wgpu::Buffer, u64)>> {
    let mut out = Vec::new();
    for layer in 0..LAYERS {
        for slot in 0..2 {
            let buffer = gpu.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("bench raw step"),
                size: spec.slot_bytes(layer, slot)?,
                usage: wgpu::BufferUsages::STORAGE
                    | wgpu::BufferUsages::COPY_SRC
                    | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            });
            out.push((buffer, spec.row_bytes(layer, slot)?));
        }
    }
    Ok(out)
}

/// The same bytes written straight into buffers like the cache's at row `pos`, without kvgpu.
fn raw_step(
    queue: &wgpu::Queue,
    bufs: &[(wgpu::Buffer, u64)],
    pos: usize,
    k: &[f16],
    v: &[f16],
) -> Result<()> {
    for (i, (buf, row_bytes)) in bufs.iter().enumerate() {
        let data = if i % 2 == 0 { k } else { v };
        queue.write_buffer(buf, pos as u64 * row_bytes, bytemuck::cast_slice(data));
    }
    Ok(())
}

/// A cache that allocates a new buffer per slot every step and copies the whole prefix into it.
struct PrefixCopy {
    device: wgpu::Device,
    queue: wgpu::Queue,
    buffers: Vec<wgpu::Buffer>,
    len: usize,
}

impl PrefixCopy {
    const ROW_BYTES: u64 = (ROW * 2) as u64;

    fn buffer(device: &wgpu::Device, rows: usize) -> wgpu::Buffer {
        device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("bench prefix-copy"),
            size: rows.max(1) as u64 * Self::ROW_BYTES,
            usage: wgpu::BufferUsages::STORAGE
                | wgpu::BufferUsages::COPY_SRC
                | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        })
    }

    fn new(gpu: &Gpu, len: usize) -> Self {
        Self {
            device: gpu.device.clone(),
            queue: gpu.queue.clone(),
            buffers: (0..2 * LAYERS)
                .map(|_| Self::buffer(&gpu.device, len))
                .collect(),
            len,
        }
    }

    fn step(&mut self, k: &[f16], v: &[f16]) {
        let mut enc = self
            .device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                label: Some("bench prefix-copy"),
            });
        let prefix = self.len as u64 * Self::ROW_BYTES;
        for (i, old) in self.buffers.iter_mut().enumerate() {
            let new = Self::buffer(&self.device, self.len + 1);
            if prefix > 0 {
                enc.copy_buffer_to_buffer(old, 0, &new, 0, prefix);
            }
            let data = if i % 2 == 0 { k } else { v };
            self.queue
                .write_buffer(&new, prefix, bytemuck::cast_slice(data));
            *old = new;
        }
        self.queue.submit([enc.finish()]);
        self.len += 1;
    }
}

/// A CPU engine's flat cache: one `Vec<f32>` per (layer, slot), `[capacity, heads·dim]`.
struct FlatVec {
    slots: Vec<Vec<f32>>,
}

impl FlatVec {
    fn step(&mut self, pos: usize, k: &[f32], v: &[f32]) {
        for (i, slot) in self.slots.iter_mut().enumerate() {
            let src = if i % 2 == 0 { k } else { v };
            slot[pos * ROW..(pos + 1) * ROW].copy_from_slice(src);
        }
    }
}

/// candle-nn's `KvCache` per layer, tensors `[1, heads, seq, dim]` f16 on the CPU.
struct Candle {
    caches: Vec<candle_nn::kv_cache::KvCache>,
    k: candle_core::Tensor,
    v: candle_core::Tensor,
}

impl Candle {
    fn new(max: usize) -> Result<Self> {
        let dev = candle_core::Device::Cpu;
        let k =
            candle_core::Tensor::ones((1, KV_HEADS, 1, HEAD_DIM), candle_core::DType::F16, &dev)?;
        Ok(Self {
            caches: (0..LAYERS)
                .map(|_| candle_nn::kv_cache::KvCache::new(2, max))
                .collect(),
            v: (&k * 0.5)?,
            k,
        })
    }

    fn set_len(&mut self, len: usize) -> Result<()> {
        let prefix = candle_core::Tensor::zeros(
            (1, KV_HEADS, len.max(1), HEAD_DIM),
            candle_core::DType::F16,
            &candle_core::Device::Cpu,
        )?;
        for c in &mut self.caches {
            c.reset();
            if len > 0 {
                c.append(&prefix, &prefix)?;
            }
        }
        Ok(())
    }

    fn step(&mut self) -> Result<()> {
        for c in &mut self.caches {
            c.append(&self.k, &self.v)?;
        }
        Ok(())
    }
}

pub fn run(
    gpu: &Gpu,
    timer: &Timer,
    cfg: &Config,
    rows: &mut Vec<Row>,
    series: &mut Series,
) -> Result<()> {
    let max_ctx = *cfg.contexts.iter().max().context("no contexts")?;
    let extra = cfg.warm + cfg.step_reps + 1;
    let cap = (max_ctx.max(4000) + extra).next_multiple_of(64);
    let spec = CacheSpec::llama3_8b(DType::F16, cap)?;
    let bytes_per_step = spec.bytes_per_token();
    let total_bytes = spec.total_bytes();
    eprintln!(
        "decode: Llama-3-8B f16, capacity {cap} ({} MiB), {} bytes per step",
        total_bytes >> 20,
        bytes_per_step
    );
    let k: Vec<f16> = (0..ROW).map(|i| f16::from_f32(i as f32 * 1e-3)).collect();
    let v: Vec<f16> = k.iter().map(|x| -*x).collect();

    // (1) step at position 10 and 4000, raw write_buffer of the same bytes, and the step in one upload,
    // interleaved.
    {
        let mut near = KvCache::new(&gpu.device, &gpu.queue, spec.clone())?;
        let mut far = KvCache::new(&gpu.device, &gpu.queue, spec.clone())?;
        fill(&mut near, 10)?;
        fill(&mut far, 4000)?;
        timer.wait()?;
        let far_bufs = raw_buffers(gpu, &spec)?;
        let mut a = || -> Result<f64> {
            let t = timer.host(|| step(&mut near, &k, &v))?;
            near.truncate(10)?;
            Ok(t)
        };
        let mut c = || timer.host(|| raw_step(&gpu.queue, &far_bufs, 4000, &k, &v));
        // The far cache takes the step both ways: 32 per-layer appends, and one append_layers.
        let far = std::cell::RefCell::new(far);
        let mut b = || -> Result<f64> {
            let t = timer.host(|| step(&mut far.borrow_mut(), &k, &v))?;
            far.borrow_mut().truncate(4000)?;
            Ok(t)
        };
        let mut d = || -> Result<f64> {
            let t = timer.host(|| step_layers(&mut far.borrow_mut(), &k, &v))?;
            far.borrow_mut().truncate(4000)?;
            Ok(t)
        };
        let [t10, t4000, traw, tone] =
            interleaved(cfg.warm, cfg.step_reps, [&mut a, &mut b, &mut c, &mut d])?;
        rows.push(
            Row::new(
                "decode append step, Llama-3-8B f16, 32 layers, pos 4000",
                t4000 * 1e6,
                "us",
                Clock::HostWall,
            )
            .ratio(
                t4000 / traw,
                format!(
                    "raw write_buffer of the same {bytes_per_step} bytes ({:.1} us)",
                    traw * 1e6
                ),
                Goal::AtMost(1.15),
            ),
        );
        rows.push(
            Row::new(
                "decode append step at pos 4000 / pos 10",
                t4000 * 1e6,
                "us",
                Clock::HostWall,
            )
            .ratio(
                t4000 / t10,
                format!("the same step at position 10 ({:.1} us)", t10 * 1e6),
                Goal::AtMost(1.1),
            ),
        );
        rows.push(
            Row::new(
                "decode append step in one upload (append_layers), pos 4000",
                tone * 1e6,
                "us",
                Clock::HostWall,
            )
            .ratio(
                tone / t4000,
                format!("the step as 32 per-layer appends ({:.1} us)", t4000 * 1e6),
                Goal::Info,
            ),
        );
    }

    // (6) step cost across contexts: kvgpu, raw write_buffer, candle-nn, prefix-copy, Vec<f32>.
    let mut kv_pts = Vec::new();
    let mut raw_pts = Vec::new();
    let mut candle_pts = Vec::new();
    let mut prefix_pts = Vec::new();
    let mut vec_pts = Vec::new();
    let mut cache = KvCache::new(&gpu.device, &gpu.queue, spec.clone())?;
    fill(&mut cache, max_ctx)?;
    let bufs = raw_buffers(gpu, &spec)?;
    let mut candle = Candle::new(cap)?;
    let mut flat = FlatVec {
        slots: (0..2 * LAYERS).map(|_| vec![0.0f32; cap * ROW]).collect(),
    };
    let kf: Vec<f32> = k.iter().map(|x| x.to_f32()).collect();
    let vf: Vec<f32> = v.iter().map(|x| x.to_f32()).collect();
    let mut contexts = cfg.contexts.clone();
    contexts.sort_unstable_by(|a, b| b.cmp(a));
    let cache = std::cell::RefCell::new(cache);
    for &ctx in &contexts {
        cache.borrow_mut().truncate(ctx)?;
        candle.set_len(ctx)?;
        let mut kv = || -> Result<f64> {
            let t = timer.host(|| step_layers(&mut cache.borrow_mut(), &k, &v))?;
            cache.borrow_mut().truncate(ctx)?;
            Ok(t)
        };
        // The host calls alone: what a decode loop pays when the submit is shared with its kernels
        // (the step recorded into the loop's encoder); with f16 host rows, or f32 ones, which the
        // cache converts to its f16 on the host.
        let host_calls = |f32_rows: bool| -> Result<f64> {
            let t = std::time::Instant::now();
            let mut encoder = gpu.device.create_command_encoder(&Default::default());
            let shape = [1, KV_HEADS, HEAD_DIM];
            let slabs = if f32_rows {
                [HostSlab::f32(&kf, &shape), HostSlab::f32(&vf, &shape)]
            } else {
                [HostSlab::f16(&k, &shape), HostSlab::f16(&v, &shape)]
            };
            let mut c = cache.borrow_mut();
            c.record_append_layers(&mut encoder, &[&slabs[..]; LAYERS])?;
            c.advance(1)?;
            drop(c);
            let t = t.elapsed().as_secs_f64();
            gpu.queue.submit([encoder.finish()]);
            timer.wait()?;
            cache.borrow_mut().truncate(ctx)?;
            Ok(t)
        };
        let mut kh = || host_calls(false);
        let mut kh32 = || host_calls(true);
        let mut raw = || timer.host(|| raw_step(&gpu.queue, &bufs, ctx, &k, &v));
        let mut cd = || -> Result<f64> {
            let t = std::time::Instant::now();
            candle.step()?;
            Ok(t.elapsed().as_secs_f64())
        };
        let mut fv = || -> Result<f64> {
            let t = std::time::Instant::now();
            flat.step(ctx, &kf, &vf);
            std::hint::black_box(&flat.slots[0][ctx * ROW]);
            Ok(t.elapsed().as_secs_f64())
        };
        // The floor of any step that waits on the device: an empty submission and the wait.
        let mut floor = || timer.host(|| Ok(()));
        let [tk, th, th32, tr, tc, tv, tf] = interleaved(
            cfg.warm,
            cfg.step_reps,
            [
                &mut kv, &mut kh, &mut kh32, &mut raw, &mut cd, &mut fv, &mut floor,
            ],
        )?;
        // The prefix-copy cache moves the whole prefix each step: few repetitions, interleaved
        // with kvgpu's step again (`tkp`, the reference of its row).
        let mut prefix = PrefixCopy::new(gpu, ctx);
        let [tp, tkp] = interleaved(
            1,
            cfg.slow_reps,
            [
                &mut || {
                    timer.host(|| {
                        prefix.step(&k, &v);
                        Ok(())
                    })
                },
                &mut kv,
            ],
        )?;
        drop(prefix);
        eprintln!(
            "  ctx {ctx:>6}: kvgpu {:.1} us (host calls {:.1} us, empty submit and wait {:.1} us), raw {:.1} us, candle {:.1} us, prefix-copy {:.1} us, Vec<f32> {:.1} us",
            tk * 1e6,
            th * 1e6,
            tf * 1e6,
            tr * 1e6,
            tc * 1e6,
            tp * 1e6,
            tv * 1e6
        );
        kv_pts.push((ctx, tk));
        raw_pts.push((ctx, tr));
        candle_pts.push((ctx, tc));
        prefix_pts.push((ctx, tp));
        vec_pts.push((ctx, tv));
        let goal = if ctx == 4000 {
            Goal::AtMost(1.0)
        } else {
            Goal::Info
        };
        rows.push(
            Row::new(
                format!("kvgpu / candle-nn KvCache append step (append_layers), ctx {ctx}"),
                tk * 1e6,
                "us",
                Clock::HostWall,
            )
            .ratio(
                tk / tc,
                format!(
                    "candle-nn KvCache::append, 32 layers, f16 CPU ({:.1} us)",
                    tc * 1e6
                ),
                goal,
            ),
        );
        if ctx == 4000 {
            rows.push(
                Row::new(
                    "empty submit and wait / candle-nn KvCache append step",
                    tf * 1e6,
                    "us",
                    Clock::HostWall,
                )
                .ratio(
                    tf / tc,
                    format!("candle-nn KvCache::append ({:.1} us)", tc * 1e6),
                    Goal::Info,
                ),
            );
        }
        rows.push(
            Row::new(
                format!("kvgpu append_layers host calls only (recorded, no submit) / candle-nn, ctx {ctx}"),
                th * 1e6,
                "us",
                Clock::Cpu,
            )
            .ratio(
                th / tc,
                format!("candle-nn KvCache::append ({:.1} us)", tc * 1e6),
                Goal::Info,
            ),
        );
        if ctx == 4000 {
            rows.push(
                Row::new(
                    "append_layers host calls, f32 host rows into the f16 cache / f16 rows, ctx 4000",
                    th32 * 1e6,
                    "us",
                    Clock::Cpu,
                )
                .ratio(
                    th32 / th,
                    format!("the same calls with f16 host rows ({:.1} us)", th * 1e6),
                    Goal::Info,
                ),
            );
        }
        rows.push(
            Row::new(
                format!("prefix-copy cache step, ctx {ctx}"),
                tp * 1e6,
                "us",
                Clock::HostWall,
            )
            .ratio(
                tp / tkp,
                format!("kvgpu append step ({:.1} us)", tkp * 1e6),
                Goal::Info,
            ),
        );
        rows.push(
            Row::new(
                format!("kvgpu / Vec<f32> flat CPU cache step, ctx {ctx}"),
                tk * 1e6,
                "us",
                Clock::HostWall,
            )
            .ratio(
                tk / tv,
                format!("Vec<f32> copy_from_slice, 64 slots ({:.2} us)", tv * 1e6),
                Goal::Info,
            ),
        );
    }
    let mut cache = cache.into_inner();
    drop(candle);
    drop(flat);
    for (name, pts) in [
        ("kvgpu append_layers (Llama-3-8B f16, 32 layers)", kv_pts),
        ("raw write_buffer, same bytes", raw_pts),
        ("candle-nn KvCache (CPU f16)", candle_pts),
        ("prefix-copy GPU cache", prefix_pts),
        ("Vec<f32> flat CPU cache", vec_pts),
    ] {
        let mut pts = pts;
        pts.sort_unstable_by_key(|p| p.0);
        series.push((name.into(), pts));
    }

    // (5) zeroing reset of the whole cache against clear_buffer of the same buffers.
    let mut reset = || {
        let mut res = Ok(());
        let t = timer.gpu(|enc| res = cache.record_reset(enc))?;
        res?;
        Ok(t)
    };
    let mut clear = || {
        timer.gpu(|enc| {
            for (b, _) in &bufs {
                enc.clear_buffer(b, 0, None);
            }
        })
    };
    let [tz, tc] = interleaved(1, cfg.slow_reps, [&mut reset, &mut clear])?;
    let gbs = |t: f64| total_bytes as f64 / t / 1e9;
    rows.push(
        Row::new(
            format!(
                "reset (zeroing) of a whole Llama-3-8B f16 cache, {} MiB",
                total_bytes >> 20
            ),
            gbs(tz),
            "GB/s",
            timer.clock(),
        )
        .ratio(
            tc / tz,
            format!(
                "clear_buffer of 64 buffers of the same sizes ({:.2} GB/s)",
                gbs(tc)
            ),
            Goal::AtLeast(0.9),
        ),
    );
    Ok(())
}
