// Reference: a device-to-device copy by compute invocations, 16 bytes per load and store in a
// grid-stride loop. Beside `copy_buffer_to_buffer`, which some drivers may give a copy engine slower
// than the processor's own loads and stores: the long part takes the faster of the two.

@group(0) @binding(0) var<storage, read> words: array<vec4<u32>>;
@group(0) @binding(1) var<storage, read_write> copied: array<vec4<u32>>;
// The words to copy, and the grid's invocations.
@group(0) @binding(2) var<uniform> n_and_stride: vec4<u32>;

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    for (var i = gid.x; i < n_and_stride.x; i += n_and_stride.y) {
        copied[i] = words[i];
    }
}
