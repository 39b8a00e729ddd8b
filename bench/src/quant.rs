//! Quantized storage (q8_0, q4_0, fp8 e4m3 and e5m2) against f16: bytes per token of real models, decode
//! attention time over the same context (Llama-3-8B GQA and DeepSeek-V2-Lite MLA layers), the decode
//! append step of a whole model, and the accuracy attention keeps (CPU twins, f64, against f32 K/V).
//! Mixed storage too: Llama's K in q8_0 and V in q4_0, DeepSeek's latent in q8_0 and rope key in f16.

use anyhow::Result;
use kvgpu::reference;
use kvgpu::wgpu;
use kvgpu::{
    Attention, AttentionOptions, CacheSpec, DType, Gpu, HostSlab, KvCache, LayerSpec, MlaQueries,
    Queries,
};

use crate::Config;
use crate::report::{Goal, Row};
use crate::timing::{Clock, Timer, interleaved};

/// Pseudo-random values in [-1, 1).
fn values(n: usize, seed: usize) -> Vec<f32> {
    (0..n)
        .map(|i| (((i + seed * 7919) * 2_654_435_761) >> 9) as f32 % 2001.0 * 1e-3 - 1.0)
        .collect()
}

/// Values like real keys: mostly small, a few channels (one in 16) twenty times larger, and one
/// element in 997 a lone outlier of 60.
fn outlier_heavy(n: usize, width: usize, seed: usize) -> Vec<f32> {
    values(n, seed)
        .into_iter()
        .enumerate()
        .map(|(i, x)| {
            if i % 997 == 13 {
                60.0
            } else if (i % width) % 16 == 5 {
                20.0 * x
            } else {
                x
            }
        })
        .collect()
}

fn storage(device: &wgpu::Device, data: &[f32]) -> wgpu::Buffer {
    use wgpu::util::DeviceExt;
    device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
        label: Some("bench quant queries"),
        contents: bytemuck::cast_slice(data),
        usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST,
    })
}

pub fn run(gpu: &Gpu, timer: &Timer, cfg: &Config, rows: &mut Vec<Row>) -> Result<()> {
    bytes_per_token(rows)?;
    accuracy(rows)?;
    attention(gpu, timer, cfg, rows)?;
    append(gpu, timer, cfg, rows)?;
    Ok(())
}

/// The mixed storage of a preset's layers: GQA keys in q8_0 and values in q4_0, MLA's latent in q8_0
/// and its rope key in f16; with its name.
fn mixed(spec: CacheSpec) -> Result<(String, CacheSpec)> {
    let mla = spec
        .layers()
        .iter()
        .any(|l| l.slots.iter().any(|s| s.name == "k_pe"));
    Ok(if mla {
        (
            "latent q8_0 + k_pe f16".into(),
            spec.with_slot_dtype("compressed_kv", DType::Q8_0)?
                .with_slot_dtype("k_pe", DType::F16)?,
        )
    } else {
        (
            "K q8_0 + V q4_0".into(),
            spec.with_slot_dtype("k", DType::Q8_0)?
                .with_slot_dtype("v", DType::Q4_0)?,
        )
    })
}

/// The storage of the group's measurements: each quantized type, then [`mixed`].
fn storages(layers: Vec<LayerSpec>, rows: usize) -> Result<Vec<(String, CacheSpec)>> {
    let mut out = Vec::new();
    for dtype in DType::QUANTIZED {
        out.push((
            dtype.to_string(),
            CacheSpec::new(layers.clone(), dtype, rows)?,
        ));
    }
    out.push(mixed(CacheSpec::new(layers, DType::F16, rows)?)?);
    Ok(out)
}

fn bytes_per_token(rows: &mut Vec<Row>) -> Result<()> {
    for preset in ["llama3-8b", "deepseek-v2-lite"] {
        let f16 = CacheSpec::preset(preset, DType::F16, 1)?;
        let layers = f16.layers().to_vec();
        let f16 = f16.bytes_per_token();
        for (name, spec) in storages(layers, 1)? {
            let b = spec.bytes_per_token();
            rows.push(
                Row::new(
                    format!("{preset} cache, {name}: bytes per token"),
                    b as f64,
                    "B",
                    Clock::Untimed,
                )
                .ratio(
                    b as f64 / f16 as f64,
                    format!("f16 ({f16} B per token)"),
                    Goal::Info,
                ),
            );
        }
    }
    Ok(())
}

/// Max and mean of `|got - want|` over the RMS of `want`.
fn errors(got: &[f32], want: &[f32]) -> (f64, f64) {
    let rms = (want.iter().map(|&w| (w as f64).powi(2)).sum::<f64>() / want.len() as f64).sqrt();
    let errs: Vec<f64> = got
        .iter()
        .zip(want)
        .map(|(&g, &w)| (g as f64 - w as f64).abs() / rms)
        .collect();
    let max = errs.iter().cloned().fold(0.0, f64::max);
    (max, errs.iter().sum::<f64>() / errs.len() as f64)
}

/// Attention output with K/V rounded through each storage type against f32 K/V (the CPU twins),
/// one decode query over 1,024 rows of a Llama-3-8B layer and of a DeepSeek-V2-Lite layer.
fn accuracy(rows: &mut Vec<Row>) -> Result<()> {
    let ctx = 1024;
    let opts = AttentionOptions::default();
    for outliers in [false, true] {
        let data = |n: usize, w: usize, seed: usize| {
            if outliers {
                outlier_heavy(n, w, seed)
            } else {
                values(n, seed)
            }
        };
        let what = if outliers { "outlier-heavy" } else { "uniform" };
        // GQA: 32 heads over 8 KV heads of 128.
        let (k, v) = (data(ctx * 1024, 1024, 1), data(ctx * 1024, 1024, 2));
        let q = values(32 * 128, 3);
        let want = reference::attention_gqa(&q, [1, 32, 128], &k, &v, 8, 128, &opts);
        // MLA: 16 heads over a latent of 512 and a rope part of 64.
        let (lat, pe) = (data(ctx * 512, 512, 4), data(ctx * 64, 64, 5));
        let (ql, qr) = (values(16 * 512, 6), values(16 * 64, 7));
        let want_mla = reference::attention_mla(&ql, &qr, [1, 16, 512], &lat, &pe, 64, &opts);
        // Each type for both slots, then the mixed storage (K q8_0 + V q4_0; latent q8_0 + k_pe f16).
        let types = [
            DType::F16,
            DType::BF16,
            DType::Q8_0,
            DType::Q4_0,
            DType::F8E4M3,
            DType::F8E5M2,
        ]
        .map(|t| (t.to_string(), [t; 2], [t; 2]))
        .into_iter()
        .chain([(
            "mixed".to_string(),
            [DType::Q8_0, DType::Q4_0],
            [DType::Q8_0, DType::F16],
        )]);
        for (name, [tk, tv], [tl, tp]) in types {
            let (kq, vq) = (
                reference::round_trip_rows(&k, tk, 1024),
                reference::round_trip_rows(&v, tv, 1024),
            );
            let got = reference::attention_gqa(&q, [1, 32, 128], &kq, &vq, 8, 128, &opts);
            let (lq, pq) = (
                reference::round_trip_rows(&lat, tl, 512),
                reference::round_trip_rows(&pe, tp, 64),
            );
            let got_mla = reference::attention_mla(&ql, &qr, [1, 16, 512], &lq, &pq, 64, &opts);
            for (label, got, want) in [("GQA", &got, &want), ("MLA", &got_mla, &want_mla)] {
                let dtype = if name != "mixed" {
                    format!("{name} K/V")
                } else if label == "GQA" {
                    "K q8_0 + V q4_0".into()
                } else {
                    "latent q8_0 + k_pe f16".into()
                };
                let (max, mean) = errors(got, want);
                rows.push(
                    Row::new(
                        format!("{label} attention error, {dtype}, {what} data: max / RMS"),
                        max,
                        "",
                        Clock::Untimed,
                    )
                    .ratio(
                        mean,
                        "(ratio column: the mean error over the RMS of the f32 output)",
                        Goal::Info,
                    ),
                );
                eprintln!(
                    "  {label} {dtype} {what}: max error {max:.2e}, mean {mean:.2e} of the output RMS"
                );
            }
        }
    }
    Ok(())
}

/// One decode query's attention over the same context in f16 and in each quantized type.
fn attention(gpu: &Gpu, timer: &Timer, cfg: &Config, rows: &mut Vec<Row>) -> Result<()> {
    // Longest first: each context truncates the filled caches.
    let contexts: &[usize] = if cfg.quick { &[4096] } else { &[16384, 4096] };
    let max = *contexts.iter().max().unwrap_or(&4096);
    let opts = AttentionOptions::default();
    for mla in [false, true] {
        let (label, layer, heads, dk, dr) = if mla {
            ("MLA DeepSeek-V2-Lite", LayerSpec::mla(512, 64), 16, 512, 64)
        } else {
            ("GQA Llama-3-8B", LayerSpec::kv(8, 128, 128), 32, 128, 0)
        };
        let q = storage(&gpu.device, &values(heads * dk, 11));
        let q_rope = storage(&gpu.device, &values(heads * dr.max(1), 12));
        let out = storage(&gpu.device, &vec![0.0; heads * dk]);
        let mut caches = Vec::new();
        let f16 = CacheSpec::new(vec![layer.clone()], DType::F16, max)?;
        for (name, spec) in [("f16".to_string(), f16)]
            .into_iter()
            .chain(storages(vec![layer.clone()], max)?)
        {
            let mut c = KvCache::new(&gpu.device, &gpu.queue, spec)?;
            crate::attn::fill(&mut c, max)?;
            let att = Attention::for_cache(&c);
            caches.push((name, c, att));
        }
        // One decode query; the six storages measured in turn, side by side.
        let time = |c: &KvCache, att: &mut Attention| -> Result<f64> {
            let mut res = Ok(());
            let t = timer.gpu(|enc| {
                res = if mla {
                    let queries = MlaQueries {
                        latent: Queries::new(&q, 1, heads, dk),
                        rope: Queries::new(&q_rope, 1, heads, dr),
                    };
                    att.record_mla(enc, c, 0, queries, &out, &opts)
                } else {
                    att.record_gqa(enc, c, 0, Queries::new(&q, 1, heads, dk), &out, &opts)
                };
            })?;
            res.map(|_| t).map_err(Into::into)
        };
        for &ctx in contexts {
            for (_, c, _) in caches.iter_mut() {
                c.truncate(ctx)?;
            }
            let [a, b, c, d, e, f] = &mut caches[..] else {
                unreachable!("f16, four quantized types and a mixed storage");
            };
            let mut ra = || time(&a.1, &mut a.2);
            let mut rb = || time(&b.1, &mut b.2);
            let mut rc = || time(&c.1, &mut c.2);
            let mut rd = || time(&d.1, &mut d.2);
            let mut re = || time(&e.1, &mut e.2);
            let mut rf = || time(&f.1, &mut f.2);
            let (warm, reps) = (cfg.warm.min(2), cfg.reps.min(9));
            let runs: [&mut dyn FnMut() -> Result<f64>; 6] =
                [&mut ra, &mut rb, &mut rc, &mut rd, &mut re, &mut rf];
            let ts = interleaved(warm, reps, runs)?;
            let times: Vec<(&str, f64)> = caches.iter().map(|x| x.0.as_str()).zip(ts).collect();
            let f16 = times[0].1;
            for &(dtype, t) in &times[1..] {
                rows.push(
                    Row::new(
                        format!("{label} attention over {dtype}, ctx {ctx}"),
                        t * 1e6,
                        "us",
                        timer.clock(),
                    )
                    .ratio(
                        t / f16,
                        format!("the same call over f16 ({:.1} us)", f16 * 1e6),
                        Goal::AtMost(1.0),
                    ),
                );
                eprintln!(
                    "  {label} ctx {ctx}: {dtype} {:.1} us, f16 {:.1} us, ratio {:.2}",
                    t * 1e6,
                    f16 * 1e6,
                    t / f16
                );
            }
        }
    }
    Ok(())
}

/// The decode append step of Llama-3-8B (one row of f32 K and V for each of 32 layers, submit and
/// wait) into quantized storage, against the same step into f16.
fn append(gpu: &Gpu, timer: &Timer, cfg: &Config, rows: &mut Vec<Row>) -> Result<()> {
    let k = values(1024, 21);
    let v = values(1024, 22);
    let shape = [1, 8, 128];
    let mut caches: Vec<(DType, KvCache)> = Vec::new();
    for dtype in [DType::F16, DType::Q8_0, DType::Q4_0, DType::F8E4M3] {
        let spec = CacheSpec::llama3_8b(dtype, 64)?;
        caches.push((dtype, KvCache::new(&gpu.device, &gpu.queue, spec)?));
    }
    let step = |c: &mut KvCache| -> Result<f64> {
        if c.remaining() == 0 {
            c.truncate(0)?;
        }
        timer.host(|| {
            for layer in 0..32 {
                c.append(
                    layer,
                    &[HostSlab::f32(&k, &shape), HostSlab::f32(&v, &shape)],
                )?;
            }
            c.advance(1)?;
            Ok(())
        })
    };
    let (warm, reps) = (cfg.warm, cfg.step_reps.min(40));
    let (f16, rest) = caches.split_at_mut(1);
    let f16 = &mut f16[0].1;
    for (dtype, c) in rest {
        let mut a = || step(f16);
        let mut b = || step(c);
        let [tf, tq] = interleaved(warm, reps, [&mut a, &mut b])?;
        rows.push(
            Row::new(
                format!("decode append step, Llama-3-8B, 32 layers, into {dtype}"),
                tq * 1e6,
                "us",
                Clock::HostWall,
            )
            .ratio(
                tq / tf,
                format!("the same step into f16 ({:.1} us)", tf * 1e6),
                Goal::Info,
            ),
        );
        eprintln!(
            "  append step: {dtype} {:.1} us, f16 {:.1} us",
            tq * 1e6,
            tf * 1e6
        );
    }
    Ok(())
}
