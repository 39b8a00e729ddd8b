// Zeroing kernel in 16-byte vectors of four 32-bit words; the loop is shared/zero_main.wgsl.

alias Vec = vec4<u32>;
const VEC_WORDS: u32 = 4u;

@group(0) @binding(0) var<storage, read_write> dst: array<Vec>;

// Zeroes the words of vector `v` that lie in [start, end), keeping the others.
fn clear_part(v: u32, start: u32, end: u32) {
    let lo = v * 4u;
    let w = vec4<u32>(lo, lo + 1u, lo + 2u, lo + 3u);
    let keep = (w < vec4<u32>(start)) | (w >= vec4<u32>(end));
    dst[v] = select(vec4<u32>(0u), dst[v], keep);
}
