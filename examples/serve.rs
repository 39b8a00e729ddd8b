//! Serves several requests from one paged pool, as a continuous-batching server would: a system
//! prompt is prefilled once, every request forks it (sharing its pages; with `--prefix-cache` its whole
//! pages are published and every request starts from them), prefills its own prompt and decodes token
//! by token next to the others. A request is admitted only when the pool says its rows
//! fit; when a decode step would not fit, the newest request is preempted (its pages freed) and
//! restarts later. Each step appends K/V (or MLA latents) to every attention layer of every running
//! request, then runs attention of all of them as one ragged batch per layer
//! (`Attention::record_gqa` / `record_mla` over `Kv::Batch`); a sample of outputs is checked against the
//! CPU twins over rows regenerated on the host (so shared and copied pages are checked too).
//!
//! `cargo run --release --example serve -- --help` lists the flags and their defaults.
//!
//! The last line is `verified: <checks> checks, max abs error <e>`; the exit status is non-zero when
//! an output differs from the reference by more than `1e-4 · (1 + |reference|)`.
// Native only: it uses the blocking helpers.
#![cfg_attr(target_arch = "wasm32", no_main)]
#![cfg(not(target_arch = "wasm32"))]

use std::collections::VecDeque;
use std::process::ExitCode;
use std::time::Instant;

use clap::Parser;

#[path = "shared/check.rs"]
mod check;
#[path = "shared/cli.rs"]
mod cli;
use cli::{
    Model, SlotStorage, Storage, count, describe_storage, query_heads, slot_storage,
    with_slot_storage,
};
use kvgpu::{
    Attention, AttentionOptions, CacheSpec, DType, Gpu, HostSlab, Kv, MlaQueries, PagedCache,
    Queries, SeqId, reference,
};

/// Serves requests that share a system prompt from one paged KV pool on the default GPU adapter:
/// admission, forks that share pages, decode steps of every running request, preemption when the pool
/// is full, and a CPU check of a sample of attention outputs. No model weights run: the tokens/s it
/// reports are the cache's and attention's alone, not a model's throughput.
///
/// The adapter is chosen with WGPU_BACKEND (vulkan, gl, metal, dx12).
#[derive(Parser, Debug)]
#[command(
    name = "serve",
    allow_negative_numbers = true,
    after_help = "The last line is `verified: <checks> checks, max abs error <e>`; the exit status \
                  is non-zero when an output differs from the CPU reference by more than \
                  1e-4 * (1 + |reference|)."
)]
struct Args {
    /// Model whose cache shapes and query heads to use
    #[arg(long, value_enum, default_value_t = Model::Qwen3_0_6b)]
    model: Model,
    /// Element type the cache stores (attention computes in f32)
    #[arg(long, value_enum, default_value_t = Storage::F16)]
    dtype: Storage,
    /// A slot stored in its own type, SLOT=TYPE (repeatable): `v=q4_0` keeps values in q4_0 whatever
    /// --dtype says, `k_pe=f16` DeepSeek's rope key in f16
    #[arg(long = "slot-dtype", value_name = "SLOT=TYPE", value_parser = slot_storage)]
    slot_dtype: Vec<SlotStorage>,
    /// Requests to serve, 1 to 256
    #[arg(long, default_value_t = 8, value_parser = |s: &str| count(s, 256))]
    requests: usize,
    /// Tokens of the system prompt every request shares, 1 to 1024
    #[arg(long, default_value_t = 40, value_parser = |s: &str| count(s, 1024))]
    system: usize,
    /// Tokens of each request's own prompt, 1 to 1024
    #[arg(long, default_value_t = 8, value_parser = |s: &str| count(s, 1024))]
    prompt: usize,
    /// Tokens each request decodes, 1 to 1024
    #[arg(long, default_value_t = 16, value_parser = |s: &str| count(s, 1024))]
    tokens: usize,
    /// Token rows per page, 1 to 1024
    #[arg(long, default_value_t = 16, value_parser = |s: &str| count(s, 1024))]
    page_size: usize,
    /// Pages in the pool, 1 to 1048576 (few pages make requests wait and get preempted)
    #[arg(long, default_value_t = 12, value_parser = |s: &str| count(s, 1 << 20))]
    pages: usize,
    /// Publish the system prompt's whole pages under its tokens and start every request from them
    /// (`add_sequence_with_prefix`), instead of forking a sequence that holds it: each request
    /// computes the rows of the partly filled last page itself
    #[arg(long)]
    prefix_cache: bool,
}

/// One request: its sequence while it runs, and how many of its own tokens (prompt, then decoded) it
/// has written.
struct Request {
    id: usize,
    seq: SeqId,
    written: usize,
}

struct Server {
    gpu: Gpu,
    pool: PagedCache,
    attention: Attention,
    options: AttentionOptions,
    n_heads: usize,
    /// The attention layers: index and slot widths (GQA: `[n_kv · d_k, n_kv · d_v]`, MLA: `[r, p]`).
    layers: Vec<(usize, Vec<Vec<usize>>)>,
    system: usize,
    q: wgpu::Buffer,
    out: wgpu::Buffer,
    worst: f32,
    good: bool,
    checks: usize,
}

/// The K/V rows of position `pos` of a layer's slots, written by `owner` (0: the system prompt,
/// `1 + id`: request `id`), as the host sends them.
fn token(owner: usize, layer: usize, slot: usize, pos: usize, width: usize) -> Vec<f32> {
    let seed = (owner as u64) << 40 | (layer as u64) << 24 | (slot as u64) << 20 | pos as u64;
    reference::pseudo_random(seed, width, 1.0)
}

fn width(trailing: &[usize]) -> usize {
    trailing.iter().product()
}

/// The queries of one sequence in a call: its sequence, who wrote its rows after the system prompt
/// (see [`token`]), its first query's row and its query count.
#[derive(Clone, Copy)]
struct Segment {
    seq: SeqId,
    owner: usize,
    from: usize,
    n: usize,
}

impl Server {
    /// Appends rows `[from, from + n)` of each segment's owner to every attention layer of its
    /// sequence and advances it.
    fn append(&mut self, segments: &[Segment]) -> kvgpu::Result<()> {
        for s in segments {
            for (layer, slots) in &self.layers {
                let data: Vec<Vec<f32>> = slots
                    .iter()
                    .enumerate()
                    .map(|(k, t)| {
                        (s.from..s.from + s.n)
                            .flat_map(|p| token(s.owner, *layer, k, p, width(t)))
                            .collect()
                    })
                    .collect();
                let shapes: Vec<Vec<usize>> =
                    slots.iter().map(|t| [&[s.n][..], t].concat()).collect();
                let slabs: Vec<HostSlab> = data
                    .iter()
                    .zip(&shapes)
                    .map(|(d, sh)| HostSlab::f32(d, sh))
                    .collect();
                self.pool.append(s.seq, *layer, &slabs)?;
            }
        }
        // The whole step commits at once (or, refused, none of it).
        let step: Vec<(SeqId, usize)> = segments.iter().map(|s| (s.seq, s.n)).collect();
        self.pool.advance_batch(&step)
    }

    /// Runs attention for every segment's queries in every layer: one ragged batch (one dispatch
    /// pair) per layer. Segment `check` is compared with the CPU twins.
    fn attend(&mut self, segments: &[Segment], check: Option<usize>) -> kvgpu::Result<()> {
        let h = self.n_heads;
        let total: usize = segments.iter().map(|s| s.n).sum();
        let batch: Vec<(SeqId, usize)> = segments.iter().map(|s| (s.seq, s.n)).collect();
        let layers = self.layers.clone();
        for (layer, slots) in &layers {
            // Queries of every segment, in order: element `k` of the call's queries is `d` wide.
            let query = |k: u64, d: usize| -> Vec<f32> {
                segments
                    .iter()
                    .flat_map(|s| {
                        let seed = (s.owner as u64) << 40 | (*layer as u64) << 24 | 1 << 23;
                        reference::pseudo_random(seed | k << 20 | s.from as u64, s.n * h * d, 1.0)
                    })
                    .collect()
            };
            // Where segment `check` starts among the queries.
            let at: usize = segments.iter().take(check.unwrap_or(0)).map(|s| s.n).sum();
            let mut encoder = self.gpu.device.create_command_encoder(&Default::default());
            let trailing: Vec<&[usize]> = slots.iter().map(Vec::as_slice).collect();
            let (want, width_out) = if let [[n_kv, d_k], [_, d_v]] = trailing.as_slice() {
                let q = query(0, *d_k);
                self.gpu
                    .queue
                    .write_buffer(&self.q, 0, bytemuck::cast_slice(&q));
                let queries = Queries::new(&self.q, total, h, *d_k);
                self.attention.record_gqa(
                    &mut encoder,
                    Kv::Batch(&self.pool, &batch),
                    *layer,
                    queries,
                    &self.out,
                    &self.options,
                )?;
                let want = check.map(|c| {
                    let s = segments[c];
                    let rows = self.rows(s.owner, *layer, s.from + s.n);
                    let q = &q[at * h * d_k..(at + s.n) * h * d_k];
                    let shape = [s.n, h, *d_k];
                    reference::attention_gqa(
                        q,
                        shape,
                        &rows[0],
                        &rows[1],
                        *n_kv,
                        *d_v,
                        &self.options,
                    )
                });
                (want, *d_v)
            } else {
                let (r, p) = (slots[0][0], slots[1][0]);
                // The rope queries start at the next 256-byte boundary after the latent ones.
                let half = (total * h * r * 4).next_multiple_of(256);
                let (ql, qr) = (query(0, r), query(1, p));
                self.gpu
                    .queue
                    .write_buffer(&self.q, 0, bytemuck::cast_slice(&ql));
                self.gpu
                    .queue
                    .write_buffer(&self.q, half as u64, bytemuck::cast_slice(&qr));
                let queries = MlaQueries {
                    latent: Queries::new(&self.q, total, h, r),
                    rope: Queries::new(&self.q, total, h, p).at(half / 4),
                };
                self.attention.record_mla(
                    &mut encoder,
                    Kv::Batch(&self.pool, &batch),
                    *layer,
                    queries,
                    &self.out,
                    &self.options,
                )?;
                let want = check.map(|c| {
                    let s = segments[c];
                    let rows = self.rows(s.owner, *layer, s.from + s.n);
                    let ql = &ql[at * h * r..(at + s.n) * h * r];
                    let qr = &qr[at * h * p..(at + s.n) * h * p];
                    reference::attention_mla(
                        ql,
                        qr,
                        [s.n, h, r],
                        &rows[0],
                        &rows[1],
                        p,
                        &self.options,
                    )
                });
                (want, r)
            };
            // The query buffer is reused by the next layer: this one's attention goes first.
            self.gpu.queue.submit([encoder.finish()]);
            if let Some(want) = want {
                self.compare(&want, at * h * width_out)?;
            }
        }
        Ok(())
    }

    /// The first `len` rows of a layer's slots for `owner` (system prompt rows first), as stored.
    fn rows(&self, owner: usize, layer: usize, len: usize) -> Vec<Vec<f32>> {
        let spec = self.pool.spec();
        let slots = &self
            .layers
            .iter()
            .find(|l| l.0 == layer)
            .expect("an attention layer")
            .1;
        slots
            .iter()
            .enumerate()
            .map(|(s, t)| {
                (0..len)
                    .flat_map(|p| {
                        let who = if p < self.system { 0 } else { owner };
                        let row = token(who, layer, s, p, width(t));
                        let dtype = spec.slot_dtype(layer, s).expect("a slot of the layer");
                        reference::round_trip_rows(&row, dtype, row.len())
                    })
                    .collect()
            })
            .collect()
    }

    /// Compares the output from f32 element `at` on with `want`.
    fn compare(&mut self, want: &[f32], at: usize) -> kvgpu::Result<()> {
        let bytes = kvgpu::read_buffer(
            &self.gpu.device,
            &self.gpu.queue,
            &self.out,
            (at * 4) as u64,
            (want.len() * 4) as u64,
        )?;
        let (err, within) = check::compare(bytemuck::cast_slice(&bytes), want);
        self.worst = self.worst.max(err);
        self.good &= within;
        self.checks += 1;
        Ok(())
    }
}

fn main() -> ExitCode {
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
    let start = Instant::now();
    let longest = args.system + args.prompt + args.tokens;
    // The spec first: a slot name the model lacks is refused before an adapter opens.
    let spec = with_slot_storage(
        CacheSpec::preset(args.model.name(), DType::from(args.dtype), longest)?,
        &args.slot_dtype,
    )?;
    let gpu = Gpu::from_env_blocking()?;
    let pool = PagedCache::new(
        &gpu.device,
        &gpu.queue,
        spec.clone(),
        args.page_size,
        args.pages,
    )?;
    let (n_heads, scale) = query_heads(args.model);
    let layers: Vec<(usize, Vec<Vec<usize>>)> = spec
        .layers()
        .iter()
        .enumerate()
        .filter(|(_, l)| !l.slots.is_empty())
        .map(|(i, l)| (i, l.slots.iter().map(|s| s.trailing.clone()).collect()))
        .collect();
    // Queries (MLA: latent, then rope from a 256-byte boundary) and outputs of the largest call: the
    // longest prefill, or a decode step of every request.
    let most = args.system.max(args.prompt).max(args.requests) * n_heads * 4;
    let widest = layers
        .iter()
        .flat_map(|l| l.1.iter().map(|t| *t.last().unwrap_or(&1)))
        .max()
        .unwrap_or(1);
    let buffer = |bytes: usize| {
        gpu.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("serve"),
            size: bytes as u64,
            usage: wgpu::BufferUsages::STORAGE
                | wgpu::BufferUsages::COPY_DST
                | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        })
    };
    let (q, out) = (
        buffer(2 * (most * widest).next_multiple_of(256)),
        buffer(most * widest),
    );
    let mut server = Server {
        attention: Attention::for_pool(&pool),
        gpu,
        pool,
        options: AttentionOptions {
            scale,
            ..Default::default()
        },
        n_heads,
        layers,
        system: args.system,
        q,
        out,
        worst: 0.0,
        good: true,
        checks: 0,
    };
    println!("adapter: {}", server.gpu.describe());
    println!(
        "pool: {} pages of {} tokens, {:.1} KiB/token, {:.1} MiB ({} storage, model {})",
        args.pages,
        args.page_size,
        spec.bytes_per_token() as f64 / 1024.0,
        (spec.bytes_per_token() * (args.pages * args.page_size) as u64) as f64 / (1 << 20) as f64,
        describe_storage(&spec),
        args.model.name()
    );
    let built = server.attention.prepare_paged(&server.pool, n_heads)?;
    println!("pipelines: {built} built (Attention::prepare_paged)");

    // The system prompt, once.
    let system = server.pool.add_sequence()?;
    let prompt = [Segment {
        seq: system,
        owner: 0,
        from: 0,
        n: args.system,
    }];
    server.append(&prompt)?;
    server.attend(&prompt, Some(0))?;
    println!(
        "system prompt: {} tokens in {} pages",
        args.system,
        server.pool.pages_in_use()
    );
    // Token ids of the system prompt (the example's rows are made from (owner, position) alone).
    let system_tokens: Vec<u32> = (0..args.system as u32).collect();
    let mut reused = args.system;
    if args.prefix_cache {
        reused = server.pool.publish_prefix(system, &system_tokens)?;
        server.pool.remove(system)?;
        println!(
            "prefix cache: {reused} rows of the system prompt published in {} pages; the sequence \
             that computed them is removed",
            server.pool.cached_pages()
        );
    }

    let t = Instant::now();
    let mut waiting: VecDeque<usize> = (0..args.requests).collect();
    let mut running: Vec<Request> = Vec::new();
    let (mut steps, mut decoded, mut redone) = (0, 0, 0);
    let (mut preempted, mut peak_pages, mut peak_running) = (0, 0, 0);
    let own = args.prompt + args.tokens;
    while !waiting.is_empty() || !running.is_empty() {
        // Admit waiting requests while their prompt fits next to the running ones' next token.
        while let Some(&id) = waiting.front() {
            let mut growth: Vec<(SeqId, usize)> = running.iter().map(|r| (r.seq, 1)).collect();
            // The system prompt, its prompt and its first decoded token, so it is not preempted by
            // the very next step.
            let len = args.system + args.prompt + 1;
            let seq = if args.prefix_cache {
                // Asked before the sequence is made: a refusal takes no id and leaves the
                // prefix's recency alone.
                if server
                    .pool
                    .admits_new(&system_tokens, len, &growth)
                    .is_err()
                {
                    break;
                }
                let (seq, len) = server.pool.add_sequence_with_prefix(&system_tokens)?;
                debug_assert_eq!(len, reused);
                seq
            } else {
                let seq = server.pool.fork(system, args.system)?;
                // The system prompt's rows are the fork's.
                growth.push((seq, len - args.system));
                if server.pool.admits(&growth).is_err() {
                    server.pool.remove(seq)?;
                    break;
                }
                seq
            };
            waiting.pop_front();
            if reused < args.system {
                server.append(&[Segment {
                    seq,
                    owner: 0,
                    from: reused,
                    n: args.system - reused,
                }])?;
            }
            let prompt = [Segment {
                seq,
                owner: 1 + id,
                from: args.system,
                n: args.prompt,
            }];
            server.append(&prompt)?;
            server.attend(&prompt, (id == 0).then_some(0))?;
            running.push(Request {
                id,
                seq,
                written: args.prompt,
            });
        }
        if running.is_empty() {
            // Not even one request fits next to the system prompt.
            return Err(kvgpu::Error::OutOfPages {
                needed: (args.system + own).div_ceil(args.page_size)
                    - if args.prefix_cache {
                        reused / args.page_size
                    } else {
                        0
                    },
                free: server.pool.free_pages(),
            });
        }
        // A decode step for every running request; preempt the newest while the step does not fit.
        while let Err(e) = server
            .pool
            .admits(&running.iter().map(|r| (r.seq, 1)).collect::<Vec<_>>())
        {
            let Some(newest) = running.pop() else {
                return Err(e);
            };
            server.pool.remove(newest.seq)?;
            waiting.push_front(newest.id);
            preempted += 1;
            redone += newest.written - args.prompt;
            if running.is_empty() {
                // One request alone does not fit: the pool is too small for it.
                return Err(e);
            }
        }
        peak_running = peak_running.max(running.len());
        steps += 1;
        // Every running request's next token, then attention of all of them: one ragged batch per
        // layer. Request 0 is checked at its first and last decode steps.
        let segments: Vec<Segment> = running
            .iter()
            .map(|r| Segment {
                seq: r.seq,
                owner: 1 + r.id,
                from: args.system + r.written,
                n: 1,
            })
            .collect();
        let check = running
            .iter()
            .position(|r| r.id == 0 && (r.written == args.prompt || r.written + 1 == own));
        server.append(&segments)?;
        server.attend(&segments, check)?;
        // A server reads the step's logits before it knows which requests are done: the step's
        // work is finished when it removes them, so the pages they held return at once (a removal
        // before that keeps them for the attention still to run, until the pool's first call after
        // it is done).
        server
            .gpu
            .device
            .poll(wgpu::PollType::wait_indefinitely())
            .map_err(|e| kvgpu::Error::Device {
                reason: e.to_string(),
            })?;
        for r in &mut running {
            r.written += 1;
            decoded += 1;
        }
        peak_pages = peak_pages.max(server.pool.pages_in_use());
        for r in running.iter().filter(|r| r.written == own) {
            server.pool.remove(r.seq)?;
        }
        running.retain(|r| r.written < own);
    }
    let secs = t.elapsed().as_secs_f64();
    let unshared = (args.requests * (args.system + own)).div_ceil(args.page_size);
    println!(
        "served: {} requests, {steps} steps, {decoded} tokens decoded ({redone} of them again after a \
         preemption) in {secs:.2} s ({:.1} tokens/s; cache appends + attention only, no model weights), \
         at most {peak_running} at once, {preempted} preempted",
        args.requests,
        decoded as f64 / secs
    );
    println!(
        "pages: peak {peak_pages} of {}; {unshared} if every request held its own copy of the system \
         prompt; {} in use at the end (the system prompt{})",
        args.pages,
        server.pool.pages_in_use(),
        if args.prefix_cache {
            "'s published pages"
        } else {
            ""
        }
    );
    println!("time: {:.2} s", start.elapsed().as_secs_f64());
    println!(
        "verified: {} checks, max abs error {:e}",
        server.checks, server.worst
    );
    Ok(server.good)
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::*;

    fn parse(args: &[&str]) -> Result<Args, clap::Error> {
        Args::try_parse_from(std::iter::once("serve").chain(args.iter().copied()))
    }

    #[test]
    fn command_is_well_formed() {
        Args::command().debug_assert();
    }

    #[test]
    fn defaults_and_both_value_forms() {
        let a = parse(&[]).unwrap();
        assert_eq!(
            (
                a.requests,
                a.system,
                a.prompt,
                a.tokens,
                a.page_size,
                a.pages
            ),
            (8, 40, 8, 16, 16, 12)
        );
        let a = parse(&[
            "--pages=3",
            "--page-size",
            "1",
            "--model",
            "deepseek-v2-lite",
        ])
        .unwrap();
        assert_eq!(
            (a.pages, a.page_size, a.model),
            (3, 1, Model::DeepseekV2Lite)
        );
        assert!(!a.prefix_cache && parse(&["--prefix-cache"]).unwrap().prefix_cache);
        assert!(parse(&["--prefix-cache=yes"]).is_err());
    }

    #[test]
    fn bad_counts_are_refused_with_their_bounds() {
        for bad in ["0", "-1", "257", "x", "1e3", "18446744073709551617"] {
            let e = parse(&["--requests", bad]).expect_err(bad).to_string();
            assert!(e.contains("from 1 to 256"), "{bad}: {e}");
        }
        assert!(parse(&["--pages", "1048577"]).is_err());
        assert!(parse(&["--dtype", "q2_k"]).is_err());
    }
}
