//! The browser demo: a decode-like simulation of a DeepSeek-V2-Lite MLA cache over WebGPU. It prefills
//! some tokens, appends one token per step to every layer, reads the cache back and checks every stored
//! word against the CPU model, showing the adapter, the cache size, per-step timings and the result in
//! the page. Build and serve it with `bash examples/web/build.sh` (see README).

#[cfg(not(target_arch = "wasm32"))]
fn main() {
    eprintln!(
        "this example runs in the browser: bash examples/web/build.sh, then serve target/web-demo"
    );
}

#[cfg(target_arch = "wasm32")]
fn main() {
    wasm_bindgen_futures::spawn_local(async {
        let result = match demo::run().await {
            Ok(line) => line,
            Err(e) => format!("error: {e}"),
        };
        demo::show("result", &result);
    });
}

#[cfg(target_arch = "wasm32")]
mod demo {
    use kvgpu::reference::{CpuCache, host_bits};
    use kvgpu::{CacheSpec, DType, Gpu, HostData, HostSlab, KvCache};

    const PREFILL: usize = 16;
    const DECODE_STEPS: usize = 16;

    /// Sets the text of the element `id`.
    pub fn show(id: &str, text: &str) {
        if let Some(el) = web_sys::window()
            .and_then(|w| w.document())
            .and_then(|d| d.get_element_by_id(id))
        {
            el.set_text_content(Some(text));
        }
    }

    fn log(lines: &mut String, line: &str) {
        lines.push_str(line);
        lines.push('\n');
        show("log", lines);
    }

    fn now_ms() -> f64 {
        web_sys::window()
            .and_then(|w| w.performance())
            .map_or(0.0, |p| p.now())
    }

    /// Deterministic pseudo-random values in [-2, 2).
    fn values(seed: u64, n: usize) -> Vec<f32> {
        kvgpu::reference::pseudo_random(seed, n, 2.0)
    }

    /// Appends `n` rows to every slot of every layer, on the GPU and in the CPU model.
    fn step(c: &mut KvCache, cpu: &mut CpuCache, seed: u64, n: usize) -> kvgpu::Result<()> {
        let spec = c.spec().clone();
        for (l, layer) in spec.layers().iter().enumerate() {
            let row = c.visible(l)?;
            let data: Vec<Vec<f32>> = layer
                .slots
                .iter()
                .enumerate()
                .map(|(s, slot)| values(seed * 1000 + (l * 4 + s) as u64, n * slot.row_elems()))
                .collect();
            let shapes: Vec<Vec<usize>> = layer
                .slots
                .iter()
                .map(|slot| [&[n][..], &slot.trailing].concat())
                .collect();
            let slabs: Vec<HostSlab<'_>> = data
                .iter()
                .zip(&shapes)
                .map(|(d, sh)| HostSlab::f32(d, sh))
                .collect();
            c.append(l, &slabs)?;
            for (s, d) in data.iter().enumerate() {
                cpu.write_rows(l, s, row, &host_bits(HostData::F32(d), spec.dtype()));
            }
        }
        c.advance(n)
    }

    pub async fn run() -> Result<String, String> {
        let mut lines = String::new();
        let gpu = Gpu::from_env().await.map_err(|e| e.to_string())?;
        let info = gpu.adapter.get_info();
        let name = if info.name.is_empty() {
            "name hidden by the browser".to_string()
        } else {
            info.name.clone()
        };
        log(
            &mut lines,
            &format!(
                "adapter: {name} ({:?}, {:?}), max storage binding {} bytes",
                info.backend,
                info.device_type,
                gpu.limits().max_storage_buffer_binding_size
            ),
        );
        let dtype = DType::F16;
        let spec = CacheSpec::deepseek_v2_lite(dtype, PREFILL + DECODE_STEPS)
            .map_err(|e| e.to_string())?;
        log(
            &mut lines,
            &format!(
                "cache: DeepSeek-V2-Lite MLA, {} layers, {dtype}, {} tokens, {} bytes/token, {} bytes",
                spec.n_layers(),
                spec.max_seq_len(),
                spec.bytes_per_token(),
                spec.total_bytes()
            ),
        );
        let mut c =
            KvCache::new(&gpu.device, &gpu.queue, spec.clone()).map_err(|e| e.to_string())?;
        let mut cpu = CpuCache::new(&spec);

        // Each timed step: host appends to all layers, advance, and a readback of the last layer's
        // k_pe rows, which waits for the GPU to finish the step.
        let last = spec.n_layers() - 1;
        log(
            &mut lines,
            "timed step = host appends to every layer + advance + readback of the last layer's k_pe \
             (waits for the GPU)",
        );
        let mut times = Vec::new();
        for s in 0..=DECODE_STEPS {
            let n = if s == 0 { PREFILL } else { 1 };
            let t0 = now_ms();
            step(&mut c, &mut cpu, s as u64 + 1, n).map_err(|e| e.to_string())?;
            let rows = c
                .read_words_async(last, 1)
                .await
                .map_err(|e| e.to_string())?;
            let ms = now_ms() - t0;
            let what = if s == 0 { "prefill" } else { "decode" };
            log(
                &mut lines,
                &format!(
                    "step {s:2} {what:7} +{n:2} rows -> len {:2}: {ms:.2} ms ({} words read)",
                    c.len(),
                    rows.len()
                ),
            );
            times.push(ms);
        }
        let decode = &times[1..];
        log(
            &mut lines,
            &format!(
                "decode steps: mean {:.2} ms, min {:.2} ms, max {:.2} ms",
                decode.iter().sum::<f64>() / decode.len() as f64,
                decode.iter().copied().fold(f64::INFINITY, f64::min),
                decode.iter().copied().fold(0.0, f64::max)
            ),
        );

        // Read every slot back and compare with the CPU model.
        let mut max_err = 0.0f32;
        let mut words_checked = 0usize;
        for (l, layer) in spec.layers().iter().enumerate() {
            for s in 0..layer.slots.len() {
                let got = c.read_f32_async(l, s).await.map_err(|e| e.to_string())?;
                let want = cpu.read_f32(l, s, c.len());
                if got.len() != want.len() {
                    return Err(format!(
                        "layer {l} slot {s}: {} values read, {} expected",
                        got.len(),
                        want.len()
                    ));
                }
                for (g, w) in got.iter().zip(&want) {
                    max_err = max_err.max((g - w).abs());
                }
                let words = c
                    .read_full_words_async(l, s)
                    .await
                    .map_err(|e| e.to_string())?;
                if words != cpu.words[l][s] {
                    return Err(format!(
                        "layer {l} slot {s}: stored words differ from the CPU model"
                    ));
                }
                words_checked += words.len();
            }
        }
        log(
            &mut lines,
            &format!("{words_checked} stored words equal the CPU model"),
        );
        if max_err > 0.0 {
            return Err(format!("max abs error {max_err} against the CPU model"));
        }
        Ok(format!(
            "verified: {} steps, max abs error {max_err}",
            DECODE_STEPS + 1
        ))
    }
}
