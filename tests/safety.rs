//! No silent corruption and no wgpu validation error: each test here is a defect found by trying kvgpu
//! as a new user would, which failed before its fix. wgpu's default error handler panics on any
//! validation error nobody captured, so every test below also fails if kvgpu lets one reach wgpu.
#![cfg(not(target_arch = "wasm32"))]

mod common;

use common::*;
use kvgpu::reference;
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
    pollster::block_on(
        shared::a_16_bit_source_ending_inside_a_word_is_refused_before_recording(gpu()),
    );
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
    pollster::block_on(
        shared::thousands_of_recorded_appends_in_one_encoder_keep_their_own_parameters(gpu()),
    );
}

#[test]
fn the_16_byte_path_leaves_the_padding_half_zero() {
    pollster::block_on(shared::the_16_byte_path_leaves_the_padding_half_zero(gpu()));
}
