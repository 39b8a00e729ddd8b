//! Zeroing plans: word ranges of slot buffers turned into dispatches of `shaders/zero.wgsl` (or
//! `zero_int64.wgsl`). Pure, so the sizing is unit-tested on the CPU.

use crate::attention::LOOP_BUDGET;
use crate::kernels::{VECTOR_BYTES, WORKGROUP_SIZE, ZeroParams, grid};

/// Vectors one zeroing invocation clears per loop step (`BLOCK` in shaders/shared/zero_main.wgsl).
const ZERO_BLOCK: u64 = 8;

/// Most blocks one zeroing invocation clears: each costs at most `ZERO_BLOCK + 1` loop iterations
/// (a step of the outer loop and the vectors of the block), so an invocation stays within
/// [`LOOP_BUDGET`] on Mesa's software adapters, which stop a longer invocation silently.
const MAX_BLOCKS_PER_INVOCATION: u64 = LOOP_BUDGET as u64 / (ZERO_BLOCK + 1);

/// Bytes in one vector of a zeroing kernel: `zero.wgsl`'s `vec4<u32>`, or with `int64`
/// `zero_int64.wgsl`'s `vec4<u64>`.
pub(crate) const fn zero_vector_bytes(int64: bool) -> u64 {
    if int64 {
        2 * VECTOR_BYTES
    } else {
        VECTOR_BYTES
    }
}

/// Words `[start_word, start_word + n_words)` of one slot buffer to zero.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ZeroRange {
    pub layer: usize,
    pub slot: usize,
    pub start_word: u64,
    pub n_words: u64,
    /// Zeroed by the kernel of 32-byte vectors of 64-bit words (`zero_int64.wgsl`).
    pub int64: bool,
}

/// One dispatch per non-empty range: the range, its workgroups and its parameters. At most
/// `max_groups` workgroups each, invocations striding over the rest, unless that leaves an
/// invocation more than [`MAX_BLOCKS_PER_INVOCATION`] blocks: then as many more workgroups as that
/// needs, up to `device_max` (the device's limit per dimension).
pub(crate) fn zero_dispatches(
    ranges: &[ZeroRange],
    max_groups: u32,
    device_max: u32,
) -> Vec<(ZeroRange, u32, ZeroParams)> {
    ranges
        .iter()
        .filter(|r| r.n_words > 0)
        .map(|r| {
            // One invocation per ZERO_BLOCK vectors (16 or 32 bytes) the range touches.
            let words = zero_vector_bytes(r.int64) / 4;
            let vectors = (r.start_word + r.n_words - 1) / words - r.start_word / words + 1;
            let blocks = vectors.div_ceil(ZERO_BLOCK);
            let needed = blocks.div_ceil(MAX_BLOCKS_PER_INVOCATION * WORKGROUP_SIZE as u64);
            let cap = (max_groups as u64).max(needed.min(device_max as u64)) as u32;
            let (groups, thread_stride) = grid(blocks, cap);
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
            int64: false,
        };
        let plans = zero_dispatches(&[r(0, 0), r(3, 2), r(0, 32 << 20)], 16, 65535);
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

    #[test]
    fn the_kernel_of_64_bit_words_takes_32_byte_vectors() {
        let r = |start_word, n_words| ZeroRange {
            layer: 0,
            slot: 0,
            start_word,
            n_words,
            int64: true,
        };
        // Words 7 and 8 straddle two 32-byte vectors; words 0..64 are 8 of them: one block each.
        let plans = zero_dispatches(&[r(7, 2), r(0, 64), r(0, 65), r(0, 32 << 20)], 16, 65535);
        let strides: Vec<_> = plans.iter().map(|p| (p.1, p.2.thread_stride)).collect();
        assert_eq!(&strides[..3], &[(1, 256), (1, 256), (1, 256)]);
        // 128 MiB: 4M vectors, 512K blocks, over 16 workgroups of 256: 128 blocks per invocation.
        let (_, groups, p) = plans[3];
        assert_eq!((groups, p.thread_stride), (16, 4096));
        assert_eq!(
            ((4u64 << 20) / ZERO_BLOCK).div_ceil(p.thread_stride as u64),
            128
        );
        assert!(plans.iter().all(|p| p.0.int64));
    }

    #[test]
    fn no_zeroing_invocation_runs_past_the_loop_budget() {
        // The largest binding kvgpu plans with (u32::MAX bytes, whole vectors), from word 1 so
        // that the first and last blocks are partial, on both kernels.
        for int64 in [false, true] {
            let vector_words = zero_vector_bytes(int64) / 4;
            let n_words = (u32::MAX as u64 / 4) / vector_words * vector_words - 1;
            let range = ZeroRange {
                layer: 0,
                slot: 0,
                start_word: 1,
                n_words,
                int64,
            };
            let (_, groups, p) = zero_dispatches(&[range], 16, 65535)[0];
            let vectors = (1 + n_words).div_ceil(vector_words);
            let blocks = vectors.div_ceil(ZERO_BLOCK);
            let per_invocation = blocks.div_ceil(p.thread_stride as u64);
            assert!(
                per_invocation * (ZERO_BLOCK + 1) < LOOP_BUDGET as u64,
                "int64 {int64}: {per_invocation} blocks per invocation over {groups} workgroups"
            );
            assert_eq!(p.thread_stride, groups * WORKGROUP_SIZE);
            // Without the budget's rule, 16 workgroups: over it for 16-byte vectors.
            if !int64 {
                assert!(groups > 16, "{groups} workgroups");
            }
        }
        // A device of few workgroups per dimension keeps its limit (and strides further).
        let r = ZeroRange {
            layer: 0,
            slot: 0,
            start_word: 0,
            n_words: 1 << 30,
            int64: false,
        };
        assert_eq!(zero_dispatches(&[r], 4, 8)[0].1, 8);
    }
}
