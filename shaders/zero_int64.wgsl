// Zeroing kernel in 32-byte vectors of four 64-bit words, for CPU adapters with 64-bit integers; the
// loop is shared/zero_main.wgsl. A software adapter stores a vector component by component, lane by
// lane: four 8-byte stores per lane where zero.wgsl makes four 4-byte ones (on lavapipe it wrote 1.5
// to 1.7 times faster). Slot buffers whose size is not whole 32-byte vectors take zero.wgsl.

alias Vec = vec4<u64>;
const VEC_WORDS: u32 = 8u;

@group(0) @binding(0) var<storage, read_write> dst: array<Vec>;

// Zeroes the words of vector `v` that lie in [start, end), keeping the others: component c holds
// words 2c (its low half) and 2c + 1.
fn clear_part(v: u32, start: u32, end: u32) {
    let lo = v * 8u + vec4<u32>(0u, 2u, 4u, 6u);
    let hi = lo + vec4<u32>(1u);
    let keep_lo = (lo < vec4<u32>(start)) | (lo >= vec4<u32>(end));
    let keep_hi = (hi < vec4<u32>(start)) | (hi >= vec4<u32>(end));
    let mask = select(vec4<u64>(0lu), vec4<u64>(0xfffffffflu), keep_lo)
        | select(vec4<u64>(0lu), vec4<u64>(0xffffffff00000000lu), keep_hi);
    dst[v] = dst[v] & mask;
}
