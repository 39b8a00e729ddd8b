//! Appends from GPU buffers: strided sources (fused QKV, head-major), element type conversion matching
//! `half` bit for bit, odd widths, the contiguous copy path, and refused sources. Sources hold element
//! types (f32, f16, bf16); the caches they go into are of every storage type (quantized ones with
//! whole-block widths for q8_0 and q4_0), except where a test is about the copy of same-typed rows.
//! One async body per scenario, run natively by `tests/gpu_source.rs` and in the browser by
//! `tests/web.rs`.

use super::{append_both, buffer_with, cache_on, snapshot, values};
use kvgpu::reference::{self, CpuCache};
use kvgpu::wgpu;
use kvgpu::*;

/// A GPU buffer of `g` holding element bits of `dtype` (16-bit types packed two per word).
async fn source(g: &Gpu, bits: &[u32], dtype: DType, usage: wgpu::BufferUsages) -> wgpu::Buffer {
    let words = if dtype == DType::F32 {
        bits.to_vec()
    } else {
        reference::pack_rows(bits, dtype, bits.len())
    };
    buffer_with(&g.device, &words, usage).await
}

const STORAGE: wgpu::BufferUsages = wgpu::BufferUsages::STORAGE;
const BOTH: wgpu::BufferUsages = wgpu::BufferUsages::STORAGE.union(wgpu::BufferUsages::COPY_SRC);

/// A head dimension for `dtype`: `odd` for the types stored element by element, one block of 32 for
/// the block types (q8_0, q4_0), which refuse any other width.
fn head_dim(dtype: DType, odd: usize) -> usize {
    dtype.block().unwrap_or(odd)
}

/// Element bits of pseudo-random values in `dtype`.
fn bits_of(seed: u64, n: usize, dtype: DType) -> Vec<u32> {
    values(seed, n)
        .into_iter()
        .map(|x| reference::f32_to_bits(x, dtype))
        .collect()
}
pub async fn fused_qkv_k_and_v_go_straight_into_the_cache(g: &Gpu) {
    let (heads, q_dim, n) = (4, 64, 5);
    for src_dtype in DType::ALL {
        for dtype in DType::STORAGE {
            note!("-- {dtype} from {src_dtype}");
            let dim = head_dim(dtype, 8);
            let kv_dim = heads * dim;
            let width = q_dim + 2 * kv_dim;
            let spec = CacheSpec::new(vec![LayerSpec::kv(heads, dim, dim); 2], dtype, 12).unwrap();
            let (mut c, mut m) = (cache_on(g, spec.clone()), CpuCache::new(&spec));
            let qkv = bits_of(7, n * width, src_dtype);
            let buf = source(g, &qkv, src_dtype, BOTH).await;
            let shape = [n, heads, dim];
            let strides = [width, dim, 1];
            let k = GpuSlab {
                buffer: &buf,
                dtype: src_dtype,
                offset: q_dim as u64,
                shape: &shape,
                strides: Some(&strides),
            };
            let v = GpuSlab {
                offset: (q_dim + kv_dim) as u64,
                ..k
            };
            c.append_gpu(1, &[k, v]).unwrap();
            let want_k = reference::slab_write(&qkv, src_dtype, q_dim, &shape, &strides, dtype);
            let want_v =
                reference::slab_write(&qkv, src_dtype, q_dim + kv_dim, &shape, &strides, dtype);
            assert_eq!(
                c.read_words_async(1, 0).await.unwrap(),
                want_k,
                "K from {src_dtype}"
            );
            assert_eq!(
                c.read_words_async(1, 1).await.unwrap(),
                want_v,
                "V from {src_dtype}"
            );
            m.words[1][0][..want_k.len()].copy_from_slice(&want_k);
            m.words[1][1][..want_v.len()].copy_from_slice(&want_v);
            assert_eq!(snapshot(&c).await, m.words);
        }
    }
}

pub async fn head_major_source_is_transposed_into_rows(g: &Gpu) {
    // A [heads, seq, dim] tensor; take tokens 3..6 of every head.
    let (heads, seq, start, n) = (3, 10, 3, 3);
    for dtype in DType::STORAGE {
        note!("-- {dtype}");
        let dim = head_dim(dtype, 6);
        let spec = CacheSpec::new(
            vec![LayerSpec::new(vec![SlotSpec::new("k", &[heads, dim])])],
            dtype,
            8,
        )
        .unwrap();
        let mut c = cache_on(g, spec);
        let src = bits_of(11, heads * seq * dim, DType::F32);
        let buf = source(g, &src, DType::F32, STORAGE).await;
        let shape = [n, heads, dim];
        let strides = [dim, seq * dim, 1];
        let slab = GpuSlab {
            buffer: &buf,
            dtype: DType::F32,
            offset: (start * dim) as u64,
            shape: &shape,
            strides: Some(&strides),
        };
        c.append_gpu(0, &[slab]).unwrap();
        let want = reference::slab_write(&src, DType::F32, start * dim, &shape, &strides, dtype);
        assert_eq!(c.read_words_async(0, 0).await.unwrap(), want);
        // Spot-check the transpose itself: row 1, head 2, element 4 is token 4 of head 2 (rounded
        // with its row, which for the block types decides its block's scale).
        let got = c.read_f32_async(0, 0).await.unwrap();
        let row_1: Vec<f32> = (0..heads * dim)
            .map(|i| f32::from_bits(src[(i / dim) * seq * dim + (start + 1) * dim + i % dim]))
            .collect();
        let expect = reference::round_trip_rows(&row_1, dtype, heads * dim);
        assert_eq!(got[heads * dim + 2 * dim + 4], expect[2 * dim + 4]);
        assert_eq!(got[heads * dim..2 * heads * dim], expect[..]);
    }
}

/// f32 bit patterns that exercise every branch of the 16-bit conversions.
fn tricky_f32() -> Vec<u32> {
    let mut v: Vec<f32> = vec![
        0.0,
        -0.0,
        1.0,
        -1.0,
        65504.0,
        65519.0,
        65520.0,
        -65520.0,
        1e9,
        f32::MAX,
        f32::MIN_POSITIVE,
        f32::INFINITY,
        f32::NEG_INFINITY,
        6.1e-5,
        5.96e-8,
        2.98e-8,
        2.99e-8,
        1e-10,
        3.0e-5,
        -4.5e-6,
        1.0 + f32::EPSILON,
        0.333333,
        1.0e-45,
    ];
    // Ties: halfway between two f16 values (even and odd mantissas), and between two bf16 values.
    v.extend([
        1.0 + 2f32.powi(-11),
        1.0 + 3.0 * 2f32.powi(-11),
        1.0 + 2f32.powi(-8),
        1.0 + 3.0 * 2f32.powi(-8),
    ]);
    let mut bits: Vec<u32> = v.into_iter().map(f32::to_bits).collect();
    bits.extend([
        0x7fc0_0000,
        0xffc0_0001,
        0x7f80_0001,
        0x7fbf_ffff,
        0x0000_0001,
        0x8000_0003,
        0x3380_0000,
        0x3380_0001,
    ]);
    // Random bit patterns across the whole range, subnormals and NaNs included.
    let mut s = 0x2545_f491_4f6c_dd1du64;
    bits.extend((0..4000).map(|_| {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s >> 32) as u32
    }));
    bits
}

pub async fn conversion_matches_half_bit_for_bit(g: &Gpu) {
    let src = tricky_f32();
    let n = src.len();
    for src_dtype in DType::ALL {
        // 16-bit sources: every 16-bit pattern class, from the f32 patterns' halves.
        let src_bits: Vec<u32> = match src_dtype {
            DType::F32 => src.clone(),
            _ => src.iter().map(|&b| b & 0xffff).collect(),
        };
        let buf = source(g, &src_bits, src_dtype, STORAGE).await;
        // Rows of 7 elements (odd: the last word of a 16-bit row is half padding) take the word path;
        // rows of 8 from an f32 source take the 16-byte path. The block types quantize rows of one
        // and of three blocks (the last word of scales half padding) from the same tricky values.
        for dtype in DType::STORAGE {
            let widths = match dtype.block() {
                Some(b) => [b, 3 * b],
                None => [7, 8],
            };
            for width in widths {
                note!("-- {dtype} from {src_dtype}, rows of {width}");
                let rows = n / width;
                let spec = CacheSpec::new(
                    vec![LayerSpec::new(vec![SlotSpec::new("x", &[width])])],
                    dtype,
                    rows,
                )
                .unwrap();
                let mut c = cache_on(g, spec.clone());
                let shape = [rows, width];
                let slab = GpuSlab::contiguous(&buf, src_dtype, &shape);
                c.append_gpu(0, &[slab]).unwrap();
                let want =
                    reference::slab_write(&src_bits, src_dtype, 0, &shape, &[width, 1], dtype);
                let got = c.read_words_async(0, 0).await.unwrap();
                assert_eq!(
                    got.len(),
                    want.len(),
                    "{src_dtype} -> {dtype}, width {width}"
                );
                let bad = got.iter().zip(&want).position(|(g, w)| g != w);
                assert_eq!(
                    bad, None,
                    "{src_dtype} -> {dtype}, width {width}: first mismatch at word {bad:?}"
                );
                // And the host path agrees with the GPU path for f32 sources.
                if src_dtype == DType::F32 {
                    let host: Vec<f32> = src_bits[..rows * width]
                        .iter()
                        .map(|&b| f32::from_bits(b))
                        .collect();
                    let mut h = cache_on(g, spec);
                    h.append(0, &[HostSlab::f32(&host, &shape)]).unwrap();
                    assert_eq!(
                        h.read_words_async(0, 0).await.unwrap(),
                        got,
                        "host and GPU conversion differ for {dtype}"
                    );
                }
            }
        }
    }
}

/// Sources whose elements are not adjacent, from every element type into every storage type,
/// against the twin bit for bit: interleaved rows (every second element, as K and V interleaved in
/// one buffer) from an even element offset (16-bit elements of a same-typed source then start
/// words: the one-load path of adjacent pairs must not take them), and rows of five axes whose
/// strides merge with none of their neighbours and whose sizes differ, from an odd one. Quantized
/// storage takes rows of one block, every second element of the source.
pub async fn sources_of_spread_elements_are_gathered(g: &Gpu) {
    let n = 5;
    for src_dtype in DType::ALL {
        let src_bits = bits_of(90, 10_000, src_dtype);
        let buf = source(g, &src_bits, src_dtype, STORAGE).await;
        for dtype in DType::STORAGE {
            // (trailing shape, strides, element offset)
            let cases: Vec<(Vec<usize>, Vec<usize>, u64)> = match dtype.block() {
                Some(b) => vec![(vec![b], vec![2 * b + 6, 2], 3)],
                None => vec![
                    (vec![7], vec![16, 2], 2),
                    (vec![3, 2, 4, 6, 7], vec![1892, 631, 315, 79, 13, 2], 3),
                    // Rows of whole 16-byte vectors' worth, 16-byte aligned, but every other
                    // element: no 16-byte loads of a row.
                    (vec![8], vec![16, 2], 0),
                    (vec![8], vec![16, 2], 8),
                    // The outer axis the inner one: its elements side by side in the source.
                    (vec![2, 4], vec![8, 1, 2], 0),
                ],
            };
            for (trailing, strides, offset) in cases {
                let what =
                    format!("{dtype} from {src_dtype}, rows {trailing:?} strides {strides:?}");
                let spec = CacheSpec::new(
                    vec![LayerSpec::new(vec![SlotSpec::new("x", &trailing)])],
                    dtype,
                    n,
                )
                .unwrap();
                let mut c = cache_on(g, spec);
                let shape = [&[n][..], &trailing].concat();
                let slab = GpuSlab {
                    buffer: &buf,
                    dtype: src_dtype,
                    offset,
                    shape: &shape,
                    strides: Some(&strides),
                };
                c.append_gpu(0, &[slab])
                    .unwrap_or_else(|e| panic!("{what}: {e}"));
                let at = offset as usize;
                let want = reference::slab_write(&src_bits, src_dtype, at, &shape, &strides, dtype);
                let got = c.read_words_async(0, 0).await.unwrap();
                let bad = got.iter().zip(&want).position(|(g, w)| g != w);
                assert_eq!(
                    (got.len(), bad),
                    (want.len(), None),
                    "{what}: first mismatch"
                );
            }
        }
    }
    // f32 rows of 7 and of 8 elements into 16-bit storage from buffers that end at their last
    // element (no whole 16-byte vector past it): one row of 7 from 28 bytes, and 3 rows 8 apart
    // from 23 elements.
    for dtype in [DType::F16, DType::BF16] {
        for (n, width, stride, len) in [(1, 7, 7, 7), (3, 7, 8, 23)] {
            let what = format!("{n} f32 rows of {width}, {stride} apart, from {len} into {dtype}");
            let bits = bits_of(91, len, DType::F32);
            let buf = source(g, &bits, DType::F32, STORAGE).await;
            assert_eq!(buf.size(), 4 * len as u64);
            let slot = SlotSpec::new("x", &[width]);
            let spec = CacheSpec::new(vec![LayerSpec::new(vec![slot])], dtype, n).unwrap();
            let mut c = cache_on(g, spec);
            let (shape, strides) = ([n, width], [stride, 1]);
            let slab = GpuSlab {
                buffer: &buf,
                dtype: DType::F32,
                offset: 0,
                shape: &shape,
                strides: Some(&strides),
            };
            c.append_gpu(0, &[slab])
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            let want = reference::slab_write(&bits, DType::F32, 0, &shape, &strides, dtype);
            assert_eq!(c.read_words_async(0, 0).await.unwrap(), want, "{what}");
        }
    }
}

/// A GPU source of the storage type, contiguous, copied as it is. Only the element types: a GPU source
/// holds elements, so quantized storage has no same-typed source (one declared quantized is refused,
/// in `quant_bodies.rs`).
pub async fn contiguous_same_type_and_odd_offsets(g: &Gpu) {
    for dtype in DType::ALL {
        note!("-- {dtype}");
        for (width, offset) in [(4usize, 0u64), (4, 3), (3, 1), (1, 5), (6, 2)] {
            let spec = CacheSpec::new(
                vec![LayerSpec::new(vec![SlotSpec::new("x", &[width])])],
                dtype,
                9,
            )
            .unwrap();
            let (mut c, mut m) = (cache_on(g, spec.clone()), CpuCache::new(&spec));
            let src = bits_of(width as u64, 64, dtype);
            let buf = source(g, &src, dtype, BOTH).await;
            // Two appends: the second lands after the first.
            for (i, n) in [(0usize, 2usize), (1, 3)] {
                let off = offset + (i * 17) as u64;
                let shape = [n, width];
                let slab = GpuSlab {
                    buffer: &buf,
                    dtype,
                    offset: off,
                    shape: &shape,
                    strides: None,
                };
                c.append_gpu(0, &[slab]).unwrap();
                let rows = reference::gather_strided(&src, off as usize, &shape, &[width, 1]);
                m.write_rows(0, 0, if i == 0 { 0 } else { 2 }, &rows);
            }
            assert_eq!(snapshot(&c).await, m.words, "width {width} offset {offset}");
        }
    }
}

pub async fn refused_sources_change_nothing(g: &Gpu) {
    let spec = CacheSpec::new(vec![LayerSpec::kv(2, 4, 4)], DType::F16, 6).unwrap();
    let mut c = cache_on(g, spec);
    let k = values(1, 16);
    c.append(
        0,
        &[HostSlab::f32(&k, &[2, 2, 4]), HostSlab::f32(&k, &[2, 2, 4])],
    )
    .unwrap();
    let before = snapshot(&c).await;
    let ledger = c.ledger().clone();
    let src = bits_of(3, 40, DType::F32);
    let storage_only = source(g, &src, DType::F32, STORAGE).await;
    let copy_only = source(g, &src, DType::F32, wgpu::BufferUsages::COPY_SRC).await;
    let shape = [2, 2, 4];
    let ok = GpuSlab::contiguous(&storage_only, DType::F32, &shape);

    let err = c
        .append_gpu(0, &[ok, GpuSlab { offset: 30, ..ok }])
        .unwrap_err();
    assert_eq!(
        err,
        Error::SourceOutOfBounds {
            layer: 0,
            slot: 1,
            dtype: DType::F32,
            last_element: 45,
            buffer_elements: 40
        }
    );
    let err = c
        .append_gpu(
            0,
            &[
                ok,
                GpuSlab {
                    strides: Some(&[8, 1]),
                    ..ok
                },
            ],
        )
        .unwrap_err();
    assert!(
        matches!(
            &err,
            Error::SourceLayout {
                layer: 0,
                slot: 1,
                problem: SourceProblem::StrideCount { strides: 2, .. }
            }
        ),
        "{err}"
    );
    let err = c
        .append_gpu(
            0,
            &[
                ok,
                GpuSlab {
                    buffer: &copy_only,
                    ..ok
                },
            ],
        )
        .unwrap_err();
    assert!(
        matches!(
            &err,
            Error::SourceLayout {
                slot: 1,
                problem: SourceProblem::NeedsStorage { .. },
                ..
            }
        ),
        "{err}"
    );
    let own = c.full_view(0, 1).unwrap().buffer.clone();
    let err = c
        .append_gpu(
            0,
            &[
                ok,
                GpuSlab {
                    buffer: &own,
                    dtype: DType::F16,
                    ..ok
                },
            ],
        )
        .unwrap_err();
    assert!(
        matches!(
            &err,
            Error::SourceLayout {
                slot: 1,
                problem: SourceProblem::IsDestination,
                ..
            }
        ),
        "{err}"
    );
    let err = c
        .append_gpu(
            0,
            &[
                ok,
                GpuSlab {
                    shape: &[3, 2, 4],
                    ..ok
                },
            ],
        )
        .unwrap_err();
    assert_eq!(
        err,
        Error::RowCountMismatch {
            layer: 0,
            slot: 1,
            expected: 2,
            got: 3
        }
    );
    let big = [5, 2, 4];
    let err = c
        .append_gpu(
            0,
            &[GpuSlab { shape: &big, ..ok }, GpuSlab { shape: &big, ..ok }],
        )
        .unwrap_err();
    assert_eq!(
        err,
        Error::CapacityExceeded {
            seq: None,
            layer: 0,
            position: 2,
            n_new: 5,
            capacity: 6,
            remaining: 4
        }
    );

    // A copy-only source of the storage type must be word-aligned to be copied.
    let copy_only_16 = source(
        g,
        &bits_of(4, 40, DType::F16),
        DType::F16,
        wgpu::BufferUsages::COPY_SRC,
    )
    .await;
    let unaligned = GpuSlab {
        buffer: &copy_only_16,
        dtype: DType::F16,
        offset: 1,
        ..ok
    };
    let err = c.append_gpu(0, &[ok, unaligned]).unwrap_err();
    assert!(
        matches!(
            &err,
            Error::SourceLayout {
                slot: 1,
                problem: SourceProblem::NeedsStorage {
                    why: CopyBlocker::Unaligned { .. },
                    ..
                },
                ..
            }
        ),
        "{err}"
    );

    assert_eq!(c.ledger(), &ledger);
    assert_eq!(snapshot(&c).await, before);
    // The same sources, valid, still work afterwards; word-aligned, the copy-only one is copied.
    let aligned = GpuSlab {
        offset: 2,
        ..unaligned
    };
    c.append_gpu(0, &[ok, aligned]).unwrap();
    assert_eq!(c.visible(0).unwrap(), 4);
    let words = c.read_words_async(0, 1).await.unwrap();
    let src16 = bits_of(4, 40, DType::F16);
    assert_eq!(
        &words[8..],
        reference::pack_rows(&src16[2..18], DType::F16, 8)
    );
}

pub async fn many_recorded_appends_in_one_encoder(g: &Gpu) {
    // Each kernel append takes its own parameter entry, so one submission can carry many.
    let spec = CacheSpec::new(
        vec![LayerSpec::new(vec![SlotSpec::new("x", &[3])])],
        DType::BF16,
        64,
    )
    .unwrap();
    let (mut c, mut m) = (cache_on(g, spec.clone()), CpuCache::new(&spec));
    let src = bits_of(5, 256, DType::F32);
    let buf = source(g, &src, DType::F32, STORAGE).await;
    let mut encoder = g.device.create_command_encoder(&Default::default());
    for i in 0..50usize {
        let shape = [1, 3];
        let slab = GpuSlab {
            buffer: &buf,
            dtype: DType::F32,
            offset: (i * 5) as u64,
            shape: &shape,
            strides: Some(&[3, 1]),
        };
        c.record_append_gpu(&mut encoder, 0, &[slab]).unwrap();
        let bits: Vec<u32> = src[i * 5..i * 5 + 3]
            .iter()
            .map(|&b| reference::convert_bits(b, DType::F32, DType::BF16))
            .collect();
        m.write_rows(0, 0, i, &bits);
    }
    g.queue.submit([encoder.finish()]);
    c.advance(50).unwrap();
    assert_eq!(snapshot(&c).await, m.words);
}

/// A host prefill, then decode steps whose K and V come strided out of a fused QKV buffer on the GPU:
/// rows of 2 x 3 take the slab-write kernel's word path, rows of 2 x 8 at 16-byte offsets its 16-byte
/// path (into f32, f16 and bf16; quantized storage, fp8 included, is written by the quantizing
/// kernel, whatever the offsets). The block types take rows of 2 x 32, from an offset of 13 elements
/// and from a 16-byte one. The views grow by one row per append; every word matches the model.
pub async fn gqa_prefill_then_decode_from_fused_qkv(g: &Gpu) {
    for ((heads, dim, q_dim), dtype) in DType::STORAGE.into_iter().flat_map(|d| {
        let shapes = match d.block() {
            Some(b) => [(2usize, b, 13usize), (2, b, 16)],
            None => [(2, 3, 12), (2, 8, 16)],
        };
        shapes.map(|shape| (shape, d))
    }) {
        note!("-- {dtype}, {heads} x {dim}");
        let kv_dim = heads * dim;
        let width = q_dim + 2 * kv_dim;
        let spec = CacheSpec::uniform(2, LayerSpec::kv(heads, dim, dim), dtype, 12).unwrap();
        let (mut c, mut m) = (cache_on(g, spec.clone()), CpuCache::new(&spec));
        // Prefill 5 tokens from the host.
        for layer in 0..2 {
            append_both(&mut c, &mut m, layer, 5, 7 + layer as u64);
        }
        c.advance(5).unwrap();
        // Decode 3 tokens, K and V strided out of a fused QKV buffer on the GPU.
        for step in 0..3u64 {
            let qkv = values(50 + step, width);
            let bits: Vec<u32> = qkv.iter().map(|x| x.to_bits()).collect();
            let src = source(g, &bits, DType::F32, super::USAGE).await;
            let shape = [1, heads, dim];
            let strides = [width, dim, 1];
            for l in 0..2 {
                let row = c.visible(l).unwrap();
                let slab = |offset: usize| GpuSlab {
                    buffer: &src,
                    dtype: DType::F32,
                    offset: offset as u64,
                    shape: &shape,
                    strides: Some(&strides),
                };
                c.append_gpu(l, &[slab(q_dim), slab(q_dim + kv_dim)])
                    .unwrap();
                for (s, offset) in [q_dim, q_dim + kv_dim].into_iter().enumerate() {
                    let want: Vec<u32> = reference::gather_strided(&bits, offset, &shape, &strides)
                        .into_iter()
                        .map(|b| reference::convert_bits(b, DType::F32, dtype))
                        .collect();
                    m.write_rows(l, s, row, &want);
                }
                assert_eq!(c.view(l, 0).unwrap().rows, 5 + step as usize + 1);
            }
            c.advance(1).unwrap();
        }
        assert_eq!(c.len(), 8);
        assert_eq!(snapshot(&c).await, m.words, "{dtype}: stored words");
        let v = c.read_f32_async(1, 1).await.unwrap();
        assert_eq!(v.len(), 8 * kv_dim);
        assert_eq!(v, m.read_f32(1, 1, 8), "{dtype}: V of layer 1");
    }
}
