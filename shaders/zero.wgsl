// Zeroing kernel: writes 0 to words [start_word, start_word + n_words) of one slot buffer.
// One dispatch covers a whole buffer: each invocation strides over the range.

// Must match `ZeroParams` in src/kernels.rs.
struct ZeroParams {
    start_word: u32,
    n_words: u32,
    // Invocations in the dispatch (workgroups x 256): the loop stride.
    thread_stride: u32,
    _pad: u32,
}

@group(0) @binding(0) var<storage, read_write> dst: array<u32>;
@group(0) @binding(1) var<uniform> params: ZeroParams;

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let len = arrayLength(&dst);
    let start = min(params.start_word, len);
    let end = start + min(params.n_words, len - start);
    for (var i = start + gid.x; i < end; i += params.thread_stride) {
        dst[i] = 0u;
    }
}
