//! The browser demo: pick a model shape, a storage type and a context length, press Run, and a
//! prefill plus decode steps run on WebGPU through kvgpu's public API — every step appends K/V (or MLA
//! latents) to every layer of a `KvCache` and runs `Attention` over the visible rows — checked against
//! the CPU twins of `kvgpu::reference`. The page shows the adapter, the timings, a `verified: ...`
//! line and a chart of the time per step and the cache's memory. Build and serve it with
//! `bash examples/web/build.sh` (see README).

#[cfg(not(target_arch = "wasm32"))]
fn main() {
    eprintln!(
        "this example runs in the browser: bash examples/web/build.sh, then serve target/web-demo"
    );
}

#[cfg(target_arch = "wasm32")]
mod chart;
#[cfg(target_arch = "wasm32")]
mod run;

#[cfg(target_arch = "wasm32")]
fn main() {
    wasm_bindgen_futures::spawn_local(async {
        if let Err(e) = page::start().await {
            page::Log::open().line(&format!("error: {e}"));
            page::show("result", &format!("error: {e}"));
        }
    });
}

#[cfg(target_arch = "wasm32")]
mod page {
    use std::cell::RefCell;
    use std::rc::Rc;
    use std::sync::Arc;

    use kvgpu::{DType, Gpu, Kernels};
    use wasm_bindgen::JsCast;
    use wasm_bindgen::closure::Closure;

    use crate::{chart, run};

    /// The adapter and its kernel registry, opened once and shared by every run.
    struct Session {
        gpu: Gpu,
        kernels: Arc<Kernels>,
        adapter: String,
    }

    fn document() -> Option<web_sys::Document> {
        web_sys::window().and_then(|w| w.document())
    }

    fn element(id: &str) -> Option<web_sys::Element> {
        document().and_then(|d| d.get_element_by_id(id))
    }

    /// Sets the text of the element `id`.
    pub fn show(id: &str, text: &str) {
        if let Some(el) = element(id) {
            el.set_text_content(Some(text));
        }
    }

    fn select(id: &str) -> String {
        element(id)
            .and_then(|e| e.dyn_into::<web_sys::HtmlSelectElement>().ok())
            .map(|s| s.value())
            .unwrap_or_default()
    }

    fn set_busy(busy: bool) {
        if let Some(b) =
            element("run").and_then(|e| e.dyn_into::<web_sys::HtmlButtonElement>().ok())
        {
            b.set_disabled(busy);
        }
    }

    fn now_ms() -> f64 {
        web_sys::window()
            .and_then(|w| w.performance())
            .map_or(0.0, |p| p.now())
    }

    /// The log box: lines added to what it shows (unless it still says "loading…"), so a message the
    /// page wrote itself, such as a missing WebGPU, stays.
    pub struct Log(String);

    impl Log {
        pub fn open() -> Self {
            let text = element("log")
                .and_then(|e| e.text_content())
                .unwrap_or_default();
            Log(if text.starts_with("loading") {
                String::new()
            } else {
                text
            })
        }

        /// A log box that shows `first` and what is added after it.
        fn starting_with(first: &str) -> Self {
            let mut log = Log(String::new());
            log.line(first);
            log
        }

        pub fn line(&mut self, line: &str) {
            if !self.0.is_empty() && !self.0.ends_with('\n') {
                self.0.push('\n');
            }
            self.0.push_str(line);
            self.0.push('\n');
            show("log", &self.0);
        }
    }

    /// Opens the adapter and its pipelines' registry, then wires the Run button.
    pub async fn start() -> Result<(), String> {
        let gpu = Gpu::from_env().await.map_err(|e| e.to_string())?;
        let info = gpu.adapter.get_info();
        let name = if info.name.is_empty() {
            "name hidden by the browser".to_string()
        } else {
            info.name.clone()
        };
        let adapter = format!(
            "adapter: {name} ({:?}, {:?}), max storage binding {} bytes",
            info.backend,
            info.device_type,
            gpu.limits().max_storage_buffer_binding_size
        );
        Log::open().line(&adapter);
        let kernels = Kernels::new(&gpu.device, &gpu.queue).map_err(|e| e.to_string())?;
        let session = Rc::new(Session {
            gpu,
            kernels,
            adapter,
        });
        let busy = Rc::new(RefCell::new(false));
        let on_click = Closure::<dyn FnMut()>::new(move || {
            if busy.replace(true) {
                return;
            }
            let (session, busy) = (session.clone(), busy.clone());
            set_busy(true);
            wasm_bindgen_futures::spawn_local(async move {
                click(&session).await;
                busy.replace(false);
                set_busy(false);
            });
        });
        let button = element("run").ok_or("the page has no Run button")?;
        button
            .add_event_listener_with_callback("click", on_click.as_ref().unchecked_ref())
            .map_err(|e| format!("cannot listen to the Run button: {e:?}"))?;
        on_click.forget();
        set_busy(false);
        show(
            "result",
            "ready: pick a model shape, a storage type and a context length, then press Run",
        );
        Ok(())
    }

    /// Reads the controls, runs, and shows the log lines, the verification line and the chart.
    async fn click(session: &Session) {
        show("result", "running…");
        show("chart", "");
        let mut log = Log::starting_with(&session.adapter);
        let choice = match choice() {
            Ok(c) => c,
            Err(e) => {
                log.line(&format!("error: {e}"));
                show("result", &format!("error: {e}"));
                return;
            }
        };
        log.line(&format!(
            "run: {} storage, context {}",
            choice.dtype, choice.context
        ));
        let mut sink = |line: &str| log.line(line);
        let outcome = run::run(&session.gpu, &session.kernels, &choice, &mut sink, &now_ms).await;
        match outcome {
            Ok(o) => {
                if let Some(el) = element("chart") {
                    el.set_inner_html(&chart::svg(o.prefill, &o.steps, o.allocated));
                }
                show(
                    "result",
                    &format!(
                        "verified: {} steps, max abs error {:e} ({}, {}, context {}; prefill {:.1} ms)",
                        o.checked_steps,
                        o.max_err,
                        choice.preset.key,
                        choice.dtype,
                        choice.context,
                        o.prefill_ms
                    ),
                );
            }
            Err(e) => {
                log.line(&format!("error: {e}"));
                show("result", &format!("error: {e}"));
            }
        }
    }

    fn choice() -> Result<run::Choice, String> {
        let key = select("preset");
        let preset = run::preset(&key).ok_or(format!("unknown preset {key:?}"))?;
        let dtype = match select("dtype").as_str() {
            "f32" => DType::F32,
            "f16" => DType::F16,
            "bf16" => DType::BF16,
            other => return Err(format!("unknown storage type {other:?}")),
        };
        let context = select("context")
            .parse::<usize>()
            .map_err(|_| format!("context {:?} is not a number", select("context")))?;
        Ok(run::Choice {
            preset,
            dtype,
            context,
        })
    }
}
