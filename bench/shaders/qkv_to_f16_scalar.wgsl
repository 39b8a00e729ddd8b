// Reference for the profile: the same conversion as qkv_to_f16.wgsl, but with the memory access
// pattern of kvgpu's slab-write kernel: one output word per invocation, two 4-byte loads, one 4-byte
// store. Compared with the 16-byte version it shows what access width costs on this adapter.

struct Params {
    n_rows: u32,
    // f32 elements per K row (even).
    kv_elems: u32,
    row_elems: u32,
    offset: u32,
    stride: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

@group(0) @binding(0) var<storage, read> src: array<f32>;
@group(0) @binding(1) var<storage, read_write> dst: array<u32>;
@group(0) @binding(2) var<uniform> p: Params;

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let per_row = p.kv_elems / 2u;
    let total = p.n_rows * per_row;
    for (var i = gid.x; i < total; i += p.stride) {
        let row = i / per_row;
        let c = i - row * per_row;
        let s = p.offset + row * p.row_elems + 2u * c;
        dst[i] = pack2x16float(vec2<f32>(src[s], src[s + 1u]));
    }
}
