// Zeroing kernel: writes 0 to words [start_word, start_word + n_words) of one slot buffer.
// One dispatch covers a whole buffer. Invocations store whole 16-byte vectors, a block of consecutive
// ones each, consecutive invocations consecutive blocks, striding over the range; the two vectors the
// range may only partly cover keep their words outside it (each vector is written by exactly one
// invocation). Slot buffers are allocated in whole vectors.

// Must match `ZeroParams` in src/kernels/params.rs.
struct ZeroParams {
    start_word: u32,
    n_words: u32,
    // Invocations in the dispatch (workgroups x 256): the loop stride, in blocks.
    thread_stride: u32,
    _pad: u32,
}

@group(0) @binding(0) var<storage, read_write> dst: array<vec4<u32>>;
@group(1) @binding(0) var<uniform> params: ZeroParams;

// Vectors per block: each invocation clears whole blocks of consecutive vectors, so the loop's
// overhead is paid once per block.
const BLOCK: u32 = 8u;

// Zeroes the words of vector `v` that lie in [start, end), keeping the others.
fn clear_part(v: u32, start: u32, end: u32) {
    let lo = v * 4u;
    let w = vec4<u32>(lo, lo + 1u, lo + 2u, lo + 3u);
    let keep = (w < vec4<u32>(start)) | (w >= vec4<u32>(end));
    dst[v] = select(vec4<u32>(0u), dst[v], keep);
}

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let len = arrayLength(&dst) * 4u;
    let start = min(params.start_word, len);
    let end = start + min(params.n_words, len - start);
    if start == end {
        return;
    }
    let first = start / 4u;
    let last = (end - 1u) / 4u;
    let n_blocks = (last - first) / BLOCK + 1u;
    for (var b = gid.x; b < n_blocks; b += params.thread_stride) {
        let v0 = first + b * BLOCK;
        if v0 * 4u >= start && (v0 + BLOCK) * 4u <= end {
            for (var i = 0u; i < BLOCK; i += 1u) {
                dst[v0 + i] = vec4<u32>(0u);
            }
        } else {
            for (var v = v0; v <= min(v0 + BLOCK - 1u, last); v += 1u) {
                clear_part(v, start, end);
            }
        }
    }
}
