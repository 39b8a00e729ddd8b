//! The device helper: an unmatched adapter name is an error listing what exists, not a panic.
#![cfg(not(target_arch = "wasm32"))]

use kvgpu::{Error, Gpu};

#[test]
fn unmatched_adapter_name_is_an_error_naming_the_adapters_found() {
    let err = pollster::block_on(Gpu::open(
        wgpu::Backends::all(),
        Some("no-such-adapter-xyz"),
    ))
    .unwrap_err();
    match &err {
        Error::AdapterNotFound { reason } => {
            assert!(reason.contains("no-such-adapter-xyz"), "{reason}")
        }
        other => panic!("expected AdapterNotFound, got {other:?}"),
    }
}

#[test]
fn a_matching_name_opens_that_adapter() {
    let any = Gpu::from_env_blocking().expect("an adapter; see kvgpu::device::INSTALL_HINT");
    let name = any.adapter.get_info().name;
    let backend = any.adapter.get_info().backend;
    let again = pollster::block_on(Gpu::open(backend.into(), Some(&name.to_uppercase()))).unwrap();
    assert_eq!(again.adapter.get_info().name, name);
    assert!(any.limits().max_storage_buffer_binding_size >= 128 << 20);
}
