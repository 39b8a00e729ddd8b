//! Zeroing plans: word ranges of slot buffers turned into dispatches of `shaders/zero.wgsl`. Pure, so
//! the sizing is unit-tested on the CPU.

use crate::kernels::{ZeroParams, grid};

/// 16-byte vectors one zeroing invocation clears per loop step (`BLOCK` in shaders/zero.wgsl).
const ZERO_BLOCK: u64 = 8;

/// Words `[start_word, start_word + n_words)` of one slot buffer to zero.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ZeroRange {
    pub layer: usize,
    pub slot: usize,
    pub start_word: u64,
    pub n_words: u64,
}

/// One dispatch per non-empty range: the range, its workgroups and its parameters. At most
/// `max_groups` workgroups each; invocations stride over the rest.
pub(crate) fn zero_dispatches(
    ranges: &[ZeroRange],
    max_groups: u32,
) -> Vec<(ZeroRange, u32, ZeroParams)> {
    ranges
        .iter()
        .filter(|r| r.n_words > 0)
        .map(|r| {
            // One invocation per ZERO_BLOCK 16-byte vectors the range touches.
            let vectors = (r.start_word + r.n_words - 1) / 4 - r.start_word / 4 + 1;
            let (groups, thread_stride) = grid(vectors.div_ceil(ZERO_BLOCK), max_groups);
            let params = ZeroParams {
                start_word: r.start_word as u32,
                n_words: r.n_words as u32,
                thread_stride,
                _pad: 0,
            };
            (*r, groups, params)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_vector_a_range_touches_gets_one_invocation() {
        let r = |start_word, n_words| ZeroRange {
            layer: 0,
            slot: 0,
            start_word,
            n_words,
        };
        let plans = zero_dispatches(&[r(0, 0), r(3, 2), r(0, 32 << 20)], 16);
        assert_eq!(plans.len(), 2, "the empty range is dropped");
        // Words 3 and 4 straddle two vectors: one block.
        assert_eq!((plans[0].1, plans[0].2.thread_stride), (1, 256));
        // 128 MiB: 8M vectors, 1M blocks, over 16 workgroups of 256: 256 blocks per invocation.
        let (_, groups, p) = plans[1];
        assert_eq!((groups, p.thread_stride), (16, 4096));
        assert_eq!(
            ((8u64 << 20) / ZERO_BLOCK).div_ceil(p.thread_stride as u64),
            256
        );
    }
}
