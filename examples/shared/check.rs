//! The output check decode and serve share: each GPU output against its f64 CPU twin. Each example
//! includes this file with `#[path = "shared/check.rs"] mod check;`.

/// Outputs may differ from the f64 CPU reference by this much, scaled by `1 + |reference|`.
pub const TOLERANCE: f32 = 1e-4;

/// The largest `|got - want|`, and whether every output is within [`TOLERANCE`] of its reference. A
/// twin that refused the shapes returns nothing: that is a failed check, not a pass.
pub fn compare(got: &[f32], want: &[f32]) -> (f32, bool) {
    let mut worst = 0f32;
    let mut good = !want.is_empty() && got.len() == want.len();
    for (g, w) in got.iter().zip(want) {
        let err = (g - w).abs();
        worst = worst.max(err);
        good &= err <= TOLERANCE * (1.0 + w.abs());
    }
    (worst, good)
}
