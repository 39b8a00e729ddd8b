// Reference: the adapter's practical streaming-read roofline. Each invocation XORs 16-byte words in a
// grid-stride loop; the result is stored only when it equals a value the data never produces, so the
// loads cannot be optimised away and almost nothing is written.

struct Params {
    n_vec4: u32,
    stride: u32,
    _pad0: u32,
    _pad1: u32,
}

@group(0) @binding(0) var<storage, read> src: array<vec4<u32>>;
@group(0) @binding(1) var<storage, read_write> sink: array<u32>;
@group(0) @binding(2) var<uniform> p: Params;

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    var acc = vec4<u32>(0u);
    for (var i = gid.x; i < p.n_vec4; i += p.stride) {
        acc ^= src[i];
    }
    let x = acc.x ^ acc.y ^ acc.z ^ acc.w;
    if x == 0x9e3779b9u {
        sink[gid.x % arrayLength(&sink)] = x;
    }
}
