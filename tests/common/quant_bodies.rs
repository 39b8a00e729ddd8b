//! Quantized storage (q8_0, q4_0, fp8 e4m3 and e5m2): every append path stores the bits the CPU twin
//! (`kvgpu::reference::pack_rows`) computes, on random rows and on the inputs where quantizers go wrong
//! (ties, zeros of both signs, subnormals, huge values, infinities, NaN), and reads return exactly the
//! dequantized values. One async body per scenario, run natively by `tests/quant.rs` and in the
//! browser by `tests/web.rs`. Attention over quantized storage is in `attention_bodies.rs`, pools and
//! snapshots in their own bodies.

use super::{buffer_with, cache_on, values};
use kvgpu::reference::{self, CpuCache};
use kvgpu::wgpu;
use kvgpu::*;

/// Inputs that stress a quantizer, two blocks of 32: the first is q8_0's ties at the scale 1 (its
/// largest value 127 makes the scale exactly 1, so `k + 0.5` lies halfway), the second the special
/// values. (For q4_0 the first block's scale is 127 / -8: [`tie_blocks`] has its ties.)
fn edge_rows() -> Vec<f32> {
    let mut ties = vec![
        127.0, -8.0, 0.5, 1.5, 2.5, -2.5, -0.5, 126.5, -126.5, 125.5, 3.5, 6.5, -7.5, 7.5, 0.0,
        -0.0,
    ];
    ties.extend((0..16).map(|i| i as f32 * 7.25 - 60.0));
    let specials = [
        0.0,
        -0.0,
        1e-45,
        -1e-40,
        1e-39,
        // -f32::MAX first: +inf, read as f32::MAX, is then not the first largest (q4_0's scale
        // keeps the sign of -f32::MAX).
        -f32::MAX,
        f32::INFINITY,
        f32::MAX,
        f32::NEG_INFINITY,
        f32::NAN,
        -f32::NAN,
        448.0,
        464.0,
        -500.0,
        1e5,
        1.0625,
        1.1875,
        0.0029296875,
        -0.0009765625,
        65504.0 * 127.0,
        8.3e6,
        1e-8,
        -3e-7,
        0.015625,
        0.013671875,
        240.0,
        -232.0,
        2.0,
        -2.0,
        0.1,
        -0.3,
        1e30,
    ];
    [ties, specials.to_vec()].concat()
}

/// Two blocks of 32 of ties at the scale 3, whose reciprocal is inexact, so a quantizer that divides
/// (the slab-write kernel, whose division WGSL lets be 2.5 ULP off) must correct its estimate on
/// them: q8_0's (its largest value 381 makes the scale 381 / 127, 3 in f16) and q4_0's (its first
/// largest value -24 makes the scale -24 / -8 = 3); each tie `3k + 1.5` lies halfway between codes
/// (and q8_0's last three values just below one).
fn tie_blocks() -> Vec<f32> {
    let mut q8 = vec![
        381.0, 1.5, 4.5, 7.5, -1.5, -4.5, 376.5, -379.5, 10.5, -10.5, 190.5, -190.5, 0.0, -0.0,
        3.0, -3.0,
    ];
    q8.extend((0..13).map(|i| (3 * i) as f32 + 1.5 - 24.0));
    // Just below half steps: where `x · (1 / 3)` may round up to the half, the exact check must
    // round down.
    let below = |x: f32| f32::from_bits(x.to_bits() - 1);
    q8.extend([below(1.5), below(4.5), below(376.5)]);
    let mut q4 = vec![-24.0];
    q4.extend((-8..=6).map(|k| (3 * k) as f32 + 1.5));
    q4.extend((0..16).map(|i| i as f32 * 2.75 - 22.0));
    [q8, q4].concat()
}

/// Two blocks of 32 of tiny values: the first's largest magnitude 1e-5 makes q8_0's scale an f16
/// subnormal (1e-5 / 127 rounds to 2^-24) and q4_0's another (1e-5 / 8); the second's, 2^-120,
/// makes both scales 0 from non-zero inputs, its products with the reciprocal subnormal f32; both
/// hold f32 subnormals beside normal values.
fn small_blocks() -> Vec<f32> {
    let tiny = |k: i32| 2f32.powi(k);
    let mut a = vec![
        1e-5, -7e-6, 3e-6, -1e-6, 1e-7, -1e-8, 0.0, -0.0, 1e-39, -1e-40, 1e-45,
    ];
    a.extend((0..21).map(|i| (i as f32 - 10.0) * 9.1e-7));
    let mut b = vec![
        tiny(-120),
        -tiny(-121),
        tiny(-126),
        -tiny(-125),
        1e-39,
        -1e-40,
        1e-45,
    ];
    b.extend((0..25).map(|i| (i as f32 - 12.0) * tiny(-125)));
    [a, b].concat()
}

/// A layer of K `[2, 32]` and V `[1, 64]`: rows of 64 elements, whole blocks, two blocks per row.
fn layer() -> LayerSpec {
    LayerSpec::new(vec![
        SlotSpec::new("k", &[2, 32]),
        SlotSpec::new("v", &[1, 64]),
    ])
}

/// Host data of `dtype` holding `x` (rounded to it).
enum Owned {
    F32(Vec<f32>),
    F16(Vec<half::f16>),
    BF16(Vec<half::bf16>),
}

impl Owned {
    fn of(x: &[f32], dtype: DType) -> Self {
        match dtype {
            DType::F16 => Owned::F16(x.iter().map(|&v| half::f16::from_f32(v)).collect()),
            DType::BF16 => Owned::BF16(x.iter().map(|&v| half::bf16::from_f32(v)).collect()),
            _ => Owned::F32(x.to_vec()),
        }
    }

    fn slab<'a>(&'a self, shape: &'a [usize]) -> HostSlab<'a> {
        match self {
            Owned::F32(d) => HostSlab::f32(d, shape),
            Owned::F16(d) => HostSlab::f16(d, shape),
            Owned::BF16(d) => HostSlab::bf16(d, shape),
        }
    }

    fn data(&self) -> HostData<'_> {
        match self {
            Owned::F32(d) => HostData::F32(d),
            Owned::F16(d) => HostData::F16(d),
            Owned::BF16(d) => HostData::BF16(d),
        }
    }
}

/// Host rows of every element type, edge rows among random ones, are stored as the twin quantizes
/// them, and `read_f32` returns the twin's dequantized values bit for bit.
pub async fn host_rows_are_stored_as_the_twin_quantizes_them(g: &Gpu) {
    for dtype in DType::QUANTIZED {
        for from in DType::ALL {
            let spec = CacheSpec::new(vec![layer(); 2], dtype, 16).unwrap();
            let mut c = cache_on(g, spec.clone());
            let mut m = CpuCache::new(&spec);
            let mut at = 0;
            for (step, n) in [2usize, 1, 5].into_iter().enumerate() {
                for l in 0..2 {
                    let mut x = values(7 + (step * 2 + l) as u64, n * 64);
                    if step == 0 {
                        x.splice(..64, edge_rows());
                        x.splice(64..128, tie_blocks());
                    } else if step == 1 {
                        x.splice(..64, small_blocks());
                    }
                    let owned = Owned::of(&x, from);
                    let shapes = [[n, 2, 32], [n, 1, 64]];
                    c.append(l, &[owned.slab(&shapes[0]), owned.slab(&shapes[1])])
                        .unwrap();
                    let bits = reference::host_bits(owned.data(), dtype);
                    m.write_rows(l, 0, at, &bits);
                    m.write_rows(l, 1, at, &bits);
                }
                c.advance(n).unwrap();
                at += n;
            }
            let what = format!("{from} rows into {dtype}");
            for l in 0..2 {
                for s in 0..2 {
                    let want_words = &m.words[l][s][..at * m.row_words(l, s)];
                    assert_eq!(
                        c.read_words_async(l, s).await.unwrap(),
                        want_words,
                        "{what}: layer {l} slot {s}"
                    );
                    let got = c.read_f32_async(l, s).await.unwrap();
                    let want = m.read_f32(l, s, at);
                    let same = got
                        .iter()
                        .zip(&want)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same && got.len() == want.len(), "{what}: read_f32");
                }
            }
            // Quantization keeps the values close: every finite, moderate input of the random rows
            // is within half a step of the block's scale (q8_0 1/254 of the block's largest
            // magnitude, q4_0 1/16, fp8 e4m3 1/16 relative, e5m2 1/8).
            let x = values(11, 64);
            let kept = reference::round_trip_rows(&x, dtype, 64);
            for (block, (xs, ks)) in x.chunks(32).zip(kept.chunks(32)).enumerate() {
                let amax = xs.iter().fold(0f32, |a, v| a.max(v.abs()));
                for (&v, &k) in xs.iter().zip(ks) {
                    let bound = match dtype {
                        DType::Q8_0 => amax / 254.0 * 1.01,
                        DType::Q4_0 => amax / 16.0 * 1.01,
                        DType::F8E5M2 => v.abs() / 8.0 + 1e-4,
                        _ => v.abs() / 16.0 + 1e-3,
                    };
                    assert!(
                        (v - k).abs() <= bound,
                        "{dtype} block {block}: {v} kept as {k}"
                    );
                }
            }
        }
    }
}

/// GPU sources of every element type, strided (a fused QKV buffer) and plain, are quantized by the
/// slab-write kernel into the bits the twin computes, edge values included.
pub async fn gpu_sources_are_quantized_as_the_twin_does(g: &Gpu) {
    const USAGE: wgpu::BufferUsages =
        wgpu::BufferUsages::STORAGE.union(wgpu::BufferUsages::COPY_SRC);
    let n = 3;
    // A fused row: 32 query elements, K [2, 32], V [1, 64].
    let width = 32 + 64 + 64;
    for dtype in DType::QUANTIZED {
        for from in DType::ALL {
            let spec = CacheSpec::new(vec![layer()], dtype, 8).unwrap();
            let mut c = cache_on(g, spec.clone());
            let mut x = values(21, n * width);
            x.splice(32..96, edge_rows());
            x.splice(width + 96..width + 160, edge_rows());
            x.splice(2 * width + 32..2 * width + 96, tie_blocks());
            x.splice(2 * width + 96..2 * width + 160, small_blocks());
            let bits: Vec<u32> = x.iter().map(|&v| reference::f32_to_bits(v, from)).collect();
            let words = if from == DType::F32 {
                bits.clone()
            } else {
                reference::pack_rows(&bits, from, bits.len())
            };
            let buf = buffer_with(&g.device, &words, USAGE).await;
            let (ks, vs) = ([n, 2, 32], [n, 1, 64]);
            let (kst, vst) = ([width, 32, 1], [width, 64, 1]);
            let k = GpuSlab {
                buffer: &buf,
                dtype: from,
                offset: 32,
                shape: &ks,
                strides: Some(&kst),
            };
            let v = GpuSlab {
                offset: 96,
                shape: &vs,
                strides: Some(&vst),
                ..k
            };
            c.append_gpu(0, &[k, v]).unwrap();
            let what = format!("{from} GPU source into {dtype}");
            let want_k = reference::slab_write(&bits, from, 32, &ks, &kst, dtype);
            let want_v = reference::slab_write(&bits, from, 96, &vs, &vst, dtype);
            assert_eq!(c.read_words_async(0, 0).await.unwrap(), want_k, "{what}: K");
            assert_eq!(c.read_words_async(0, 1).await.unwrap(), want_v, "{what}: V");
            // The same rows from the host store the same bits.
            let mut h = cache_on(g, spec.clone());
            let row = |off: usize, w: usize| -> Vec<f32> {
                (0..n)
                    .flat_map(|r| &x[r * width + off..r * width + off + w])
                    .map(|&v| reference::round_trip(v, from))
                    .collect()
            };
            let (hk, hv) = (row(32, 64), row(96, 64));
            h.append(0, &[HostSlab::f32(&hk, &ks), HostSlab::f32(&hv, &vs)])
                .unwrap();
            assert_eq!(
                h.read_words_async(0, 0).await.unwrap(),
                want_k,
                "{what}: host K"
            );
            assert_eq!(
                h.read_words_async(0, 1).await.unwrap(),
                want_v,
                "{what}: host V"
            );
        }
    }
}

/// Block types refuse a row whose innermost dimension is not whole blocks, at spec time, naming the
/// width and the block; fp8 takes any width. A GPU source declared quantized is refused before
/// anything is recorded.
pub async fn quantized_specs_and_sources_are_checked(g: &Gpu) {
    for dtype in [DType::Q8_0, DType::Q4_0] {
        let e = CacheSpec::new(vec![LayerSpec::kv(4, 48, 32)], dtype, 8).unwrap_err();
        assert!(
            matches!(
                &e,
                Error::InvalidSpec {
                    problem: SpecProblem::BlockWidth {
                        layer: 0,
                        slot: 0,
                        width: 48,
                        block: 32,
                        ..
                    }
                }
            ),
            "{e}"
        );
        assert!(
            e.to_string().contains("48") && e.to_string().contains("32"),
            "{e}"
        );
    }
    for dtype in [DType::F8E4M3, DType::F8E5M2] {
        let spec = CacheSpec::new(vec![LayerSpec::kv(3, 5, 7)], dtype, 8).unwrap();
        assert_eq!(spec.row_bytes(0, 0).unwrap(), 16);
        assert_eq!(spec.row_bytes(0, 1).unwrap(), 24);
        // An fp8 cache of odd widths round-trips host rows like the twin.
        let mut c = cache_on(g, spec.clone());
        let mut m = CpuCache::new(&spec);
        super::append_both(&mut c, &mut m, 0, 3, 5);
        super::assert_matches(&c, &m).await;
    }

    let spec = CacheSpec::new(vec![layer()], DType::Q8_0, 8).unwrap();
    let mut c = cache_on(g, spec);
    let before = super::snapshot(&c).await;
    let buf = buffer_with(&g.device, &[0u32; 256], super::USAGE).await;
    const KS: [usize; 3] = [1, 2, 32];
    const VS: [usize; 3] = [1, 1, 64];
    for declared in DType::QUANTIZED {
        let slab = |shape: &'static [usize]| GpuSlab {
            buffer: &buf,
            dtype: declared,
            offset: 0,
            shape,
            strides: None,
        };
        let e = c.append_gpu(0, &[slab(&KS), slab(&VS)]).unwrap_err();
        assert!(
            matches!(
                &e,
                Error::SourceLayout {
                    problem: SourceProblem::QuantizedSource { .. },
                    ..
                }
            ),
            "{e}"
        );
    }
    assert_eq!(c.visible(0).unwrap(), 0);
    assert_eq!(super::snapshot(&c).await, before, "a refused append wrote");
}

/// Bytes per token of real models' caches against f16.
pub async fn quantized_caches_take_the_bytes_they_promise(_g: &Gpu) {
    for (preset, q8, q4, f8) in [
        ("llama3-8b", 0.53125, 0.28125, 0.5),
        ("deepseek-v2-lite", 0.53125, 0.28125, 0.5),
    ] {
        let per = |dtype| {
            CacheSpec::preset(preset, dtype, 4096)
                .unwrap()
                .bytes_per_token()
        };
        let f16 = per(DType::F16) as f64;
        let types = [
            (DType::Q8_0, q8),
            (DType::Q4_0, q4),
            (DType::F8E4M3, f8),
            (DType::F8E5M2, f8),
        ];
        for (dtype, want) in types {
            let ratio = per(dtype) as f64 / f16;
            assert!(
                (ratio - want).abs() < 1e-9,
                "{preset} {dtype}: {ratio} of f16, want {want}"
            );
        }
    }
}

/// Scaled fp8 slots store from a GPU source the codes the host stores, at scales from 2^-125 to
/// the largest a type takes (2^119 for e4m3, 2^112 for e5m2: inverse scales from 2^125 to 2^-119
/// or 2^-112), for inputs whose product with the inverse scale an adapter may get wrong where WGSL
/// lets it: subnormals (at the scale 2^-125 most scale to codes other than zero; SwiftShader
/// flushes a subnormal operand to zero), the largest finite values and the infinities (whose
/// products overflow; WGSL leaves infinities indeterminate), NaN, zeros of both signs, values about
/// each format's largest code and its smallest, among random ones. The kernel computes the product
/// from bits as `reference::prescaled` does.
pub async fn scaled_fp8_gpu_sources_store_the_host_codes_at_any_scale(g: &Gpu) {
    let w = 16;
    for dtype in [DType::F8E4M3, DType::F8E5M2] {
        let top = (2f32).powi(if dtype == DType::F8E4M3 { 119 } else { 112 });
        for (i, scale) in [(2f32).powi(-125), 0.004, 3.0, top].into_iter().enumerate() {
            // Edge values (the infinities, NaN, zeros of both signs, the largest finite ones) and
            // the smallest normal ones.
            let mut x = edge_rows()[32..].to_vec();
            x.extend([f32::MIN_POSITIVE, -f32::MIN_POSITIVE, -3e38]);
            // Subnormals from the largest down, both signs.
            for k in 0..23 {
                let m = 0x007f_ffffu32 >> k;
                x.extend([f32::from_bits(m), f32::from_bits(0x8000_0000 | m)]);
            }
            // About the largest codes (448, and e5m2's 57,344 with the midpoint 61,440 above it)
            // and the smallest (e4m3's 2^-9, e5m2's 2^-16).
            for v in [
                448.0,
                464.0,
                465.0,
                57344.0,
                61440.0,
                61441.0,
                1e5,
                0.001953125,
                1.5258789e-5,
                7.6e-6,
                0.5,
            ] {
                x.extend([v * scale, -v * scale]);
            }
            let random = values(60 + i as u64, 4 * w);
            x.extend(random.iter().map(|&v| v * scale));
            x.extend_from_slice(&random);
            let n = x.len().div_ceil(w);
            x.resize(n * w, 1.0);
            let spec = CacheSpec::new(vec![LayerSpec::kv(1, w, w)], dtype, n)
                .and_then(|s| s.with_slot_scale(0, 0, scale))
                .and_then(|s| s.with_slot_scale(0, 1, scale))
                .unwrap();
            let bits = reference::scaled_host_bits(HostData::F32(&x), dtype, Some(scale));
            let want = reference::pack_rows(&bits, dtype, w);
            let words: Vec<u32> = x.iter().map(|v| v.to_bits()).collect();
            let source = buffer_with(&g.device, &words, super::USAGE).await;
            let shape = [n, 1, w];
            let slab = GpuSlab::contiguous(&source, DType::F32, &shape);
            let mut c = cache_on(g, spec.clone());
            c.append_gpu(0, &[slab, slab]).unwrap();
            c.advance(n).unwrap();
            let mut host = cache_on(g, spec);
            host.append(0, &[HostSlab::f32(&x, &shape); 2]).unwrap();
            host.advance(n).unwrap();
            for s in 0..2 {
                let what = format!("{dtype} scale {scale:e} slot {s}");
                let got = c.read_words_async(0, s).await.unwrap();
                if got != want {
                    let at = got.iter().zip(&want).position(|(a, b)| a != b).unwrap_or(0);
                    panic!(
                        "{what}: word {at}: gpu {:#010x}, host {:#010x}, inputs {:?}",
                        got[at],
                        want[at],
                        &words[4 * at..4 * at + 4]
                            .iter()
                            .map(|b| format!("{b:#010x}"))
                            .collect::<Vec<_>>()
                    );
                }
                assert_eq!(
                    host.read_words_async(0, s).await.unwrap(),
                    want,
                    "{what}: host"
                );
            }
        }
    }
}

/// Plain GPU slabs of `dtype` elements: `buffers[s]` shaped `shapes[s]`.
fn gpu_slabs<'a>(
    buffers: &'a [wgpu::Buffer],
    dtype: DType,
    shapes: &'a [Vec<usize>],
) -> Vec<GpuSlab<'a>> {
    buffers
        .iter()
        .zip(shapes)
        .map(|(buffer, shape)| GpuSlab {
            buffer,
            dtype,
            offset: 0,
            shape,
            strides: None,
        })
        .collect()
}

/// Slots of one cache in six storage types (K and V of a layer differ, as do an MLA layer's latent
/// and rope key; the fp8 rope key scaled so that most values saturate): host appends, GPU appends of
/// f32 and f16 sources, and a pool's batches (scattered by one dispatch per slot, and run by run),
/// from the host and from GPU buffers, store in each slot the bits the twin computes for that slot's
/// type and scale, and read back as its values.
pub async fn mixed_storage_takes_every_append_path(g: &Gpu) {
    use DType::*;
    let stored = |mut layer: LayerSpec, types: [DType; 2]| {
        for (slot, dtype) in layer.slots.iter_mut().zip(types) {
            slot.dtype = Some(dtype);
        }
        layer
    };
    let spec = CacheSpec::new(
        vec![
            stored(LayerSpec::kv(2, 32, 64), [Q8_0, F16]),
            stored(LayerSpec::mla(64, 32), [Q4_0, F8E4M3]),
            LayerSpec::empty(),
            stored(LayerSpec::kv(1, 32, 32), [BF16, F32]),
        ],
        Q8_0,
        16,
    )
    .and_then(|s| s.with_slot_scale(1, 1, 0.004))
    .unwrap();
    assert!(spec.is_mixed());
    assert_eq!(spec.slot_scale(1, 1).unwrap(), Some(0.004));
    let layers = [0, 1, 3];
    let trailing = |l: usize| -> Vec<Vec<usize>> {
        spec.layers()[l]
            .slots
            .iter()
            .map(|s| s.trailing.clone())
            .collect()
    };
    // Rows of `n` tokens for every slot of `l`, rounded to what a source of `from` holds.
    let rows = |l: usize, n: usize, from: DType, seed: u64| -> Vec<Vec<f32>> {
        trailing(l)
            .iter()
            .enumerate()
            .map(|(s, t)| {
                let mut x = values(seed + s as u64, n * t.iter().product::<usize>());
                if seed.is_multiple_of(3) {
                    let edges = edge_rows();
                    let k = edges.len().min(x.len());
                    x[..k].copy_from_slice(&edges[..k]);
                }
                x.iter().map(|&v| reference::round_trip(v, from)).collect()
            })
            .collect()
    };
    // GPU buffers holding `data` as `from` elements.
    let sources = |data: &[Vec<f32>], from: DType| {
        let device = g.device.clone();
        let data = data.to_vec();
        async move {
            let mut out = Vec::new();
            for x in &data {
                let bits: Vec<u32> = x.iter().map(|&v| reference::f32_to_bits(v, from)).collect();
                let words = reference::pack_rows(&bits, from, bits.len());
                out.push(buffer_with(&device, &words, super::USAGE).await);
            }
            out
        }
    };
    let bits_of = |l: usize, s: usize, x: &[f32]| {
        let (dtype, scale) = (
            spec.slot_dtype(l, s).unwrap(),
            spec.slot_scale(l, s).unwrap(),
        );
        reference::scaled_host_bits(HostData::F32(x), dtype, scale)
    };
    let stored_words = |l: usize, s: usize, x: &[f32]| {
        let dtype = spec.slot_dtype(l, s).unwrap();
        let bits = bits_of(l, s, x);
        reference::pack_rows(&bits, dtype, spec.layers()[l].slots[s].row_elems())
    };

    // One cache: a host step, a GPU step from f32, a GPU step from f16.
    let mut c = cache_on(g, spec.clone());
    let mut m = CpuCache::new(&spec);
    let mut at = 0;
    for (step, (from, n, gpu)) in [(F32, 2, false), (F32, 3, true), (F16, 1, true)]
        .into_iter()
        .enumerate()
    {
        for &l in &layers {
            let data = rows(l, n, from, 30 + 10 * step as u64 + l as u64);
            let shapes: Vec<Vec<usize>> =
                trailing(l).iter().map(|t| [&[n][..], t].concat()).collect();
            if gpu {
                let buffers = sources(&data, from).await;
                c.append_gpu(l, &gpu_slabs(&buffers, from, &shapes))
                    .unwrap();
            } else {
                let slabs: Vec<HostSlab> = (0..2)
                    .map(|s| HostSlab::f32(&data[s], &shapes[s]))
                    .collect();
                c.append(l, &slabs).unwrap();
            }
            for (s, x) in data.iter().enumerate() {
                m.write_rows(l, s, at, &bits_of(l, s, x));
            }
        }
        c.advance(n).unwrap();
        at += n;
    }
    for &l in &layers {
        for s in 0..2 {
            let what = format!("layer {l} slot {s} ({})", spec.slot_dtype(l, s).unwrap());
            let want = &m.words[l][s][..at * m.row_words(l, s)];
            assert_eq!(c.read_words_async(l, s).await.unwrap(), want, "{what}");
            let (got, want) = (c.read_f32_async(l, s).await.unwrap(), m.read_f32(l, s, at));
            let same = got.len() == want.len()
                && got
                    .iter()
                    .zip(&want)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{what}: read_f32");
        }
    }

    // A pool: a host batch and a GPU batch of three sequences, scattered and run by run.
    for choice in [ScatterChoice::Always, ScatterChoice::Never] {
        let mut p = PagedCache::with_kernels(super::kernels_for(g), spec.clone(), 2, 24).unwrap();
        p.set_scatter(choice);
        let seqs: Vec<SeqId> = (0..3).map(|_| p.add_sequence().unwrap()).collect();
        let batch = [(seqs[0], 3), (seqs[1], 1), (seqs[2], 2)];
        let mut want: Vec<Vec<Vec<Vec<f32>>>> = vec![vec![vec![Vec::new(); 2]; 4]; 3];
        for (round, gpu) in [false, true].into_iter().enumerate() {
            for &l in &layers {
                let data = rows(l, 6, F32, 70 + 10 * round as u64 + l as u64);
                let shapes: Vec<Vec<usize>> =
                    trailing(l).iter().map(|t| [&[6][..], t].concat()).collect();
                if gpu {
                    let buffers = sources(&data, F32).await;
                    let slabs = gpu_slabs(&buffers, F32, &shapes);
                    p.append_gpu_batch(l, &batch, &slabs).unwrap();
                } else {
                    let slabs: Vec<HostSlab> = (0..2)
                        .map(|s| HostSlab::f32(&data[s], &shapes[s]))
                        .collect();
                    p.append_batch(l, &batch, &slabs).unwrap();
                }
                for (s, x) in data.iter().enumerate() {
                    let e = spec.layers()[l].slots[s].row_elems();
                    let mut row = 0;
                    for (i, &(_, n)) in batch.iter().enumerate() {
                        want[i][l][s].extend_from_slice(&x[row * e..(row + n) * e]);
                        row += n;
                    }
                }
            }
            for &(seq, n) in &batch {
                p.advance(seq, n).unwrap();
            }
        }
        for (i, (&seq, want)) in seqs.iter().zip(&want).enumerate() {
            for &l in &layers {
                for (s, rows) in want[l].iter().enumerate() {
                    assert_eq!(
                        p.read_words_async(seq, l, s).await.unwrap(),
                        stored_words(l, s, rows),
                        "{choice:?}: sequence {i} layer {l} slot {s}"
                    );
                }
            }
        }
    }
}
