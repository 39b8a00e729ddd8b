//! The cache on the GPU against the plain-Rust model, for every storage type (the element types and
//! the quantized ones, with whole-block widths for q8_0 and q4_0): one async body per scenario, run
//! natively by `tests/core.rs` and in the browser by `tests/web.rs`.

use super::{
    append_both, append_random, assert_matches, buffer_with, cache_on, default_limits_gpu,
    model_rows, snapshot, values,
};
use kvgpu::reference::{self, CpuCache};
use kvgpu::wgpu;
use kvgpu::*;

/// The expected f32 contents of rows of `row_elems` appended from `data` (rounded through the storage
/// type, the block types block by block).
fn rounded(data: &[f32], dtype: DType, row_elems: usize) -> Vec<f32> {
    reference::round_trip_rows(data, dtype, row_elems)
}

/// A width for `dtype`: `odd` for the types stored element by element (f32, f16, bf16, fp8), `blocks`
/// whole blocks of 32 for the block types (q8_0, q4_0), which refuse any other width.
fn width(dtype: DType, odd: usize, blocks: usize) -> usize {
    match dtype.block() {
        Some(b) => b * blocks,
        None => odd,
    }
}

/// Decode steps of `steps[i]` rows each into every slotted layer of `layers`, the length checked after
/// every step, then every slot read back as f32 and word for word against the model.
async fn decode_steps(g: &Gpu, layers: Vec<LayerSpec>, dtype: DType, steps: &[usize]) {
    let spec = CacheSpec::new(layers, dtype, 16).unwrap();
    let (mut c, mut m) = (cache_on(g, spec.clone()), CpuCache::new(&spec));
    let slotted: Vec<usize> = (0..spec.layers().len())
        .filter(|&l| !spec.layers()[l].slots.is_empty())
        .collect();
    let mut len = 0;
    for (step, &n) in steps.iter().enumerate() {
        for &layer in &slotted {
            append_both(&mut c, &mut m, layer, n, (step * 10 + layer) as u64);
        }
        c.advance(n).unwrap();
        len += n;
        assert_eq!(c.len(), len);
    }
    for &layer in &slotted {
        for s in 0..2 {
            let got = c.read_f32_async(layer, s).await.unwrap();
            assert_eq!(got.len(), len * spec.layers()[layer].slots[s].row_elems());
            assert_eq!(
                got,
                m.read_f32(layer, s, len),
                "{dtype}: layer {layer} slot {s}"
            );
        }
    }
    assert_matches(&c, &m).await;
}

/// MLA decode: two DeepSeek-sized layers one row per step, and odd widths (16-bit and fp8 rows padded;
/// for the block types an odd number of blocks, so the last word of scales is half padding) with a
/// linear-attention layer between them, steps of several rows.
pub async fn mla_decode_steps_read_back_in_order(g: &Gpu) {
    for dtype in DType::STORAGE {
        note!("-- {dtype}");
        decode_steps(g, vec![LayerSpec::mla(512, 64); 2], dtype, &[1; 5]).await;
        let (r, p) = (width(dtype, 9, 3), width(dtype, 3, 1));
        let layers = vec![
            LayerSpec::mla(r, p),
            LayerSpec::empty(),
            LayerSpec::mla(r, p),
        ];
        decode_steps(g, layers, dtype, &[4, 1, 1, 2, 1]).await;
    }
}

pub async fn gqa_prefill_then_decode(g: &Gpu) {
    for dtype in DType::STORAGE {
        note!("-- {dtype}");
        let (dk, dv) = (width(dtype, 16, 2), width(dtype, 8, 1));
        let spec = CacheSpec::uniform(3, LayerSpec::kv(2, dk, dv), dtype, 40).unwrap();
        // V rows of 2 heads x dv, as the storage type lays them out (the module docs of
        // kvgpu::codec): 16-bit and fp8 elements, or values then one f16 scale per block.
        let v_row_bytes = match dtype {
            DType::Q8_0 => 2 * dv + 2 * (2 * dv / 32),
            DType::Q4_0 => dv + 2 * (2 * dv / 32),
            _ => 2 * dv * dtype.size(),
        } as u64;
        let (mut c, mut m) = (cache_on(g, spec.clone()), CpuCache::new(&spec));
        for layer in 0..3 {
            append_both(&mut c, &mut m, layer, 17, 100 + layer as u64);
        }
        c.advance(17).unwrap();
        for step in 0..4 {
            for layer in 0..3 {
                append_both(&mut c, &mut m, layer, 1, 200 + step * 3 + layer as u64);
                assert_eq!(c.visible(layer).unwrap(), 18 + step as usize);
                let view = c.view(layer, 1).unwrap();
                assert_eq!(
                    (view.rows, view.size),
                    (18 + step as usize, (18 + step) * v_row_bytes)
                );
            }
            c.advance(1).unwrap();
        }
        assert_eq!(c.len(), 21);
        assert_eq!(c.read_f32_async(2, 0).await.unwrap(), m.read_f32(2, 0, 21));
        assert_matches(&c, &m).await;
    }
}

/// Slots of rank 3, 1 and 0 (odd widths). The block types take no rank-0 slot (a row of one element
/// is not a whole block: the spec refuses it), so theirs is a row of one block, and their innermost
/// widths are whole blocks (the odd slot three, so its last word of scales is half padding).
pub async fn rank_3_slot_and_odd_widths(g: &Gpu) {
    for dtype in DType::STORAGE {
        note!("-- {dtype}");
        let odd = width(dtype, 3, 3);
        let slots = |scalar: &[usize]| {
            vec![LayerSpec::new(vec![
                SlotSpec::new("cube", &[2, 3, width(dtype, 5, 1)]),
                SlotSpec::new("odd", &[odd]),
                SlotSpec::new("scalar", scalar),
            ])]
        };
        let scalar: &[usize] = match dtype.block() {
            Some(b) => {
                let e = CacheSpec::new(slots(&[]), dtype, 9).unwrap_err();
                assert!(
                    matches!(
                        &e,
                        Error::InvalidSpec {
                            problem: SpecProblem::BlockWidth {
                                layer: 0,
                                slot: 2,
                                width: 1,
                                block: 32,
                                ..
                            }
                        }
                    ),
                    "{dtype}: {e}"
                );
                &[b]
            }
            None => &[],
        };
        let spec = CacheSpec::new(slots(scalar), dtype, 9).unwrap();
        let (mut c, mut m) = (cache_on(g, spec.clone()), CpuCache::new(&spec));
        append_both(&mut c, &mut m, 0, 4, 7);
        append_both(&mut c, &mut m, 0, 1, 8);
        c.advance(5).unwrap();
        assert_eq!(c.read_f32_async(0, 1).await.unwrap().len(), 5 * odd);
        assert_eq!(c.read_f32_async(0, 2).await.unwrap(), m.read_f32(0, 2, 5));
        assert_matches(&c, &m).await;
    }
}

pub async fn layers_are_isolated_and_hybrid_layers_own_nothing(g: &Gpu) {
    for dtype in DType::STORAGE {
        note!("-- {dtype}");
        let spec = CacheSpec::hybrid(dtype, 6).unwrap();
        assert_eq!(spec.layer_bytes_per_token(0).unwrap(), 0);
        let (mut c, mut m) = (cache_on(g, spec.clone()), CpuCache::new(&spec));
        // Only layer 7 gets rows: every other buffer stays zero.
        append_both(&mut c, &mut m, 7, 2, 3);
        assert_eq!(c.visible(7).unwrap(), 2);
        assert_eq!(c.visible(3).unwrap(), 0);
        assert_matches(&c, &m).await;
        // Layers without slots take empty appends and have no views.
        c.append(0, &[]).unwrap();
        assert!(matches!(
            c.view(0, 0),
            Err(Error::SlotOutOfRange {
                layer: 0,
                slot: 0,
                n_slots: 0
            })
        ));
        let err = c.advance(2).unwrap_err();
        assert_eq!(
            err,
            Error::UnevenAdvance {
                seq: None,
                layer: 3,
                pending: 0,
                expected: 2,
                len: 0
            }
        );
        for layer in (3..24).step_by(4).filter(|&l| l != 7) {
            append_both(&mut c, &mut m, layer, 2, layer as u64);
        }
        c.advance(2).unwrap();
        assert_matches(&c, &m).await;
    }
}

/// Every refused append, advance, truncate and view leaves the ledger and every word of GPU memory
/// as they were, pending rows included; rolling back then drops the pending rows.
pub async fn every_refusal_leaves_the_cache_unchanged(g: &Gpu) {
    for dtype in DType::STORAGE {
        note!("-- {dtype}");
        let (r, p, d) = (width(dtype, 6, 2), width(dtype, 3, 1), width(dtype, 4, 1));
        let spec =
            CacheSpec::new(vec![LayerSpec::mla(r, p), LayerSpec::kv(2, d, d)], dtype, 5).unwrap();
        let (mut c, mut m) = (cache_on(g, spec.clone()), CpuCache::new(&spec));
        append_both(&mut c, &mut m, 0, 2, 1);
        append_both(&mut c, &mut m, 1, 2, 2);
        c.advance(2).unwrap();
        append_both(&mut c, &mut m, 0, 1, 3);
        let before = snapshot(&c).await;
        assert_eq!(before, m.words);
        let ledger = c.ledger().clone();

        // A source buffer for the quantized types' refusal below.
        let zeros = buffer_with(&g.device, &vec![0; 4 * r], super::USAGE).await;
        let a6 = values(9, r * 4);
        let a3 = values(10, p * 4);
        let wrong_type_16 = vec![half::f16::ZERO; r];
        let wrong_type_bf = vec![half::bf16::ZERO; r];
        let mut refusals: Vec<(&str, Result<AppendPlan>)> = vec![
            ("layer out of range", c.append(2, &[])),
            (
                "wrong slot count",
                c.append(0, &[HostSlab::f32(&a6[..r], &[1, r])]),
            ),
            (
                "slab shape",
                c.append(
                    0,
                    &[
                        HostSlab::f32(&a6[..r], &[1, r]),
                        HostSlab::f32(&a3[..p + 1], &[1, p + 1]),
                    ],
                ),
            ),
            (
                "n_new differs",
                c.append(
                    0,
                    &[
                        HostSlab::f32(&a6[..2 * r], &[2, r]),
                        HostSlab::f32(&a3[..p], &[1, p]),
                    ],
                ),
            ),
            (
                "capacity",
                c.append(
                    0,
                    &[
                        HostSlab::f32(&a6[..3 * r], &[3, r]),
                        HostSlab::f32(&a3[..3 * p], &[3, p]),
                    ],
                ),
            ),
            (
                "data length",
                c.append(
                    0,
                    &[
                        HostSlab::f32(&a6[..r - 1], &[1, r]),
                        HostSlab::f32(&a3[..p], &[1, p]),
                    ],
                ),
            ),
        ];
        if dtype.is_quantized() {
            // Quantized storage takes host data of every element type; what it refuses is a GPU
            // source declared quantized.
            let slab = |shape| GpuSlab {
                buffer: &zeros,
                dtype,
                offset: 0,
                shape,
                strides: None,
            };
            refusals.push((
                "source dtype",
                c.append_gpu(0, &[slab(&[1, r]), slab(&[1, p])]),
            ));
        } else {
            // A 16-bit source of the other 16-bit type (or any 16-bit source into f32 storage) is
            // refused.
            let shape = [1, r];
            let other = if dtype == DType::F16 {
                HostSlab::bf16(&wrong_type_bf, &shape)
            } else {
                HostSlab::f16(&wrong_type_16, &shape)
            };
            refusals.push((
                "source dtype",
                c.append(0, &[other, HostSlab::f32(&a3[..p], &[1, p])]),
            ));
        }
        for (what, r) in &refusals {
            let err = r.as_ref().expect_err(what);
            note!("{what}: {err}");
        }
        let expect = |i: usize| refusals[i].1.clone().unwrap_err();
        assert_eq!(
            expect(0),
            Error::LayerOutOfRange {
                layer: 2,
                n_layers: 2
            }
        );
        assert_eq!(
            expect(1),
            Error::SlotCount {
                layer: 0,
                expected: 2,
                got: 1
            }
        );
        assert_eq!(
            expect(2),
            Error::SlabShape {
                layer: 0,
                slot: 1,
                expected: vec![p],
                got: vec![1, p + 1]
            }
        );
        assert_eq!(
            expect(3),
            Error::RowCountMismatch {
                layer: 0,
                slot: 1,
                expected: 2,
                got: 1
            }
        );
        assert_eq!(
            expect(4),
            Error::CapacityExceeded {
                seq: None,
                layer: 0,
                position: 3,
                n_new: 3,
                capacity: 5,
                remaining: 2
            }
        );
        assert_eq!(
            expect(5),
            Error::SourceSize {
                layer: 0,
                slot: 0,
                shape: vec![1, r],
                expected: r,
                got: r - 1
            }
        );
        if dtype.is_quantized() {
            assert_eq!(
                expect(6),
                Error::SourceLayout {
                    layer: 0,
                    slot: 0,
                    problem: SourceProblem::QuantizedSource { dtype }
                }
            );
        } else {
            assert!(matches!(
                expect(6),
                Error::SourceDType {
                    layer: 0,
                    slot: 0,
                    ..
                }
            ));
        }
        // Layer 0 appended, layer 1 forgotten: advance names the layer and commits nothing.
        let err = c.advance(1).unwrap_err();
        assert_eq!(
            err,
            Error::UnevenAdvance {
                seq: None,
                layer: 1,
                pending: 0,
                expected: 1,
                len: 2
            }
        );
        assert!(err.to_string().contains("layer 1"), "{err}");
        assert_eq!(
            c.truncate(3).unwrap_err(),
            Error::TruncateBeyondLength {
                seq: None,
                new_len: 3,
                len: 2,
            }
        );
        assert_eq!(
            c.truncate_and_scrub(4).unwrap_err(),
            Error::TruncateBeyondLength {
                seq: None,
                new_len: 4,
                len: 2,
            }
        );
        assert!(matches!(
            c.view(1, 2),
            Err(Error::SlotOutOfRange {
                layer: 1,
                slot: 2,
                n_slots: 2
            })
        ));
        assert_eq!(c.ledger(), &ledger, "a refusal changed the ledger");
        assert_eq!(
            (c.len(), c.visible(0).unwrap()),
            (2, 3),
            "the pending row of layer 0 is kept"
        );
        assert_eq!(snapshot(&c).await, before, "a refusal changed GPU memory");
        assert_matches(&c, &m).await;
        // Rolling back drops the pending row.
        c.truncate(2).unwrap();
        assert_eq!(c.visible(0).unwrap(), 2);
    }
}

pub async fn full_capacity_then_overflow_then_truncate_and_reappend(g: &Gpu) {
    for dtype in DType::STORAGE {
        note!("-- {dtype}");
        let (dk, dv) = (width(dtype, 3, 1), width(dtype, 5, 2));
        let spec = CacheSpec::new(vec![LayerSpec::kv(1, dk, dv)], dtype, 4).unwrap();
        let (mut c, mut m) = (cache_on(g, spec.clone()), CpuCache::new(&spec));
        append_both(&mut c, &mut m, 0, 4, 1);
        c.advance(4).unwrap();
        assert!(c.is_full());
        assert_eq!(c.remaining(), 0);
        let before = snapshot(&c).await;
        let (k, v) = (values(5, dk), values(6, dv));
        let err = c
            .append(
                0,
                &[
                    HostSlab::f32(&k, &[1, 1, dk]),
                    HostSlab::f32(&v, &[1, 1, dv]),
                ],
            )
            .unwrap_err();
        assert_eq!(
            err,
            Error::CapacityExceeded {
                seq: None,
                layer: 0,
                position: 4,
                n_new: 1,
                capacity: 4,
                remaining: 0
            }
        );
        assert_eq!(snapshot(&c).await, before);

        // O(1) truncate keeps the bytes; re-appending overwrites them.
        c.truncate(2).unwrap();
        assert_eq!((c.len(), c.remaining()), (2, 2));
        assert_eq!(snapshot(&c).await, before);
        append_both(&mut c, &mut m, 0, 1, 9);
        c.advance(1).unwrap();
        assert_eq!(c.read_f32_async(0, 1).await.unwrap(), m.read_f32(0, 1, 3));
        assert_matches(&c, &m).await;

        // Truncate with scrub zeroes the dropped rows, pending ones included.
        append_both(&mut c, &mut m, 0, 1, 10);
        c.truncate_and_scrub(1).unwrap();
        m.zero_rows(0, 1, 4);
        assert_eq!(c.len(), 1);
        assert_matches(&c, &m).await;
        // Row 0 of K is the first row of the first append (seed 1, slot 0: `values(31, ..)`).
        assert_eq!(
            c.read_f32_async(0, 0).await.unwrap(),
            rounded(&values(31, dk), dtype, dk)
        );
    }
}

/// A scrub zeroes the dropped rows of every layer and keeps the rest; `reset_fast` keeps every byte,
/// `reset` zeroes every byte of every slot, and the cache is usable again after both.
pub async fn reset_zeroes_every_byte_and_reset_fast_keeps_data(g: &Gpu) {
    for dtype in DType::STORAGE {
        note!("-- {dtype}");
        let spec = CacheSpec::new(
            vec![
                LayerSpec::mla(width(dtype, 33, 3), width(dtype, 7, 1)),
                LayerSpec::empty(),
                LayerSpec::kv(3, width(dtype, 5, 1), width(dtype, 2, 2)),
            ],
            dtype,
            64,
        )
        .unwrap();
        let (mut c, mut m) = (cache_on(g, spec.clone()), CpuCache::new(&spec));
        for layer in [0, 2] {
            append_both(&mut c, &mut m, layer, 64, layer as u64 + 1);
        }
        c.advance(64).unwrap();
        assert_matches(&c, &m).await;

        c.truncate_and_scrub(40).unwrap();
        for layer in [0, 2] {
            m.zero_rows(layer, 40, 64);
        }
        assert_matches(&c, &m).await;
        for layer in [0, 2] {
            for s in 0..2 {
                assert!(
                    m.words[layer][s].iter().any(|&w| w != 0),
                    "rows 0..40 of layer {layer} slot {s} kept"
                );
            }
        }

        c.reset_fast();
        assert_eq!(c.len(), 0);
        assert_matches(&c, &m).await;

        c.reset().unwrap();
        assert_eq!(c.len(), 0);
        for (l, layer) in snapshot(&c).await.iter().enumerate() {
            for (s, words) in layer.iter().enumerate() {
                assert!(!words.is_empty(), "layer {l} slot {s} read back nothing");
                assert!(
                    words.iter().all(|&w| w == 0),
                    "reset left non-zero bytes in layer {l} slot {s}"
                );
            }
        }
        m.zero_all();
        append_both(&mut c, &mut m, 0, 1, 50);
        append_both(&mut c, &mut m, 2, 1, 51);
        c.advance(1).unwrap();
        assert_matches(&c, &m).await;
    }
}

/// Two scrubs and a reset recorded into one encoder between the app's own copies of a slot, and
/// submitted once: each copy sees the slot as the commands recorded before it left it.
pub async fn recorded_ops_share_one_encoder(g: &Gpu) {
    let spec = CacheSpec::new(vec![LayerSpec::kv(2, 4, 4)], DType::F16, 8).unwrap();
    let (mut c, mut m) = (cache_on(g, spec.clone()), CpuCache::new(&spec));
    append_both(&mut c, &mut m, 0, 6, 1);
    c.advance(6).unwrap();
    let slot = c.full_view(0, 0).unwrap().buffer.clone();
    let size = slot.size();
    let copies: Vec<wgpu::Buffer> = (0..3)
        .map(|_| {
            g.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("the app's copy"),
                size,
                usage: wgpu::BufferUsages::COPY_DST | wgpu::BufferUsages::COPY_SRC,
                mapped_at_creation: false,
            })
        })
        .collect();
    let mut encoder = g.device.create_command_encoder(&Default::default());
    c.record_truncate_and_scrub(&mut encoder, 4).unwrap();
    encoder.copy_buffer_to_buffer(&slot, 0, &copies[0], 0, size);
    c.record_truncate_and_scrub(&mut encoder, 2).unwrap();
    encoder.copy_buffer_to_buffer(&slot, 0, &copies[1], 0, size);
    c.record_reset(&mut encoder).unwrap();
    encoder.copy_buffer_to_buffer(&slot, 0, &copies[2], 0, size);
    g.queue.submit([encoder.finish()]);
    let mut want = Vec::new();
    for (start, end) in [(4, 6), (2, 4)] {
        m.zero_rows(0, start, end);
        want.push(m.words[0][0].clone());
    }
    want.push(vec![0; m.words[0][0].len()]);
    assert!(want[1].iter().any(|&w| w != 0), "rows 0 and 1 hold data");
    for (i, (copy, want)) in copies.iter().zip(&want).enumerate() {
        let bytes = read_buffer_async(&g.device, &g.queue, copy, 0, size)
            .await
            .unwrap();
        let words: Vec<u32> = bytemuck::pod_collect_to_vec(&bytes);
        assert_eq!(&words, want, "the app's copy {i}");
    }
    m.zero_all();
    assert_matches(&c, &m).await;
}

pub async fn views_narrow_to_visible_rows(g: &Gpu) {
    let spec = CacheSpec::new(vec![LayerSpec::kv(2, 3, 3)], DType::BF16, 10).unwrap();
    let mut c = cache_on(g, spec);
    assert!(c.view(0, 0).unwrap().binding().is_none());
    let k = values(1, 3 * 6);
    c.append(
        0,
        &[HostSlab::f32(&k, &[3, 2, 3]), HostSlab::f32(&k, &[3, 2, 3])],
    )
    .unwrap();
    let view = c.view(0, 0).unwrap();
    assert_eq!((view.rows, view.row_bytes, view.size), (3, 12, 36));
    let binding = view.binding().unwrap();
    assert_eq!(
        (binding.offset, binding.size.map(|s| s.get())),
        (0, Some(36))
    );
    let full = c.full_view(0, 1).unwrap();
    assert_eq!((full.rows, full.size), (10, 120));
    assert_eq!(c.read_words_async(0, 0).await.unwrap().len(), 9);
}

/// A buffer the app destroyed is not read back, nor a cache whose slot it destroyed through a view:
/// both calls are refused. In the browser, where a destroyed buffer looks unmapped and only
/// WebGPU's submission checks it, both returned `Ok` with the staging buffer's bytes (zeros, or
/// the previous slot's rows in an export) and left an uncaptured error.
pub async fn destroyed_buffers_are_not_read_back(g: &Gpu) {
    let b = g.device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("destroyed"),
        size: 16,
        usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
        mapped_at_creation: false,
    });
    b.destroy();
    let e = read_buffer_async(&g.device, &g.queue, &b, 0, 16)
        .await
        .unwrap_err();
    assert!(matches!(e, Error::Device { .. }), "{e}");
    let spec = CacheSpec::new(vec![LayerSpec::kv(1, 4, 4)], DType::F32, 4).unwrap();
    let mut c = cache_on(g, spec);
    let k = values(2, 8);
    c.append(
        0,
        &[HostSlab::f32(&k, &[2, 1, 4]), HostSlab::f32(&k, &[2, 1, 4])],
    )
    .unwrap();
    c.advance(2).unwrap();
    c.view(0, 1).unwrap().buffer.destroy();
    let mut out = Vec::new();
    // Natively the destroyed slot is known before anything is read; in the browser the readback's
    // submission refuses it.
    let e = c.export_async(&mut out).await.unwrap_err();
    assert!(
        matches!(
            e,
            Error::Readback { .. } | Error::UnusableSlot { slot: 1, .. }
        ),
        "{e}"
    );
}

/// 16-bit host data already in the storage type is stored as is, and f32 host data is rounded to
/// nearest even exactly like `half`: subnormals, signed zero, overflow to infinity, large magnitudes,
/// rows of odd width (the padding half stays zero). Only f16 and bf16: the test is about 16-bit data
/// that needs no conversion and about `half`'s rounding; host data into quantized storage is quantized
/// (bit for bit against the twin in `quant_bodies.rs`).
pub async fn host_data_already_in_the_storage_type_is_stored_as_is(g: &Gpu) {
    for dtype in [DType::F16, DType::BF16] {
        let spec = CacheSpec::new(
            vec![LayerSpec::new(vec![SlotSpec::new("x", &[5])])],
            dtype,
            4,
        )
        .unwrap();
        let mut c = cache_on(g, spec);
        let raw = values(4, 10);
        let words = match dtype {
            DType::F16 => {
                let d: Vec<half::f16> = raw.iter().map(|&x| half::f16::from_f32(x)).collect();
                c.append(0, &[HostSlab::f16(&d, &[2, 5])]).unwrap();
                d.iter().map(|x| x.to_bits() as u32).collect::<Vec<_>>()
            }
            _ => {
                let d: Vec<half::bf16> = raw.iter().map(|&x| half::bf16::from_f32(x)).collect();
                c.append(0, &[HostSlab::bf16(&d, &[2, 5])]).unwrap();
                d.iter().map(|x| x.to_bits() as u32).collect::<Vec<_>>()
            }
        };
        assert_eq!(
            c.read_words_async(0, 0).await.unwrap(),
            reference::pack_rows(&words, dtype, 5)
        );
    }
    // Values that exercise rounding, subnormals, signed zero, overflow to infinity and large magnitudes.
    let specials = [
        0.0f32,
        -0.0,
        1.0,
        -1.5,
        1.0e-7,
        -6.0e-8,
        65504.0,
        70000.0,
        3.0e38,
        0.1,
        1.0 / 3.0,
        -2.75,
        1.0e-40,
        255.5,
        -1024.25,
        7.0,
    ];
    for dtype in [DType::F16, DType::BF16] {
        // Rows of 7 elements: 14 bytes, padded to 16.
        let spec = CacheSpec::new(vec![LayerSpec::kv(1, 7, 7)], dtype, 8).unwrap();
        let mut c = cache_on(g, spec.clone());
        let k: Vec<f32> = specials.iter().copied().cycle().take(2 * 7).collect();
        let v = values(21, 2 * 7);
        // K from f32 (converted on the host), V already in the storage type.
        if dtype == DType::F16 {
            let v16: Vec<half::f16> = v.iter().map(|&x| half::f16::from_f32(x)).collect();
            let slabs = [
                HostSlab::f32(&k, &[2, 1, 7]),
                HostSlab::f16(&v16, &[2, 1, 7]),
            ];
            c.append(0, &slabs).unwrap();
        } else {
            let v16: Vec<half::bf16> = v.iter().map(|&x| half::bf16::from_f32(x)).collect();
            let slabs = [
                HostSlab::f32(&k, &[2, 1, 7]),
                HostSlab::bf16(&v16, &[2, 1, 7]),
            ];
            c.append(0, &slabs).unwrap();
        }
        c.advance(2).unwrap();
        let mut m = CpuCache::new(&spec);
        m.write_rows(0, 0, 0, &reference::host_bits(HostData::F32(&k), dtype));
        m.write_rows(0, 1, 0, &reference::host_bits(HostData::F32(&v), dtype));
        assert_eq!(snapshot(&c).await, m.words, "{dtype}: stored words");
        assert_eq!(c.read_words_async(0, 0).await.unwrap().len(), 2 * 4);
        let got = c.read_f32_async(0, 0).await.unwrap();
        let want: Vec<f32> = k.iter().map(|&x| reference::round_trip(x, dtype)).collect();
        assert_eq!(
            got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            want.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            "{dtype}"
        );
        if dtype == DType::F16 {
            assert!(got[7].is_infinite(), "70000 overflows f16");
        }
    }
}

/// Rows of 1 to 9 words (fp8 1 to 3; the block types one and three blocks: q8_0 rows of 9 and 26
/// words, q4_0 of 5 and 14) and every (cut, end) pair: the scrubbed range starts and ends at every
/// offset within a 16-byte vector (32-byte for the zeroing kernel of 64-bit words, on lavapipe), and
/// the words around it must survive.
pub async fn scrub_matches_the_zero_twin_at_every_word_offset(g: &Gpu) {
    for dtype in DType::STORAGE {
        note!("-- {dtype}");
        let widths = match dtype.block() {
            Some(b) => vec![b, 3 * b],
            None => vec![1usize, 3, 5, 9],
        };
        for width in widths {
            let capacity = 9;
            let spec = CacheSpec::new(
                vec![LayerSpec::new(vec![SlotSpec::new("x", &[width])])],
                dtype,
                capacity,
            )
            .unwrap();
            let (mut c, mut m) = (cache_on(g, spec.clone()), CpuCache::new(&spec));
            let row_words = m.row_words(0, 0);
            append_both(&mut c, &mut m, 0, capacity, 99);
            c.advance(capacity).unwrap();
            for end in 1..=capacity {
                for cut in 0..end {
                    // Rows [0, end) are rewritten, then [cut, end) scrubbed; rows from `end` on keep
                    // their data.
                    c.reset_fast();
                    append_both(&mut c, &mut m, 0, end, (end * 16 + cut) as u64);
                    c.advance(end).unwrap();
                    c.truncate_and_scrub(cut).unwrap();
                    reference::zero(&mut m.words[0][0], cut * row_words, (end - cut) * row_words);
                    assert_eq!(
                        c.read_full_words_async(0, 0).await.unwrap(),
                        m.words[0][0],
                        "{dtype} width {width} rows [{cut}, {end})"
                    );
                }
            }
        }
    }
}

/// Three slots: each reset stages three parameter entries. Over 3,300 entries fill several ring
/// buffers, and a reset's entries that do not fit the rest of one buffer go on in the next.
pub async fn parameters_move_on_to_fresh_buffers_inside_one_batch(g: &Gpu) {
    let spec = CacheSpec::new(
        vec![LayerSpec::new(vec![
            SlotSpec::new("a", &[4]),
            SlotSpec::new("b", &[3]),
            SlotSpec::new("c", &[5]),
        ])],
        DType::F32,
        2,
    )
    .unwrap();
    let (mut c, mut m) = (cache_on(g, spec.clone()), CpuCache::new(&spec));
    let resets = 1100;
    for i in 0..resets {
        append_both(&mut c, &mut m, 0, 1, i as u64);
        c.reset().unwrap();
        m.zero_all();
        // A reset stages 3 entries: with 1,024 entries per ring buffer (the software adapters'),
        // resets 341 and 682 start in one buffer and end in the next.
        if i % 256 == 0 || i % 341 == 0 || i + 2 >= resets {
            assert_matches(&c, &m).await;
        }
    }
    append_both(&mut c, &mut m, 0, 2, 7);
    c.truncate(0).unwrap();
    assert_matches(&c, &m).await;
}

/// Copy into another cache from the source's views (the README's recipe), and save / restore
/// through `read_f32` + append: every word arrives, 16-bit and fp8 rows of odd width included, and
/// block rows of an odd number of blocks. GPU sources hold elements, so the views of quantized
/// storage cannot be a source: for those types the recipe is refused (`QuantizedSource`) and changes
/// nothing, and the restore, which quantizes the read values again, must give back every word.
pub async fn a_sequence_moves_between_caches(g: &Gpu) {
    for dtype in DType::STORAGE {
        note!("-- {dtype}");
        let (even, odd) = (width(dtype, 4, 1), width(dtype, 5, 3));
        let spec = CacheSpec::new(
            vec![LayerSpec::new(vec![
                SlotSpec::new("even", &[2, even]),
                SlotSpec::new("odd", &[odd]),
            ])],
            dtype,
            16,
        )
        .unwrap();
        let mut src = cache_on(g, spec.clone());
        append_random(&mut src, 0, 7, 3);
        src.advance(7).unwrap();
        let mut copy = cache_on(g, spec.clone());
        let views: Vec<SlotView> = (0..2).map(|s| src.view(0, s).unwrap()).collect();
        let shapes = [vec![7, 2, even], vec![7, odd]];
        let strides: Vec<Vec<usize>> = views
            .iter()
            .zip(&shapes)
            .map(|(v, sh)| {
                let per_row = v.row_bytes as usize / dtype.size();
                let mut st = vec![per_row];
                st.extend(sh[1..].iter().rev().scan(1, |acc, &d| {
                    let s = *acc;
                    *acc *= d;
                    Some(s)
                }));
                st[1..].reverse();
                st
            })
            .collect();
        let slabs: Vec<GpuSlab> = (0..2)
            .map(|s| GpuSlab {
                buffer: views[s].buffer,
                dtype,
                offset: 0,
                shape: &shapes[s],
                strides: Some(&strides[s]),
            })
            .collect();
        let original = snapshot(&src).await;
        if dtype.is_quantized() {
            let before = snapshot(&copy).await;
            let e = copy.append_gpu(0, &slabs).unwrap_err();
            assert_eq!(
                e,
                Error::SourceLayout {
                    layer: 0,
                    slot: 0,
                    problem: SourceProblem::QuantizedSource { dtype }
                },
                "{dtype}: the views as a source"
            );
            assert_eq!(
                copy.visible(0).unwrap(),
                0,
                "{dtype}: refused, yet appended"
            );
            assert_eq!(
                snapshot(&copy).await,
                before,
                "{dtype}: refused, yet written"
            );
        } else {
            copy.append_gpu(0, &slabs).unwrap();
            copy.advance(7).unwrap();
            assert_eq!(snapshot(&copy).await, original, "{dtype}: copied");
        }
        let mut restored = cache_on(g, spec);
        let mut saved = Vec::new();
        for s in 0..2 {
            saved.push(src.read_f32_async(0, s).await.unwrap());
        }
        restored
            .append(
                0,
                &[
                    HostSlab::f32(&saved[0], &shapes[0]),
                    HostSlab::f32(&saved[1], &shapes[1]),
                ],
            )
            .unwrap();
        restored.advance(7).unwrap();
        assert_eq!(snapshot(&restored).await, original, "{dtype}: restored");
    }
}

/// One slot of `[8, 128]` f32 (4 KiB rows) with room for `capacity` rows.
pub fn one_k_slot(capacity: usize) -> CacheSpec {
    CacheSpec::new(
        vec![LayerSpec::new(vec![SlotSpec::new("k", &[8, 128])])],
        DType::F32,
        capacity,
    )
    .unwrap()
}

/// A slot one row larger than the device binds is refused with the capacity that fits, on the
/// adapter's own limits (what `Gpu` requests) and on WebGPU's defaults (what a page gets when it asks
/// for nothing), without reaching wgpu; a cache on the default-limits device works as usual.
pub async fn slot_over_the_binding_limit_is_refused_with_the_capacity_that_fits(g: &Gpu) {
    let d = default_limits_gpu(g).await;
    assert_eq!(d.limits(), DeviceLimits::WEBGPU_DEFAULT);
    for gpu in [g, &d] {
        let limits = gpu.limits();
        let limit = limits.max_slot_bytes();
        let fits = (limit / 4096) as usize;
        let spec = one_k_slot(fits + 1);
        let scope = gpu.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let err = KvCache::new(&gpu.device, &gpu.queue, spec.clone()).expect_err("refused");
        let shared =
            KvCache::with_kernels(Kernels::new(&gpu.device, &gpu.queue).unwrap(), spec.clone())
                .expect_err("refused with a shared registry too");
        assert!(
            scope.pop().await.is_none(),
            "a refused cache must not reach wgpu"
        );
        assert_eq!(
            err,
            Error::SlotTooLarge {
                layer: 0,
                slot: 0,
                bytes: 4096 * (fits as u64 + 1),
                row_bytes: 4096,
                capacity: fits + 1,
                limit,
                max_capacity: fits,
            }
        );
        assert_eq!(shared, err);
        assert!(err.to_string().contains(&fits.to_string()), "{err}");
        assert_eq!(spec.max_capacity_for(&limits), fits);
        note!("refused as expected: {err}");
    }
    // A cache on the default-limits device works as usual.
    let spec = CacheSpec::new(vec![LayerSpec::mla(5, 3)], DType::F16, 4).unwrap();
    let (mut c, mut m) = (cache_on(&d, spec.clone()), CpuCache::new(&spec));
    append_both(&mut c, &mut m, 0, 2, 77);
    c.advance(2).unwrap();
    assert_matches(&c, &m).await;
}

/// One step's rows for every layer of `spec` (`n` rows, pseudo-random f32), as (shapes, data) per layer
/// and slot; layers without slots get empty lists. The model takes them at each layer's next row.
fn step_rows(
    spec: &CacheSpec,
    m: &mut CpuCache,
    at: usize,
    n: usize,
    seed: u64,
) -> Vec<Vec<(Vec<usize>, Vec<f32>)>> {
    let mut out = Vec::new();
    for (l, layer) in spec.layers().iter().enumerate() {
        let mut slots = Vec::new();
        for (s, slot) in layer.slots.iter().enumerate() {
            let shape = [&[n][..], &slot.trailing].concat();
            let data = values(seed * 97 + (l * 7 + s) as u64, shape.iter().product());
            model_rows(m, l, s, at, &data);
            slots.push((shape, data));
        }
        out.push(slots);
    }
    out
}

/// Host slabs over `rows` (as `step_rows` returns them), one list per layer.
fn slabs_of(rows: &[Vec<(Vec<usize>, Vec<f32>)>]) -> Vec<Vec<HostSlab<'_>>> {
    rows.iter()
        .map(|layer| {
            layer
                .iter()
                .map(|(shape, data)| HostSlab::f32(data, shape))
                .collect()
        })
        .collect()
}

/// `append_layers` (every layer's rows in one upload, copied into place) against the CPU model for
/// every storage type, on a hybrid spec (MLA, a layer without slots, GQA): steps of 3, 1 and 2 rows,
/// the middle one recorded into the caller's encoder. Then every refusal (the wrong number of layer
/// lists, a bad slab in the last layer, capacity in one layer, a short slab, a wrong element type)
/// raises no wgpu validation error and leaves every slot's bytes and the ledger as they were, and
/// the cache still takes a step. Last, steps over the 4 MiB upload ring: one written slot by slot,
/// one recorded after a scrub of the rows it replaces (in pieces, in the encoder's order), and a
/// small one after them.
pub async fn append_layers_writes_every_layer_in_one_upload(g: &Gpu) {
    for dtype in DType::STORAGE {
        note!("-- {dtype}");
        let (r, p, d) = (width(dtype, 6, 2), width(dtype, 3, 1), width(dtype, 4, 1));
        let layers = vec![
            LayerSpec::mla(r, p),
            LayerSpec::empty(),
            LayerSpec::kv(2, d, d),
        ];
        let spec = CacheSpec::new(layers, dtype, 8).unwrap();
        let (mut c, mut m) = (cache_on(g, spec.clone()), CpuCache::new(&spec));
        for (step, n) in [3, 1, 2].into_iter().enumerate() {
            let rows = step_rows(&spec, &mut m, c.len(), n, step as u64 + 1);
            let slabs = slabs_of(&rows);
            let lists: Vec<&[HostSlab]> = slabs.iter().map(Vec::as_slice).collect();
            if step == 1 {
                let mut encoder = g.device.create_command_encoder(&Default::default());
                c.record_append_layers(&mut encoder, &lists).unwrap();
                assert_eq!(c.visible(2).unwrap(), c.len() + n);
                g.queue.submit([encoder.finish()]);
            } else {
                c.append_layers(&lists).unwrap();
            }
            c.advance(n).unwrap();
        }
        assert_eq!(c.len(), 6);
        assert_matches(&c, &m).await;

        let before = snapshot(&c).await;
        let ledger = c.ledger().clone();
        let mut scratch = CpuCache::new(&spec);
        let one = step_rows(&spec, &mut scratch, 0, 1, 50);
        let three = step_rows(&spec, &mut scratch, 0, 3, 51);
        let (one, three) = (slabs_of(&one), slabs_of(&three));
        let short = &one[2][1].data;
        let short = match short {
            HostData::F32(x) => &x[1..],
            _ => unreachable!("step_rows makes f32 slabs"),
        };
        let short_slab = [one[2][0], HostSlab::f32(short, one[2][1].shape)];
        let wrong_shape = [one[2][0], HostSlab::f32(&[0.0; 1], &[1, 1])];
        let (bf, hf) = (
            vec![half::bf16::ZERO; one[2][1].data.len()],
            vec![half::f16::ZERO; one[2][1].data.len()],
        );
        let wrong_type = [
            one[2][0],
            if dtype == DType::BF16 {
                HostSlab::f16(&hf, one[2][1].shape)
            } else {
                HostSlab::bf16(&bf, one[2][1].shape)
            },
        ];
        let scope = g.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let mut refusals: Vec<(&str, Result<()>)> = vec![
            (
                "two lists for three layers",
                c.append_layers(&[&one[0], &one[1]]),
            ),
            (
                "a bad shape in the last layer",
                c.append_layers(&[&one[0], &[], &wrong_shape]),
            ),
            (
                "3 rows do not fit in layer 2",
                c.append_layers(&[&one[0], &[], &three[2]]),
            ),
            (
                "a short slab in the last layer",
                c.append_layers(&[&one[0], &[], &short_slab]),
            ),
        ];
        if !dtype.is_quantized() {
            refusals.push((
                "an element type the slot does not take",
                c.append_layers(&[&one[0], &[], &wrong_type]),
            ));
        }
        // Every list empty: nothing is written (and nothing submitted), but the count is checked.
        let nothing: [&[HostSlab]; 3] = [&[], &[], &[]];
        c.append_layers(&nothing).unwrap();
        refusals.push((
            "two empty lists for three layers",
            c.append_layers(&nothing[..2]),
        ));
        g.queue.submit([]);
        assert!(
            scope.pop().await.is_none(),
            "{dtype}: a refused append_layers reached wgpu"
        );
        for (what, got) in &refusals {
            let err = got.as_ref().expect_err(what);
            let expected = match *what {
                "two lists for three layers" | "two empty lists for three layers" => {
                    matches!(
                        err,
                        Error::LayerLists {
                            expected: 3,
                            got: 2
                        }
                    )
                }
                "a bad shape in the last layer" => {
                    matches!(
                        err,
                        Error::SlabShape {
                            layer: 2,
                            slot: 1,
                            ..
                        }
                    )
                }
                "3 rows do not fit in layer 2" => matches!(
                    err,
                    Error::CapacityExceeded {
                        layer: 2,
                        n_new: 3,
                        ..
                    }
                ),
                "a short slab in the last layer" => {
                    matches!(
                        err,
                        Error::SourceSize {
                            layer: 2,
                            slot: 1,
                            ..
                        }
                    )
                }
                _ => matches!(
                    err,
                    Error::SourceDType {
                        layer: 2,
                        slot: 1,
                        ..
                    }
                ),
            };
            assert!(expected, "{dtype} {what}: {err}");
            note!("refused as expected ({what}): {err}");
        }
        assert_eq!(c.ledger(), &ledger, "{dtype}: a refusal moved the ledger");
        assert_eq!(snapshot(&c).await, before, "{dtype}: a refusal wrote bytes");
        let rows = step_rows(&spec, &mut m, 6, 2, 9);
        let slabs = slabs_of(&rows);
        let lists: Vec<&[HostSlab]> = slabs.iter().map(Vec::as_slice).collect();
        c.append_layers(&lists).unwrap();
        c.advance(2).unwrap();
        assert_matches(&c, &m).await;
    }
    // Steps whose every slot takes more than the 4 MiB upload ring: 1,040 rows of 4 KiB (f32),
    // 3,900 of 1,088 bytes (q8_0). `append_layers` writes one slot by slot. Then, in one encoder, a
    // truncate and scrub of most of its rows and `record_append_layers` of as many again over
    // them: the step goes up in pieces of the ring (a slot's rows cut in two, a piece holding the
    // end of K's and the start of V's) copied in the encoder's order (written ahead of the
    // encoder's commands, the scrub recorded before it would zero them). Then one row more.
    for (dtype, n) in [(DType::F32, 1040), (DType::Q8_0, 3900)] {
        note!("-- {dtype}, over 4 MiB per slot");
        let spec = CacheSpec::uniform(1, LayerSpec::kv(8, 128, 128), dtype, n + 16).unwrap();
        let slot_bytes = n as u64 * spec.row_bytes(0, 0).unwrap();
        assert!(slot_bytes > 4 << 20, "{dtype}: {slot_bytes} bytes a slot");
        let (mut c, mut m) = (cache_on(g, spec.clone()), CpuCache::new(&spec));
        let rows = step_rows(&spec, &mut m, 0, n, 60);
        let slabs = slabs_of(&rows);
        let lists: Vec<&[HostSlab]> = slabs.iter().map(Vec::as_slice).collect();
        c.append_layers(&lists).unwrap();
        c.advance(n).unwrap();
        let mut encoder = g.device.create_command_encoder(&Default::default());
        c.record_truncate_and_scrub(&mut encoder, 10).unwrap();
        m.zero_rows(0, 10, n);
        let rows = step_rows(&spec, &mut m, 10, n, 61);
        let slabs = slabs_of(&rows);
        let lists: Vec<&[HostSlab]> = slabs.iter().map(Vec::as_slice).collect();
        c.record_append_layers(&mut encoder, &lists).unwrap();
        g.queue.submit([encoder.finish()]);
        c.advance(n).unwrap();
        let rows = step_rows(&spec, &mut m, 10 + n, 1, 62);
        let slabs = slabs_of(&rows);
        let lists: Vec<&[HostSlab]> = slabs.iter().map(Vec::as_slice).collect();
        c.append_layers(&lists).unwrap();
        c.advance(1).unwrap();
        assert_matches(&c, &m).await;
    }
}
