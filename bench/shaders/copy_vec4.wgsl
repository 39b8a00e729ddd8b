// Reference: a device-to-device copy by compute invocations, 16 bytes per load and store in a
// grid-stride loop. Beside `copy_buffer_to_buffer`, which some drivers may give a copy engine slower
// than the processor's own loads and stores: the long part takes the faster of the two.

struct Params {
    n_vec4: u32,
    stride: u32,
    _pad0: u32,
    _pad1: u32,
}

@group(0) @binding(0) var<storage, read> src: array<vec4<u32>>;
@group(0) @binding(1) var<storage, read_write> dst: array<vec4<u32>>;
@group(0) @binding(2) var<uniform> p: Params;

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    for (var i = gid.x; i < p.n_vec4; i += p.stride) {
        dst[i] = src[i];
    }
}
