//! Turning one checked attention call into commands: the call's checks and plan, its bind groups
//! (the slots' from the cache, queries and output from bounded caches) and both passes.

use super::plan::{self, CallShape, DeviceFacts, Dispatch, Paging, Pass1};
use super::request::{MAX_SOFT_CAP, contiguous};
use super::view::{self, Bound, ViewError};
use super::{Attention, AttentionOptions, Job, KernelChoice, Kv, RetiredGroups, Scratch};
use crate::cache::{AttentionKind, KvCache};
use crate::codec::DType;
use crate::error::{AttentionLimit, AttentionProblem, BufferProblem, Error, Result};
use crate::kernels::{Held, allocated, check_staging, scoped, whole_vectors_within};
use crate::paged::PagedCache;
use crate::seq::SeqId;

/// The checked views of one call; GQA's q_b is its q_a.
struct Views {
    q_a: Bound,
    q_b: Bound,
    out: Bound,
}

impl Attention {
    pub(super) fn record(
        &mut self,
        encoder: &mut wgpu::CommandEncoder,
        rows: Rows<'_>,
        job: Job<'_>,
        options: &AttentionOptions,
    ) -> Result<()> {
        let layer = job.layer;
        let cache = rows.store;
        let (dispatch, views) = self.plan(rows, &job, options)?;
        let (q_a, out) = (job.q_a.buffer, job.out.buffer);
        let q_b = job.q_b.map_or(q_a, |q| q.buffer);
        // Buffers a browser has not verified are refused before a pipeline is built (seconds, and
        // kept in the registry).
        for (buffer, which) in [(q_a, "query"), (q_b, "query"), (out, "output")] {
            crate::verify::known_or_refused(&self.device, buffer, layer, || {
                format!("{which} buffer")
            })?;
        }
        // Then the pipeline: it does not need the scratch. Auto takes the tiled kernel where the
        // device refused the streaming one (a generated kernel it could not compile: kept refused
        // in the registry, so later calls plan it and fall back at once). A forced kernel's
        // refusal is returned after the buffers' checks.
        let (mut dispatch, views, partial) = match self.pass1_pipeline(dispatch.kernel) {
            Err(_) if self.facts.choice == KernelChoice::Auto => {
                let choice = std::mem::replace(&mut self.facts.choice, KernelChoice::Tiled);
                let tiled = self.plan(rows, &job, options);
                self.facts.choice = choice;
                let (dispatch, views) = tiled?;
                let partial = self.pass1_pipeline(dispatch.kernel);
                (dispatch, views, partial)
            }
            partial => (dispatch, views, partial),
        };
        dispatch.params.view_a = views.q_a.view;
        dispatch.params.view_b = views.q_b.view;
        dispatch.params.view_out = views.out.view;
        dispatch.params.direct =
            u32::from(writes_directly(&dispatch, views.out.view, out, [q_a, q_b]));
        // A batch's query table lies in the stats scratch after the partial results: per query its
        // own row and first page-table entry, each biased to a normal f32's bits.
        let (table_words, table_bytes): (Vec<u32>, u64) = match rows.ragged {
            Some(q) => {
                dispatch.params.table_base = (dispatch.stats_bytes / 4) as u32;
                let words = q.iter().flatten().map(|&w| w + plan::QUERY_TABLE_BIAS);
                (words.collect(), plan::QUERY_TABLE_BYTES * q.len() as u64)
            }
            None => (Vec::new(), 0),
        };
        let partial =
            partial.map_err(|detail| plan::refused_at(layer)((AttentionLimit::Kernel, detail)))?;
        let pairs: Vec<_> = dispatch.pairs().collect();
        // Grown before the bind groups, which bind it. A refusal after this (a buffer wgpu will not
        // bind, no memory for the parameter entries or a batch's query table) puts the old scratch
        // and the bind groups cached with it back, so a refused call keeps no new scratch.
        let before = self.scratch.clone();
        let grew = self.ensure_scratch(dispatch.stats_bytes + table_bytes, dispatch.part_bytes)?;
        let Some(scratch) = &self.scratch else {
            return Err(Error::Device {
                reason: "attention scratch buffers are missing".into(),
            });
        };
        let (device, kernels) = (&self.device, &self.kernels);
        let (io_groups, out_groups) = (&mut self.io_groups, &mut self.out_groups);
        let (ring, uploads, queue) = (&mut self.ring, &mut self.uploads, &self.queue);
        let bound = (|| {
            let refused = |which: &'static str| {
                move |e: String| Error::ForeignDevice {
                    layer,
                    what: format!("{which} buffer (wgpu refused to bind it: {e})"),
                }
            };
            let (a, b, o) = (views.q_a, views.q_b, views.out);
            let out_key = (out.clone(), (o.bind_offset, o.bind_size));
            let direct = dispatch.params.direct != 0;
            // The reduce's group: the output and the scratch. Where pass 1 writes the output
            // itself, it is built only to tell which buffer wgpu refused (pass 1's group binds the
            // output too).
            let reduce_group = || {
                let (group, error) = scoped(device, || {
                    device.create_bind_group(&wgpu::BindGroupDescriptor {
                        label: Some("kvgpu attention_reduce"),
                        layout: kernels.reduce_layout(),
                        entries: &[
                            entry(0, scratch.stats.as_entire_binding()),
                            entry(1, scratch.part.as_entire_binding()),
                            entry(2, range(out, &o)),
                        ],
                    })
                });
                error.map_or(Ok(group), |e| Err(refused("output")(e)))
            };
            // Groups made here are kept in the caches only once nothing can refuse the call.
            let io_key = (
                q_a.clone(),
                (a.bind_offset, a.bind_size),
                q_b.clone(),
                (b.bind_offset, b.bind_size),
                direct.then(|| out_key.clone()),
            );
            // (group, whether this call made it)
            let (io, io_made) = match io_groups.get(&io_key) {
                Some(group) => (group, false),
                None => {
                    let part = if direct {
                        range(out, &o)
                    } else {
                        scratch.part.as_entire_binding()
                    };
                    let (group, error) = scoped(device, || {
                        device.create_bind_group(&wgpu::BindGroupDescriptor {
                            label: Some("kvgpu attention io"),
                            layout: kernels.attn_io_layout(),
                            entries: &[
                                entry(0, range(q_a, &a)),
                                entry(1, range(q_b, &b)),
                                entry(2, scratch.stats.as_entire_binding()),
                                entry(3, part),
                            ],
                        })
                    });
                    match error {
                        None => (group, true),
                        Some(e) if direct => {
                            reduce_group()?;
                            return Err(refused("query")(e));
                        }
                        Some(e) => return Err(refused("query")(e)),
                    }
                }
            };
            let reduce = match (direct, out_groups.get(&out_key)) {
                (true, _) => None,
                (false, Some(group)) => Some((group, false)),
                (false, None) => Some((reduce_group()?, true)),
            };
            // The query table's bytes, then the parameter entries: a refusal of either keeps
            // neither (the entries drop the buffers they made; the table's are put back here), and
            // the table is written only once both are there. Copied inside the encoder, so calls
            // recorded one after another each read their own.
            let words: &[u8] = bytemuck::cast_slice(&table_words);
            let mark = uploads.mark();
            let reserved = (|| {
                let what = "a batch's query table";
                let table = if table_bytes > 0 {
                    let upload = uploads.reserve(what, words.len() as u64)?;
                    check_staging(device, what, words.len() as u64)?;
                    Some(upload)
                } else {
                    None
                };
                ring.reserve(pairs.len() as u64)?;
                Ok(table)
            })();
            let table = reserved.inspect_err(|_| uploads.rewind(mark))?;
            if let Some(table) = &table {
                table.write(queue, words);
            }
            if io_made {
                let pins = &[q_a, q_b, out][..if direct { 3 } else { 2 }];
                io_groups.keep(io_key, pins, io.clone());
            }
            if let Some((group, true)) = &reduce {
                out_groups.keep(out_key, &[out], group.clone());
            }
            Ok((io, reduce.map(|(group, _)| group), table))
        })();
        let (io, reduce, table) = match bound {
            Ok(bound) => {
                drop(before);
                bound
            }
            Err(e) => {
                if let Some((io, out)) = grew {
                    // Groups made in this call bound the new scratch; those cached before it, the
                    // old one.
                    self.scratch = before;
                    self.io_groups = io;
                    self.out_groups = out;
                }
                return Err(e);
            }
        };
        let params = self.ring.push_all(&self.queue, &pairs);
        if let Some(table) = table {
            encoder.copy_buffer_to_buffer(
                &table.buffer,
                table.offset,
                &scratch.stats,
                dispatch.stats_bytes,
                table_bytes,
            );
        }
        let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
            label: Some("kvgpu attention"),
            timestamp_writes: None,
        });
        for (pair, params) in pairs.iter().zip(params) {
            pass.set_pipeline(&partial);
            pass.set_bind_group(0, cache.attention_group(layer, job.kind), &[]);
            pass.set_bind_group(1, &io, &[]);
            pass.set_bind_group(2, &params.group, &[params.offset]);
            let (chunks, queries, teams) = dispatch.pass1_grid(pair.q_count);
            pass.dispatch_workgroups(chunks, queries, teams);
            if let Some(reduce) = &reduce {
                pass.set_pipeline(self.kernels.attention_reduce(dispatch.reduce_lanes));
                pass.set_bind_group(0, reduce, &[]);
                pass.set_bind_group(1, &params.group, &[params.offset]);
                pass.dispatch_workgroups(dispatch.pass2, pair.q_count, 1);
            }
        }
        Ok(())
    }

    /// The pass-1 pipeline of a planned kernel, or why the device refused it (only a generated
    /// streaming kernel may be refused).
    fn pass1_pipeline(&self, kernel: Pass1) -> std::result::Result<wgpu::ComputePipeline, String> {
        match kernel {
            Pass1::Tiled {
                dtypes,
                slot_b,
                batch,
                rpl,
                rows,
            } => Ok(self
                .kernels
                .attention_partial(dtypes, slot_b, batch, rpl, rows)
                .pipeline),
            Pass1::Stream(key) => self.stream_pipeline(&key).map(|f| f.pipeline),
        }
    }

    /// Checks everything about one call and works out its dispatch and the bindings of its views;
    /// records nothing.
    fn plan(
        &self,
        rows: Rows<'_>,
        job: &Job<'_>,
        options: &AttentionOptions,
    ) -> Result<(Dispatch, Views)> {
        let layer = job.layer;
        let cache = rows.store;
        let request = |problem: AttentionProblem| Err(Error::AttentionRequest { layer, problem });
        if cache.device() != &self.device {
            return Err(Error::ForeignDevice {
                layer,
                what: "cache (this Attention serves another device)".into(),
            });
        }
        let [n_q, n_heads, d_a] = job.q_a.shape;
        let d_b = job.q_b.map_or(0, |q| q.shape[2]);
        let visible = rows.visible;
        match (rows.ragged, rows.single) {
            (None, Some(batch)) if batch != n_q => {
                return request(AttentionProblem::BatchRows {
                    batch,
                    queries: n_q,
                });
            }
            (None, _) if n_q == 0 || n_q > visible => {
                return Err(Error::QueryRows {
                    seq: rows.seq,
                    layer,
                    n_q,
                    visible,
                });
            }
            (Some(table), _) if table.len() != n_q => {
                return request(AttentionProblem::BatchRows {
                    batch: table.len(),
                    queries: n_q,
                });
            }
            _ => {}
        }
        let scale = options.scale.unwrap_or(job.default_scale);
        // Zero or normal: a device that flushes subnormals to zero would read a subnormal scale as
        // 0 (every score 0) where the twin scales each score.
        if !(scale.is_normal() || scale == 0.0) {
            return request(AttentionProblem::Scale { scale });
        }
        let soft_cap = match options.soft_cap {
            None => 0.0,
            // Normal, not merely non-zero: a device that flushes subnormals to zero would read a
            // subnormal cap as 0, the kernels' "no cap", where the twin caps every score. At most
            // 2^100: such a device also flushes a subnormal `score / cap` to 0, which moves a score
            // by up to `cap · 2^-126` (see `MAX_SOFT_CAP`).
            Some(c) if c.is_normal() && c > 0.0 && c <= MAX_SOFT_CAP => c,
            Some(cap) => return request(AttentionProblem::SoftCap { cap }),
        };
        let window = match options.window {
            None => 0,
            Some(0) => return request(AttentionProblem::EmptyWindow),
            Some(w) => w.min(visible),
        };
        let SlotRows {
            row_words,
            dtypes,
            scales,
            v_from_a,
        } = slot_rows(cache, layer, job.kind, d_a, job.d_v)?;
        let align = self.facts.offset_alignment;
        let check = |which: &'static str,
                     buffer: &wgpu::Buffer,
                     offset: usize,
                     shape: [usize; 3],
                     strides: [usize; 3],
                     written: bool| {
            let problem = |problem: BufferProblem| Error::AttentionBuffer {
                layer,
                which,
                problem,
            };
            match crate::kernels::held(buffer) {
                Held::Mapped => return Err(problem(BufferProblem::Mapped)),
                Held::Destroyed => return Err(problem(BufferProblem::Destroyed)),
                Held::Invalid => return Err(problem(BufferProblem::Invalid)),
                Held::No => {}
            }
            let usage = buffer.usage();
            if !usage.contains(wgpu::BufferUsages::STORAGE) {
                return Err(problem(BufferProblem::NoStorage { usage }));
            }
            let limit = self.facts.max_binding;
            view::bind(buffer.size(), offset, shape, strides, align, limit, written).map_err(|e| {
                match e {
                    ViewError::TooSmall { needed } => Error::BufferTooSmall {
                        layer,
                        which,
                        shape: shape.to_vec(),
                        needed,
                        size: buffer.size(),
                    },
                    ViewError::Overflow => problem(BufferProblem::Overflow {
                        shape: shape.to_vec(),
                        offset,
                        strides: strides.to_vec(),
                    }),
                    ViewError::TooLarge { bytes } => problem(BufferProblem::BindingTooLarge {
                        shape: shape.to_vec(),
                        bytes,
                        limit,
                    }),
                    ViewError::Overlapping => problem(BufferProblem::Overlapping {
                        shape: shape.to_vec(),
                        strides: strides.to_vec(),
                    }),
                }
            })
        };
        let name_a = if job.q_b.is_some() { "q_latent" } else { "q" };
        let q = job.q_a;
        let bound_a = check(name_a, q.buffer, q.offset, q.shape, q.strides, false)?;
        let bound_b = match job.q_b {
            Some(q) => check("q_rope", q.buffer, q.offset, q.shape, q.strides, false)?,
            None => bound_a,
        };
        let out_shape = [n_q, n_heads, job.d_v];
        let out = job.out;
        let out_strides = out.strides.unwrap_or(contiguous(out_shape));
        let bound_out = check(
            "output",
            out.buffer,
            out.offset,
            out_shape,
            out_strides,
            true,
        )?;
        if cache.owns_buffer(out.buffer) {
            return Err(Error::AttentionBuffer {
                layer,
                which: "output",
                problem: BufferProblem::IsSlot,
            });
        }
        let queries = [(name_a, job.q_a.buffer, bound_a)]
            .into_iter()
            .chain(job.q_b.map(|q| ("q_rope", q.buffer, bound_b)));
        for (which, buffer, bound) in queries {
            let (o, q) = (bound_out.span, bound.span);
            if buffer == out.buffer && o.0 < q.1 && q.0 < o.1 {
                return Err(Error::AttentionBuffer {
                    layer,
                    which: "output",
                    problem: BufferProblem::AliasesQueries {
                        which,
                        out: o,
                        queries: q,
                    },
                });
            }
        }
        let shape = CallShape {
            dtypes,
            scales,
            n_q,
            n_heads,
            n_kv: job.n_kv,
            d_a,
            d_b,
            d_v: job.d_v,
            visible,
            row_words,
            window,
            scale,
            soft_cap,
            v_from_a,
            paging: rows.paging,
            // The first row any query of a batch sees, and the rows they see together.
            ragged: rows.ragged.map(|table| {
                let first = |last: usize| match window {
                    0 => 0,
                    w => (last + 1).saturating_sub(w),
                };
                plan::Ragged {
                    lo: table
                        .iter()
                        .map(|&[last, _]| first(last as usize))
                        .min()
                        .unwrap_or(0),
                    // (Saturating: on a 32-bit target a batch's rows may outnumber `usize`.)
                    seen: table
                        .iter()
                        .map(|&[last, _]| last as usize + 1 - first(last as usize))
                        .fold(0, usize::saturating_add),
                }
            }),
        };
        let dispatch = plan::plan(&shape, &self.facts).map_err(plan::refused_at(layer))?;
        Ok((
            dispatch,
            Views {
                q_a: bound_a,
                q_b: bound_b,
                out: bound_out,
            },
        ))
    }

    /// Grows the scratch buffers when this call needs more than they hold. When it did, the bind
    /// groups cached so far (which name the old ones) move out and come back, for a refused call to
    /// put back with the old scratch. A device that cannot allocate them refuses with
    /// [`Error::OutOfMemory`], and the old ones stay.
    pub(super) fn ensure_scratch(
        &mut self,
        stats_bytes: u64,
        part_bytes: u64,
    ) -> Result<Option<RetiredGroups>> {
        if let Some(s) = &self.scratch
            && s.stats.size() >= stats_bytes
            && s.part.size() >= part_bytes
        {
            return Ok(None);
        }
        let old = self
            .scratch
            .as_ref()
            .map_or((0, 0), |s| (s.stats.size(), s.part.size()));
        let grow = |old: u64, needed: u64| grown_scratch(old, needed, self.facts.max_binding);
        let buffer = |label: &str, size: u64| {
            self.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some(label),
                size,
                // COPY_DST: a batch's query table is copied in after the partial results' room.
                usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            })
        };
        let sizes = (grow(old.0, stats_bytes), grow(old.1, part_bytes));
        let scratch = allocated(
            &self.device,
            "attention's scratch buffers",
            sizes.0 + sizes.1,
            || Scratch {
                stats: buffer("kvgpu attention stats", sizes.0),
                part: buffer("kvgpu attention partials", sizes.1),
            },
        )?;
        self.scratch = Some(scratch);
        Ok(Some((self.io_groups.take(), self.out_groups.take())))
    }
}

/// Bytes of a scratch buffer that holds `needed` (at most `max_binding`, the planner's bound) and
/// had `old`: the next power of two, within the binding limit rounded down to whole 16-byte vectors
/// (Vulkan and DX12 report 2<sup>31</sup> - 1 bytes, which no storage binding may be).
fn grown_scratch(old: u64, needed: u64, max_binding: u64) -> u64 {
    needed
        .max(old)
        .next_power_of_two()
        .min(whole_vectors_within(max_binding).max(needed))
        .max(16)
}

/// Whether pass 1 writes the call's output itself (`AttnParams::direct`): a streaming kernel, one
/// chunk and one dispatch pair, so every query and head has one partial result, already the output
/// once normalised (the reduce's one weight would be exp(0) = 1); an output view with the partial
/// results' layout (`[n_q, n_heads, d_v]`, contiguous, at the start of its binding, whole 16-byte
/// vectors), so it can be bound in their place; and a buffer no query is read from, since one
/// dispatch may not both read and write a buffer.
fn writes_directly(
    d: &Dispatch,
    out_view: [u32; 4],
    out: &wgpu::Buffer,
    queries: [&wgpu::Buffer; 2],
) -> bool {
    let p = &d.params;
    matches!(d.kernel, Pass1::Stream(_))
        && p.n_chunks == 1
        && d.q_per_pair >= p.n_q as usize
        && p.d_v.is_multiple_of(4)
        && out_view[0] == 0
        && out_view[3] == 1
        // (The views give a dimension of one element stride 0.)
        && (p.n_heads == 1 || out_view[2] == p.d_v)
        && (p.n_q == 1 || u64::from(out_view[1]) == u64::from(p.n_heads) * u64::from(p.d_v))
        && queries.iter().all(|&q| q != out)
}

// A query table entry as the recorder writes it is the planner's size.
const _: () = assert!(std::mem::size_of::<[u32; 2]>() as u64 == plan::QUERY_TABLE_BYTES);

/// The rows one call reads: the visible rows of a cache's layer, or of a sequence of a paged pool
/// (whose pages are the slot buffers of `store`, read through its page table).
#[derive(Clone, Copy)]
pub(super) struct Rows<'a> {
    pub store: &'a KvCache,
    pub visible: usize,
    pub paging: Option<Paging>,
    /// A batch of sequences: per query, its own row and first page-table entry.
    pub ragged: Option<&'a [[u32; 2]]>,
    /// The queries a batch of one sequence declares (read as that sequence's last rows, without a
    /// query table).
    pub single: Option<usize>,
    /// The pool's sequence read, for errors that name it (one sequence, or a batch of one).
    pub seq: Option<SeqId>,
}

impl<'a> Rows<'a> {
    /// The rows `kv` names in `layer` for a call of `n_q` queries; a batch's per-query rows go to
    /// `table`.
    pub(super) fn of(
        kv: Kv<'a>,
        layer: usize,
        n_q: usize,
        facts: &DeviceFacts,
        table: &'a mut Vec<[u32; 2]>,
    ) -> Result<Self> {
        match kv {
            Kv::Cache(cache) => Self::of_cache(cache, layer),
            Kv::Sequence(pool, seq) => Self::of_sequence(pool, seq, layer),
            Kv::Batch(pool, batch) => Self::of_batch(pool, layer, batch, n_q, facts, table),
        }
    }

    /// The visible rows of `layer` of `cache`.
    pub(super) fn of_cache(cache: &'a KvCache, layer: usize) -> Result<Self> {
        Ok(Self {
            store: cache,
            visible: cache.visible(layer)?,
            paging: None,
            ragged: None,
            single: None,
            seq: None,
        })
    }

    /// The visible rows of `layer` of `seq` in `pool`.
    pub(super) fn of_sequence(pool: &'a PagedCache, seq: SeqId, layer: usize) -> Result<Self> {
        Ok(Self {
            store: pool.store(),
            visible: pool.visible(seq, layer)?,
            paging: Some(pool.paging(seq)?),
            ragged: None,
            single: None,
            seq: Some(seq),
        })
    }

    /// A batch of `pool`'s sequences in `layer`: per `(seq, n)` its last `n` visible rows' queries, in
    /// order. `table` receives each query's own row and first page-table entry, once the counts
    /// are found to add up to the call's `n_q` queries, every entry is checked, and `n_q` fits one
    /// dispatch dimension (as the planner asks later): a batch that names one long sequence again
    /// and again builds no table of more queries than a device runs.
    pub(super) fn of_batch(
        pool: &'a PagedCache,
        layer: usize,
        batch: &[(SeqId, usize)],
        n_q: usize,
        facts: &DeviceFacts,
        table: &'a mut Vec<[u32; 2]>,
    ) -> Result<Self> {
        if let &[(seq, n_q)] = batch {
            // One sequence: its last n_q rows, as `Kv::Sequence` reads them (no query table).
            return Ok(Self {
                single: Some(n_q),
                ..Self::of_sequence(pool, seq, layer)?
            });
        }
        let counted = batch
            .iter()
            .try_fold(0usize, |sum, &(_, n)| sum.checked_add(n));
        if counted != Some(n_q) && !batch.is_empty() {
            return Err(Error::AttentionRequest {
                layer,
                problem: AttentionProblem::BatchRows {
                    batch: counted.unwrap_or(usize::MAX),
                    queries: n_q,
                },
            });
        }
        let mut longest = 0;
        let mut paging = None;
        let mut runs = Vec::with_capacity(batch.len());
        for &(seq, n) in batch {
            let visible = pool.visible(seq, layer)?;
            if n == 0 || n > visible {
                return Err(Error::QueryRows {
                    seq: Some(seq),
                    layer,
                    n_q: n,
                    visible,
                });
            }
            let p = pool.paging(seq)?;
            // Row numbers and table entries within a binding of 4-byte words: below 2^30, far
            // under what a query table holds (checked all the same).
            let word = |x: usize| {
                u32::try_from(x)
                    .ok()
                    .filter(|&w| w <= plan::QUERY_TABLE_MAX)
            };
            let (Some(_), Some(base)) = (word(visible - 1), word(p.table_base)) else {
                let detail = format!(
                    "sequence {seq}: row {} or page-table entry {} is past what a query table \
                     holds ({})",
                    visible - 1,
                    p.table_base,
                    plan::QUERY_TABLE_MAX
                );
                return Err(plan::refused_at(layer)((
                    AttentionLimit::QueryTable,
                    detail,
                )));
            };
            runs.push((visible - n..visible, base));
            longest = longest.max(visible);
            paging = Some(p);
        }
        let Some(paging) = paging else {
            return Err(Error::AttentionRequest {
                layer,
                problem: AttentionProblem::EmptyBatch,
            });
        };
        plan::fits_dimension(n_q, "queries", facts).map_err(plan::refused_at(layer))?;
        for (rows, base) in runs {
            table.extend(rows.map(|last| [last as u32, base]));
        }
        Ok(Self {
            store: pool.store(),
            visible: longest,
            paging: Some(paging),
            ragged: Some(table),
            single: None,
            seq: None,
        })
    }
}

/// The bytes of `buffer` a view is bound to.
fn range<'a>(buffer: &'a wgpu::Buffer, view: &Bound) -> wgpu::BindingResource<'a> {
    wgpu::BindingResource::Buffer(wgpu::BufferBinding {
        buffer,
        offset: view.bind_offset,
        size: wgpu::BufferSize::new(view.bind_size),
    })
}

fn entry(binding: u32, resource: wgpu::BindingResource<'_>) -> wgpu::BindGroupEntry<'_> {
    wgpu::BindGroupEntry { binding, resource }
}

/// The slots `kind` binds as a, b and v on `layer`, as the planner sees them.
pub(super) struct SlotRows {
    /// Row widths in words.
    pub row_words: [usize; 3],
    /// Storage types.
    pub dtypes: [DType; 3],
    /// Scales (1 but for scaled fp8 slots).
    pub scales: [f32; 3],
    /// The values are slot a's elements (MLA's latent: slot v is slot a and `d_v == d_a`).
    pub v_from_a: bool,
}

pub(super) fn slot_rows(
    cache: &KvCache,
    layer: usize,
    kind: AttentionKind,
    d_a: usize,
    d_v: usize,
) -> Result<SlotRows> {
    // A slot buffer the app destroyed through a view would fail the submission.
    cache.check_layer_usable(layer)?;
    let (a, b, v) = kind.slots();
    let words = |slot: usize| -> Result<usize> {
        Ok((cache.slot_view(layer, slot, true)?.row_bytes / 4) as usize)
    };
    let dtype = |slot: usize| cache.spec().slot_dtype(layer, slot);
    let scale = |slot: usize| Ok::<_, Error>(cache.spec().slot_scale(layer, slot)?.unwrap_or(1.0));
    Ok(SlotRows {
        row_words: [words(a)?, words(b)?, words(v)?],
        dtypes: [dtype(a)?, dtype(b)?, dtype(v)?],
        scales: [scale(a)?, scale(b)?, scale(v)?],
        v_from_a: a == v && d_a == d_v,
    })
}

#[cfg(test)]
mod tests {
    use super::grown_scratch;

    /// Scratch buffers grow by powers of two, stay whole 16-byte vectors within the binding limit,
    /// and are never smaller than a call needs.
    #[test]
    fn scratch_stays_within_a_limit_that_is_not_whole_vectors() {
        let odd = (1 << 31) - 1;
        assert_eq!(grown_scratch(0, 1_610_612_736, odd), (1 << 31) - 16);
        assert_eq!(grown_scratch(0, 100, odd), 128);
        assert_eq!(grown_scratch(256, 100, odd), 256);
        assert_eq!(grown_scratch(0, 4, odd), 16);
        // A need within the limit's last 15 bytes is met exactly (the planner keeps it within).
        assert_eq!(grown_scratch(0, odd - 3, odd), odd - 3);
        assert_eq!(grown_scratch(0, 96 << 20, 128 << 20), 128 << 20);
    }
}
