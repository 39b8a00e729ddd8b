
// The zeroing loop, after zero.wgsl or zero_int64.wgsl (build.rs appends this file to both): each
// declares `dst`, an array of vectors of type `Vec` of `VEC_WORDS` 32-bit words, and `clear_part`.
// Writes 0 to words [start_word, start_word + n_words) of one slot buffer. One dispatch covers a
// whole buffer. Invocations store whole vectors, a block of consecutive ones each, consecutive
// invocations consecutive blocks, striding over the range; the two vectors the range may only partly
// cover keep their words outside it (each vector is written by exactly one invocation). Slot buffers
// are allocated in whole vectors.

@group(1) @binding(0) var<uniform> params: ZeroParams;

// Vectors per block: each invocation clears whole blocks of consecutive vectors, so the loop's
// overhead is paid once per block.
const BLOCK: u32 = 8u;

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let len = arrayLength(&dst) * VEC_WORDS;
    let start = min(params.start_word, len);
    let end = start + min(params.n_words, len - start);
    if start == end {
        return;
    }
    let first = start / VEC_WORDS;
    let last = (end - 1u) / VEC_WORDS;
    let n_blocks = (last - first) / BLOCK + 1u;
    for (var b = gid.x; b < n_blocks; b += params.thread_stride) {
        let v0 = first + b * BLOCK;
        if v0 * VEC_WORDS >= start && (v0 + BLOCK) * VEC_WORDS <= end {
            for (var i = 0u; i < BLOCK; i += 1u) {
                dst[v0 + i] = Vec();
            }
        } else {
            for (var v = v0; v <= min(v0 + BLOCK - 1u, last); v += 1u) {
                clear_part(v, start, end);
            }
        }
    }
}
