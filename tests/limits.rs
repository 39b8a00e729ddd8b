//! Slots against the device's storage-binding limit (128 MiB on llvmpipe, lavapipe and WebGPU's
//! defaults): refused with the largest capacity that fits, never a wgpu panic; a slot of exactly the
//! limit works end to end, including a reset whose one dispatch must stride past the workgroup cap.
//! A streaming attention kernel the device refuses: the default choice takes the tiled kernel.
#![cfg(not(target_arch = "wasm32"))]

mod common;

use common::shared::cache_bodies::one_k_slot;
use common::*;
use kvgpu::*;

// The tests of this file take `serial()`: the fall-back test counts the pipelines of the registry
// the suite shares, which another test running beside it could add to.

common::shared_tests!(cache_bodies, serial: serial;
    slot_over_the_binding_limit_is_refused_with_the_capacity_that_fits,
);

// A generated kernel the device refuses: Auto falls back to the tiled kernel.
common::shared_tests!(attention_bodies, serial: serial;
    auto_takes_the_tiled_kernel_where_the_streaming_one_is_refused,
);

#[test]
fn slot_of_exactly_the_limit_works() {
    let _serial = serial();
    let g = gpu();
    let fits = (g.limits().max_slot_bytes() / 4096).min(32_768) as usize;
    let scope = g.device.push_error_scope(wgpu::ErrorFilter::Validation);
    let mut c = cache(one_k_slot(fits));
    // Distinct first and last rows, filler between them.
    let (first, last, filler) = (values(1, 1024), values(2, 1024), vec![0.5f32; 1024 * 64]);
    c.append(0, &[HostSlab::f32(&first, &[1, 8, 128])]).unwrap();
    c.advance(1).unwrap();
    while c.remaining() > 1 {
        let n = (c.remaining() - 1).min(64);
        c.append(0, &[HostSlab::f32(&filler[..n * 1024], &[n, 8, 128])])
            .unwrap();
        c.advance(n).unwrap();
    }
    c.append(0, &[HostSlab::f32(&last, &[1, 8, 128])]).unwrap();
    c.advance(1).unwrap();
    assert!(c.is_full());
    let words = c.read_full_words(0, 0).unwrap();
    assert_eq!(words.len(), fits * 1024);
    assert_eq!(
        &words[words.len() - 1024..],
        bytemuck::cast_slice::<f32, u32>(&last)
    );
    assert_eq!(&words[..1024], bytemuck::cast_slice::<f32, u32>(&first));
    assert_eq!(words[1024], 0.5f32.to_bits());

    c.reset().unwrap();
    let words = c.read_full_words(0, 0).unwrap();
    assert!(
        words.iter().all(|&w| w == 0),
        "reset left a non-zero word in a {} MiB slot",
        (fits * 4096) >> 20
    );
    assert!(pollster::block_on(scope.pop()).is_none());
}
