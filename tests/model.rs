//! Property test: random sequences of valid and invalid operations, applied to the GPU cache and to a
//! plain-Rust model written independently of the ledger. After every step the ledger and every word of
//! GPU memory equal the model. The body lives in `common/model_bodies.rs`; the browser suite runs it
//! over fixed pseudo-random sequences.
#![cfg(not(target_arch = "wasm32"))]

mod common;

use common::shared::model_bodies::{
    Op, random_operations_match_the_model as random_operations_match_the_model_body,
};
use common::*;
use kvgpu::*;
use proptest::prelude::*;
use proptest::test_runner::FileFailurePersistence;

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..4usize, 0..5usize, any::<u64>(), prop_oneof![6 => Just(0u8), 1 => Just(1), 1 => Just(2)])
            .prop_map(|(layer, n, seed, bad)| Op::Host { layer, n, seed, bad }),
        3 => (0..3usize, 0..4usize, any::<u64>()).prop_map(|(layer, n, seed)| Op::Gpu { layer, n, seed }),
        3 => (0..5usize).prop_map(Op::Advance),
        2 => (0..8usize, any::<bool>()).prop_map(|(new_len, scrub)| Op::Truncate { new_len, scrub }),
        1 => Just(Op::Reset),
        1 => Just(Op::ResetFast),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 64,
        failure_persistence: Some(Box::new(FileFailurePersistence::Direct("tests/model.proptest-regressions"))),
        ..ProptestConfig::default()
    })]

    #[test]
    fn random_operations_match_the_model(
        dtype in prop::sample::select(DType::STORAGE.to_vec()),
        ops in prop::collection::vec(op(), 1..16),
    ) {
        pollster::block_on(random_operations_match_the_model_body(gpu(), dtype, &ops));
    }
}

#[test]
fn pseudo_random_operations_match_the_model() {
    pollster::block_on(shared::model_bodies::pseudo_random_operations_match_the_model(gpu()));
}
