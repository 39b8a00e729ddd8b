//! The cache on the GPU against the plain-Rust model, for every dtype: one async body per scenario,
//! run natively by `tests/core.rs` and in the browser by `tests/web.rs`.

use super::{
    append_both, append_random, assert_matches, cache_on, default_limits_gpu, snapshot, values,
};
use kvgpu::reference::{self, CpuCache};
use kvgpu::wgpu;
use kvgpu::*;

/// The expected f32 contents of rows appended from `data` (rounded through the storage type).
fn rounded(data: &[f32], dtype: DType) -> Vec<f32> {
    data.iter()
        .map(|&x| reference::round_trip(x, dtype))
        .collect()
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

/// MLA decode: two DeepSeek-sized layers one row per step, and odd widths (16-bit rows padded) with a
/// linear-attention layer between them, steps of several rows.
pub async fn mla_decode_steps_read_back_in_order(g: &Gpu) {
    for dtype in DType::ALL {
        note!("-- {dtype}");
        decode_steps(g, vec![LayerSpec::mla(512, 64); 2], dtype, &[1; 5]).await;
        let layers = vec![
            LayerSpec::mla(9, 3),
            LayerSpec::empty(),
            LayerSpec::mla(9, 3),
        ];
        decode_steps(g, layers, dtype, &[4, 1, 1, 2, 1]).await;
    }
}

pub async fn gqa_prefill_then_decode(g: &Gpu) {
    for dtype in DType::ALL {
        note!("-- {dtype}");
        let spec = CacheSpec::uniform(3, LayerSpec::kv(2, 16, 8), dtype, 40).unwrap();
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
                    (
                        18 + step as usize,
                        (18 + step) * 8 * 2 * dtype.size() as u64
                    )
                );
            }
            c.advance(1).unwrap();
        }
        assert_eq!(c.len(), 21);
        assert_eq!(c.read_f32_async(2, 0).await.unwrap(), m.read_f32(2, 0, 21));
        assert_matches(&c, &m).await;
    }
}

pub async fn rank_3_slot_and_odd_widths(g: &Gpu) {
    for dtype in DType::ALL {
        note!("-- {dtype}");
        let spec = CacheSpec::new(
            vec![LayerSpec::new(vec![
                SlotSpec::new("cube", &[2, 3, 5]),
                SlotSpec::new("odd", &[3]),
                SlotSpec::new("scalar", &[]),
            ])],
            dtype,
            9,
        )
        .unwrap();
        let (mut c, mut m) = (cache_on(g, spec.clone()), CpuCache::new(&spec));
        append_both(&mut c, &mut m, 0, 4, 7);
        append_both(&mut c, &mut m, 0, 1, 8);
        c.advance(5).unwrap();
        assert_eq!(c.read_f32_async(0, 1).await.unwrap().len(), 15);
        assert_eq!(c.read_f32_async(0, 2).await.unwrap(), m.read_f32(0, 2, 5));
        assert_matches(&c, &m).await;
    }
}

pub async fn layers_are_isolated_and_hybrid_layers_own_nothing(g: &Gpu) {
    for dtype in DType::ALL {
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
    for dtype in DType::ALL {
        note!("-- {dtype}");
        let spec =
            CacheSpec::new(vec![LayerSpec::mla(6, 3), LayerSpec::kv(2, 4, 4)], dtype, 5).unwrap();
        let (mut c, mut m) = (cache_on(g, spec.clone()), CpuCache::new(&spec));
        append_both(&mut c, &mut m, 0, 2, 1);
        append_both(&mut c, &mut m, 1, 2, 2);
        c.advance(2).unwrap();
        append_both(&mut c, &mut m, 0, 1, 3);
        let before = snapshot(&c).await;
        assert_eq!(before, m.words);
        let ledger = c.ledger().clone();

        let a6 = values(9, 6 * 4);
        let a3 = values(10, 3 * 4);
        let wrong_type_16 = vec![half::f16::ZERO; 6];
        let wrong_type_bf = vec![half::bf16::ZERO; 6];
        let mut refusals: Vec<(&str, Result<AppendPlan>)> = vec![
            ("layer out of range", c.append(2, &[])),
            (
                "wrong slot count",
                c.append(0, &[HostSlab::f32(&a6[..6], &[1, 6])]),
            ),
            (
                "slab shape",
                c.append(
                    0,
                    &[
                        HostSlab::f32(&a6[..6], &[1, 6]),
                        HostSlab::f32(&a3[..4], &[1, 4]),
                    ],
                ),
            ),
            (
                "n_new differs",
                c.append(
                    0,
                    &[
                        HostSlab::f32(&a6[..12], &[2, 6]),
                        HostSlab::f32(&a3[..3], &[1, 3]),
                    ],
                ),
            ),
            (
                "capacity",
                c.append(
                    0,
                    &[
                        HostSlab::f32(&a6[..18], &[3, 6]),
                        HostSlab::f32(&a3[..9], &[3, 3]),
                    ],
                ),
            ),
            (
                "data length",
                c.append(
                    0,
                    &[
                        HostSlab::f32(&a6[..5], &[1, 6]),
                        HostSlab::f32(&a3[..3], &[1, 3]),
                    ],
                ),
            ),
        ];
        // A 16-bit source of the other 16-bit type (or any 16-bit source into f32 storage) is refused.
        let other = if dtype == DType::F16 {
            HostSlab::bf16(&wrong_type_bf, &[1, 6])
        } else {
            HostSlab::f16(&wrong_type_16, &[1, 6])
        };
        refusals.push((
            "source dtype",
            c.append(0, &[other, HostSlab::f32(&a3[..3], &[1, 3])]),
        ));
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
                expected: vec![3],
                got: vec![1, 4]
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
                shape: vec![1, 6],
                expected: 6,
                got: 5
            }
        );
        assert!(matches!(
            expect(6),
            Error::SourceDType {
                layer: 0,
                slot: 0,
                ..
            }
        ));
        // Layer 0 appended, layer 1 forgotten: advance names the layer and commits nothing.
        let err = c.advance(1).unwrap_err();
        assert_eq!(
            err,
            Error::UnevenAdvance {
                layer: 1,
                pending: 0,
                expected: 1,
                len: 2
            }
        );
        assert!(err.to_string().contains("layer 1"), "{err}");
        assert_eq!(
            c.truncate(3).unwrap_err(),
            Error::TruncateBeyondLength { new_len: 3, len: 2 }
        );
        assert_eq!(
            c.truncate_and_scrub(4).unwrap_err(),
            Error::TruncateBeyondLength { new_len: 4, len: 2 }
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
    for dtype in DType::ALL {
        note!("-- {dtype}");
        let spec = CacheSpec::new(vec![LayerSpec::kv(1, 3, 5)], dtype, 4).unwrap();
        let (mut c, mut m) = (cache_on(g, spec.clone()), CpuCache::new(&spec));
        append_both(&mut c, &mut m, 0, 4, 1);
        c.advance(4).unwrap();
        assert!(c.is_full());
        assert_eq!(c.remaining(), 0);
        let before = snapshot(&c).await;
        let (k, v) = (values(5, 3), values(6, 5));
        let err = c
            .append(
                0,
                &[HostSlab::f32(&k, &[1, 1, 3]), HostSlab::f32(&v, &[1, 1, 5])],
            )
            .unwrap_err();
        assert_eq!(
            err,
            Error::CapacityExceeded {
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
        assert_eq!(
            c.read_f32_async(0, 0).await.unwrap(),
            rounded(&values(31, 3), dtype)[..3]
        );
    }
}

/// A scrub zeroes the dropped rows of every layer and keeps the rest; `reset_fast` keeps every byte,
/// `reset` zeroes every byte of every slot, and the cache is usable again after both.
pub async fn reset_zeroes_every_byte_and_reset_fast_keeps_data(g: &Gpu) {
    for dtype in DType::ALL {
        note!("-- {dtype}");
        let spec = CacheSpec::new(
            vec![
                LayerSpec::mla(33, 7),
                LayerSpec::empty(),
                LayerSpec::kv(3, 5, 2),
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

        c.reset();
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

/// A scrub and a reset recorded into one encoder with the app's own copy, submitted once.
pub async fn recorded_ops_share_one_encoder(g: &Gpu) {
    let spec = CacheSpec::new(vec![LayerSpec::kv(2, 4, 4)], DType::F16, 8).unwrap();
    let (mut c, mut m) = (cache_on(g, spec.clone()), CpuCache::new(&spec));
    append_both(&mut c, &mut m, 0, 6, 1);
    c.advance(6).unwrap();
    let mut encoder = g.device.create_command_encoder(&Default::default());
    c.record_truncate_and_scrub(&mut encoder, 4).unwrap();
    c.record_truncate_and_scrub(&mut encoder, 2).unwrap();
    g.queue.submit([encoder.finish()]);
    m.zero_rows(0, 2, 6);
    assert_matches(&c, &m).await;
    let mut encoder = g.device.create_command_encoder(&Default::default());
    c.record_reset(&mut encoder);
    g.queue.submit([encoder.finish()]);
    assert!(
        snapshot(&c)
            .await
            .iter()
            .flatten()
            .flatten()
            .all(|&w| w == 0)
    );
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

/// 16-bit host data already in the storage type is stored as is, and f32 host data is rounded to
/// nearest even exactly like `half`: subnormals, signed zero, overflow to infinity, large magnitudes,
/// rows of odd width (the padding half stays zero).
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

/// Rows of 1 to 9 words and every (cut, end) pair: the scrubbed range starts and ends at every offset
/// within a 16-byte vector, and the words around it must survive.
pub async fn scrub_matches_the_zero_twin_at_every_word_offset(g: &Gpu) {
    for dtype in DType::ALL {
        note!("-- {dtype}");
        for width in [1usize, 3, 5, 9] {
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

/// Three slots: each reset stages three parameter entries in one write. Over 3,300 entries fill
/// several ring buffers, and runs that do not fit the rest of one move to the next whole.
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
        c.reset();
        m.zero_all();
        if i % 256 == 0 || i + 2 >= resets {
            assert_matches(&c, &m).await;
        }
    }
    append_both(&mut c, &mut m, 0, 2, 7);
    c.truncate(0).unwrap();
    assert_matches(&c, &m).await;
}

/// Copy into another cache from the source's views (the README's recipe), and save / restore
/// through `read_f32` + append: every word arrives, 16-bit rows of odd width included.
pub async fn a_sequence_moves_between_caches(g: &Gpu) {
    for dtype in DType::ALL {
        note!("-- {dtype}");
        let spec = CacheSpec::new(
            vec![LayerSpec::new(vec![
                SlotSpec::new("even", &[2, 4]),
                SlotSpec::new("odd", &[5]),
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
        let shapes = [vec![7, 2, 4], vec![7, 5]];
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
        copy.append_gpu(0, &slabs).unwrap();
        copy.advance(7).unwrap();
        let original = snapshot(&src).await;
        assert_eq!(snapshot(&copy).await, original, "{dtype}: copied");
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
