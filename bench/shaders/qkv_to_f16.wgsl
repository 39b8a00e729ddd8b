// Reference: the best plain copy kernel for the strided fused-QKV case. K rows of `kv_vec4` 16-byte
// f32 words sit `row_vec4` words apart from `offset_vec4`; each invocation converts 8 floats with the
// built-in pack2x16float (rounding left to the implementation) and stores 16 bytes.

struct Params {
    n_rows: u32,
    // 16-byte words of f32 per K row (a multiple of 2).
    kv_vec4: u32,
    row_vec4: u32,
    offset_vec4: u32,
    stride: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

@group(0) @binding(0) var<storage, read> src: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read_write> dst: array<vec4<u32>>;
@group(0) @binding(2) var<uniform> p: Params;

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let per_row = p.kv_vec4 / 2u;
    let total = p.n_rows * per_row;
    for (var i = gid.x; i < total; i += p.stride) {
        let row = i / per_row;
        let c = i - row * per_row;
        let s = p.offset_vec4 + row * p.row_vec4 + 2u * c;
        let a = src[s];
        let b = src[s + 1u];
        dst[i] = vec4<u32>(pack2x16float(a.xy), pack2x16float(a.zw), pack2x16float(b.xy), pack2x16float(b.zw));
    }
}
