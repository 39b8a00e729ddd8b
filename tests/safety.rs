//! No silent corruption and no wgpu validation error: each test here is a defect found by trying kvgpu
//! as a new user would, which failed before its fix. wgpu's default error handler panics on any
//! validation error nobody captured, so every test below also fails if kvgpu lets one reach wgpu.
#![cfg(not(target_arch = "wasm32"))]

mod common;

use common::*;
use kvgpu::reference::{self, CpuCache};
use kvgpu::*;
use wgpu::util::DeviceExt;

/// A second device of the same adapter and instance: where wgpu can tell buffers apart by device.
fn other_device() -> (wgpu::Device, wgpu::Queue) {
    pollster::block_on(gpu().adapter.request_device(&Default::default())).unwrap()
}

fn buffer_with(device: &wgpu::Device, words: &[u32], usage: wgpu::BufferUsages) -> wgpu::Buffer {
    device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
        label: Some("test source"),
        contents: bytemuck::cast_slice(words),
        usage,
    })
}

const USAGE: wgpu::BufferUsages = wgpu::BufferUsages::STORAGE
    .union(wgpu::BufferUsages::COPY_SRC)
    .union(wgpu::BufferUsages::COPY_DST);

#[test]
fn a_16_bit_source_ending_inside_a_word_is_refused_before_recording() {
    let g = gpu();
    for dtype in [DType::F16, DType::BF16] {
        let spec = CacheSpec::new(
            vec![LayerSpec::new(vec![SlotSpec::new("x", &[3])])],
            dtype,
            4,
        )
        .unwrap();
        let mut bad_cache = cache(spec.clone());
        let (mut good_cache, mut model) = (cache(spec.clone()), CpuCache::new(&spec));
        // 6 bytes holding [1, 3] elements: its last word would reach byte 8.
        let six = g.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("six bytes"),
            size: 6,
            usage: USAGE,
            mapped_at_creation: false,
        });
        let shape = [1, 3];
        let slab = GpuSlab {
            buffer: &six,
            dtype,
            offset: 0,
            shape: &shape,
            strides: None,
        };
        // A valid append to another cache recorded first in the same encoder must survive.
        let bits = [
            reference::f32_to_bits(1.5, dtype),
            reference::f32_to_bits(-2.0, dtype),
            reference::f32_to_bits(0.25, dtype),
        ];
        let good_src = buffer_with(&g.device, &reference::pack_rows(&bits, dtype, 3), USAGE);
        let good = GpuSlab {
            buffer: &good_src,
            ..slab
        };
        let ledger = bad_cache.ledger().clone();
        let mut encoder = g.device.create_command_encoder(&Default::default());
        good_cache
            .record_append_gpu(&mut encoder, 0, &[good])
            .unwrap();
        let e = bad_cache
            .record_append_gpu(&mut encoder, 0, &[slab])
            .unwrap_err();
        assert!(
            matches!(
                e,
                Error::SourceWordTail {
                    layer: 0,
                    slot: 0,
                    needed: 8,
                    size: 6
                }
            ),
            "{dtype}: {e}"
        );
        assert_eq!(
            bad_cache.ledger(),
            &ledger,
            "{dtype}: the refusal changed the ledger"
        );
        g.queue.submit([encoder.finish()]);
        good_cache.advance(1).unwrap();
        model.write_rows(0, 0, 0, &bits);
        assert_eq!(snapshot(&good_cache), model.words, "{dtype}");
        assert_eq!(
            bad_cache.append_gpu(0, &[slab]).unwrap_err(),
            e,
            "{dtype}: append_gpu"
        );
        assert_eq!(bad_cache.ledger(), &ledger);
    }
}

#[test]
fn gpu_sources_of_another_device_are_refused() {
    let (device, _queue) = other_device();
    for dtype in DType::ALL {
        let spec = CacheSpec::new(vec![LayerSpec::kv(2, 4, 4)], dtype, 4).unwrap();
        let mut c = cache(spec.clone());
        let bits: Vec<u32> = values(3, 16)
            .iter()
            .map(|&x| reference::f32_to_bits(x, dtype))
            .collect();
        let words = reference::pack_rows(&bits, dtype, 8);
        // Same type and contiguous: the copy path; f32 into 16-bit storage: the kernel path.
        let same = buffer_with(&device, &words, USAGE);
        let f32_words: Vec<u32> = values(4, 16).iter().map(|x| x.to_bits()).collect();
        let converted = buffer_with(&device, &f32_words, USAGE);
        let shape = [2, 2, 4];
        let copy = GpuSlab {
            buffer: &same,
            dtype,
            offset: 0,
            shape: &shape,
            strides: None,
        };
        let kernel = GpuSlab {
            buffer: &converted,
            dtype: DType::F32,
            offset: 0,
            shape: &shape,
            strides: Some(&[8, 4, 1]),
        };
        let before = snapshot(&c);
        let ledger = c.ledger().clone();
        for slabs in [[copy, copy], [kernel, kernel], [copy, kernel]] {
            let e = c.append_gpu(0, &slabs).unwrap_err();
            assert!(
                matches!(&e, Error::ForeignDevice { layer: 0, what } if what.contains("source")),
                "{dtype}: {e}"
            );
            assert_eq!(
                c.ledger(),
                &ledger,
                "{dtype}: the refusal changed the ledger"
            );
        }
        assert_eq!(snapshot(&c), before);
        // The cache still takes its own device's sources.
        let own = buffer_with(&gpu().device, &f32_words, USAGE);
        let slab = GpuSlab {
            buffer: &own,
            ..kernel
        };
        c.append_gpu(0, &[slab, slab]).unwrap();
        assert_eq!(c.visible(0).unwrap(), 2);
    }
}

#[test]
fn thousands_of_recorded_appends_in_one_encoder_keep_their_own_parameters() {
    // 4,100 kernel appends before one submission: each reads the parameters it was recorded with.
    let n = 4100;
    let spec = CacheSpec::new(
        vec![LayerSpec::new(vec![SlotSpec::new("x", &[3])])],
        DType::F16,
        n,
    )
    .unwrap();
    let (mut c, mut m) = (cache(spec.clone()), CpuCache::new(&spec));
    let src: Vec<u32> = values(9, 64).iter().map(|x| x.to_bits()).collect();
    let buf = buffer_with(&gpu().device, &src, USAGE);
    let mut encoder = gpu().device.create_command_encoder(&Default::default());
    let shape = [1, 3];
    for i in 0..n {
        let offset = i % 61;
        let slab = GpuSlab {
            buffer: &buf,
            dtype: DType::F32,
            offset: offset as u64,
            shape: &shape,
            strides: Some(&[3, 1]),
        };
        c.record_append_gpu(&mut encoder, 0, &[slab]).unwrap();
        let bits: Vec<u32> = src[offset..offset + 3]
            .iter()
            .map(|&b| reference::convert_bits(b, DType::F32, DType::F16))
            .collect();
        m.write_rows(0, 0, i, &bits);
    }
    gpu().queue.submit([encoder.finish()]);
    c.advance(n).unwrap();
    assert_eq!(snapshot(&c), m.words);
}

#[test]
fn the_16_byte_path_leaves_the_padding_half_zero() {
    // f16 / bf16 rows of 7 elements (4 words, one padding half) from an f32 source whose rows start
    // on 16-byte boundaries: the path that moves whole 16-byte vectors.
    for dtype in [DType::F16, DType::BF16] {
        let n = 5;
        let spec = CacheSpec::new(
            vec![LayerSpec::new(vec![SlotSpec::new("x", &[7])])],
            dtype,
            8,
        )
        .unwrap();
        let (mut c, mut m) = (cache(spec.clone()), CpuCache::new(&spec));
        // Rows of 8 floats, the 8th of each a non-zero value that must not land in the padding.
        let src: Vec<u32> = (0..n * 8).map(|i| (1.0 + i as f32).to_bits()).collect();
        let buf = buffer_with(&gpu().device, &src, USAGE);
        let shape = [n, 7];
        c.append_gpu(
            0,
            &[GpuSlab {
                buffer: &buf,
                dtype: DType::F32,
                offset: 0,
                shape: &shape,
                strides: Some(&[8, 1]),
            }],
        )
        .unwrap();
        let bits = reference::slab_write(&src, DType::F32, 0, &shape, &[8, 1], dtype);
        m.words[0][0][..bits.len()].copy_from_slice(&bits);
        assert_eq!(snapshot(&c), m.words, "{dtype}");
        let words = c.read_full_words(0, 0).unwrap();
        for row in 0..n {
            assert_eq!(
                words[row * 4 + 3] >> 16,
                0,
                "{dtype}: padding half of row {row}"
            );
        }
    }
}
