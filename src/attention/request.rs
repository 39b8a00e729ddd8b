//! What an attention call takes: queries in GPU buffers and the options of the call.

/// Options of one attention call; the default is plain causal attention with the default scale.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct AttentionOptions {
    /// Multiplies `q·k`. `None`: `1/sqrt(d_k)` for GQA; `1/sqrt(r + p)` for MLA, where models usually
    /// pass their own (DeepSeek-V2 uses `1/sqrt(qk_nope_head_dim + qk_rope_head_dim)`).
    pub scale: Option<f32>,
    /// Sliding window: each query sees its own row and at most `w - 1` rows before it.
    pub window: Option<usize>,
    /// Logit soft-cap: scaled scores become `cap · tanh(score / cap)`.
    pub soft_cap: Option<f32>,
}

/// Queries in a GPU buffer: f32, row-major `[n_q, n_heads, dim]`, starting at byte 0. The buffer
/// needs `STORAGE` usage.
#[derive(Clone, Copy, Debug)]
pub struct Queries<'a> {
    pub buffer: &'a wgpu::Buffer,
    pub shape: [usize; 3],
}

/// The absorbed queries of MLA: `latent [n_q, n_heads, r]` and `rope [n_q, n_heads, p]`.
#[derive(Clone, Copy, Debug)]
pub struct MlaQueries<'a> {
    pub latent: Queries<'a>,
    pub rope: Queries<'a>,
}

impl<'a> Queries<'a> {
    pub fn new(buffer: &'a wgpu::Buffer, n_q: usize, n_heads: usize, dim: usize) -> Self {
        Self {
            buffer,
            shape: [n_q, n_heads, dim],
        }
    }

    /// Bytes the shape covers (f32), saturating; checked against the buffer before use.
    pub(super) fn bytes(&self) -> u64 {
        self.shape
            .iter()
            .fold(4u64, |acc, &d| acc.saturating_mul(d as u64))
    }
}
