//! What an attention call takes: the rows it reads, queries and output as f32 views of GPU buffers,
//! and the options of the call.

use crate::cache::KvCache;
use crate::paged::PagedCache;
use crate::seq::SeqId;

/// Options of one attention call; the default is plain causal attention with the default scale.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct AttentionOptions {
    /// Multiplies `q·k`. `None`: `1/sqrt(d_k)` for GQA; `1/sqrt(r + p)` for MLA, where models usually
    /// pass their own (DeepSeek-V2 uses `1/sqrt(qk_nope_head_dim + qk_rope_head_dim)`). Scores are
    /// computed in f32: a scale that takes them past f32's range gives unspecified outputs (see the
    /// README's note on precision). A scale that is not finite, or subnormal (not 0), is refused: a
    /// device that flushes subnormals to zero would read it as 0.
    pub scale: Option<f32>,
    /// Sliding window: each query sees its own row and at most `w - 1` rows before it.
    pub window: Option<usize>,
    /// Logit soft-cap: scaled scores become `cap · tanh(score / cap)`. A positive, normal `f32`
    /// (finite, not subnormal) of at most [`MAX_SOFT_CAP`] (2^100); anything else is refused.
    pub soft_cap: Option<f32>,
}

/// The largest soft-cap attention takes, 2^100 (about 1.27e30). A device that flushes subnormals to
/// zero reads `score / cap` as 0 wherever it is subnormal, `|score| < cap · 2^-126`: for caps up to
/// 2^100 that moves a score by at most 2^-26, for larger ones by more (whole units near 2^126, and
/// above 2^126 a device dividing through `1 / cap` reads every score as 0). A cap that large changes
/// no score of a real model: `cap · tanh(s / cap)` is `s`.
pub const MAX_SOFT_CAP: f32 = 1_267_650_600_228_229_401_496_703_205_376.0;

/// Queries in a GPU buffer (which needs `STORAGE` usage): f32 `[n_q, n_heads, dim]`, by default
/// row-major from element 0. [`Queries::at`] and [`Queries::with_strides`] describe any other layout,
/// such as the query part of a fused QKV projection: element `(i, h, e)` is
/// `offset + i·strides[0] + h·strides[1] + e·strides[2]`, counted in f32 elements.
#[derive(Clone, Copy, Debug)]
pub struct Queries<'a> {
    pub buffer: &'a wgpu::Buffer,
    pub shape: [usize; 3],
    /// The f32 element of `(0, 0, 0)`.
    pub offset: usize,
    /// Elements between consecutive queries, heads and elements of a head.
    pub strides: [usize; 3],
}

/// The absorbed queries of MLA: `latent [n_q, n_heads, r]` and `rope [n_q, n_heads, p]`.
#[derive(Clone, Copy, Debug)]
pub struct MlaQueries<'a> {
    pub latent: Queries<'a>,
    pub rope: Queries<'a>,
}

impl<'a> Queries<'a> {
    /// Row-major `[n_q, n_heads, dim]` from the buffer's first element.
    pub fn new(buffer: &'a wgpu::Buffer, n_q: usize, n_heads: usize, dim: usize) -> Self {
        Self {
            buffer,
            shape: [n_q, n_heads, dim],
            offset: 0,
            strides: contiguous([n_q, n_heads, dim]),
        }
    }

    /// The same queries starting at f32 element `offset` (any element: no alignment beyond 4 bytes).
    pub fn at(self, offset: usize) -> Self {
        Self { offset, ..self }
    }

    /// The same queries with element strides `[query, head, element]` (e.g. `[n_heads·dim + 2·kv_dim,
    /// dim, 1]` for rows of a fused `[q | k | v]` projection).
    pub fn with_strides(self, strides: [usize; 3]) -> Self {
        Self { strides, ..self }
    }
}

/// Where attention writes its result `[n_q, n_heads, d_v]` (f32): a buffer with `STORAGE` usage, by
/// default row-major from element 0 (a `&wgpu::Buffer` converts into that). [`Output::at`] and
/// [`Output::with_strides`] place it inside a larger buffer; the strides must not let two output
/// elements share an address, and elements the view does not name are left as they are.
#[derive(Clone, Copy, Debug)]
pub struct Output<'a> {
    pub buffer: &'a wgpu::Buffer,
    /// The f32 element of `(0, 0, 0)`.
    pub offset: usize,
    /// Elements between consecutive queries, heads and elements of a head; `None`: row-major.
    pub strides: Option<[usize; 3]>,
}

impl<'a> Output<'a> {
    /// Row-major from the buffer's first element.
    pub fn new(buffer: &'a wgpu::Buffer) -> Self {
        Self {
            buffer,
            offset: 0,
            strides: None,
        }
    }

    /// The same output starting at f32 element `offset`.
    pub fn at(self, offset: usize) -> Self {
        Self { offset, ..self }
    }

    /// The same output with element strides `[query, head, element]`.
    pub fn with_strides(self, strides: [usize; 3]) -> Self {
        Self {
            strides: Some(strides),
            ..self
        }
    }
}

impl<'a> From<&'a wgpu::Buffer> for Output<'a> {
    fn from(buffer: &'a wgpu::Buffer) -> Self {
        Self::new(buffer)
    }
}

/// Row-major strides of `shape` (saturating: a shape that large is refused before use).
pub(super) fn contiguous(shape: [usize; 3]) -> [usize; 3] {
    [shape[1].saturating_mul(shape[2]), shape[2], 1]
}

/// The rows attention reads: a cache's visible rows (`&cache` converts), one sequence of a paged
/// pool, or a ragged batch of a pool's sequences: `(seq, n)` pairs, each sequence's last `n` visible
/// rows being its queries, in order (decode and chunked-prefill rows mixed in one call).
/// Each pair takes `1 <= n <= visible` ([`crate::Error::QueryRows`] otherwise: unlike
/// [`PagedCache::append_batch`], a pair of 0 rows is refused), and a sequence named twice takes its
/// last `n` rows for each pair: after an `append_batch` that named a sequence twice, name it once
/// with the sum of its rows.
#[derive(Clone, Copy, Debug)]
pub enum Kv<'k> {
    /// A single-sequence cache's visible rows (committed, and this step's appends to the layer).
    Cache(&'k KvCache),
    /// One sequence of a pool: its visible rows (committed, and this step's appends to the layer).
    Sequence(&'k PagedCache, SeqId),
    /// Several sequences of a pool, each with its count of queries.
    Batch(&'k PagedCache, &'k [(SeqId, usize)]),
}

impl Kv<'_> {
    /// Holds a pool's sequences read for `encoder` until its work is done
    /// ([`PagedCache::remove`] and [`PagedCache::truncate`] keep their pages and table rows for it).
    pub(super) fn hold_until_done(self, encoder: &mut wgpu::CommandEncoder) {
        match self {
            Kv::Cache(_) => {}
            Kv::Sequence(pool, seq) => pool.hold_until_done(encoder, [seq]),
            Kv::Batch(pool, batch) => pool.hold_until_done(encoder, batch.iter().map(|&(s, _)| s)),
        }
    }
}

impl<'k> From<&'k KvCache> for Kv<'k> {
    fn from(cache: &'k KvCache) -> Self {
        Kv::Cache(cache)
    }
}

impl<'k> From<&'k mut KvCache> for Kv<'k> {
    fn from(cache: &'k mut KvCache) -> Self {
        Kv::Cache(cache)
    }
}
