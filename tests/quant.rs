//! Quantized storage (q8_0, q4_0, fp8 e4m3) on the adapter chosen by `WGPU_BACKEND`: every append path
//! against the CPU twin bit for bit, edge inputs included, and the checks of specs and sources. The
//! bodies live in `common/quant_bodies.rs`; the browser suite (`tests/web.rs`) runs the same ones.
#![cfg(not(target_arch = "wasm32"))]

mod common;

common::shared_tests!(quant_bodies:
    host_rows_are_stored_as_the_twin_quantizes_them,
    gpu_sources_are_quantized_as_the_twin_does,
    quantized_specs_and_sources_are_checked,
    quantized_caches_take_the_bytes_they_promise,
);
