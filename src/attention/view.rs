//! The f32 views of one attention call (queries and output): checked against their buffer and the
//! device, and turned into a binding range and the kernels' view parameters. Pure: a buffer enters as
//! its size, so every rule is unit-tested on the CPU.
//!
//! A view is bound from its first element rounded down to the device's storage offset alignment, up
//! to the end of its last element, and the kernels get the remaining offset and the strides through
//! `AttnParams`: so any f32 element may start a view, and only the bytes a view spans count against
//! the device's storage binding limit.

/// A view that cannot be bound as described.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ViewError {
    /// The last element's index or byte does not fit in 64 bits.
    Overflow,
    /// The view reaches byte `needed` of a smaller buffer.
    TooSmall { needed: u64 },
    /// The binding the view needs is `bytes` long, above the device's limit.
    TooLarge { bytes: u64 },
    /// Two elements of a view that is written share an address.
    Overlapping,
}

/// A checked view: where it is bound and how the kernels index it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Bound {
    pub bind_offset: u64,
    pub bind_size: u64,
    /// `(offset within the binding, query stride, head stride, element stride)` in elements, the
    /// `vec4<u32>` views of `AttnParams`; the stride of an axis of extent 1 is 0.
    pub view: [u32; 4],
    /// Bytes `[first, end)` of the buffer between the view's first and last elements.
    pub span: (u64, u64),
}

/// Checks the view of `shape` at element `offset` along `strides` (f32 elements) in a buffer of
/// `size` bytes, bound at multiples of `align` bytes and at most `max_binding` bytes long. A view that
/// is written (`written`) must not reach one address through two elements.
pub(crate) fn bind(
    size: u64,
    offset: usize,
    shape: [usize; 3],
    strides: [usize; 3],
    align: u64,
    max_binding: u64,
    written: bool,
) -> Result<Bound, ViewError> {
    // Axes of extent 1 never move; their strides do not matter.
    let strides: [u64; 3] =
        std::array::from_fn(|i| if shape[i] > 1 { strides[i] as u64 } else { 0 });
    let last = shape
        .iter()
        .zip(strides)
        .try_fold(offset as u64, |acc, (&n, s)| {
            acc.checked_add((n as u64).saturating_sub(1).checked_mul(s)?)
        })
        .ok_or(ViewError::Overflow)?;
    let end = last
        .checked_add(1)
        .and_then(|e| e.checked_mul(4))
        .ok_or(ViewError::Overflow)?;
    if end > size {
        return Err(ViewError::TooSmall { needed: end });
    }
    // From here every element lies inside the buffer, so no byte offset overflows.
    let first = offset as u64 * 4;
    let bind_offset = first - first % align.max(4);
    let bind_size = end - bind_offset;
    if bind_size > max_binding {
        return Err(ViewError::TooLarge { bytes: bind_size });
    }
    if written && overlaps(shape, strides) {
        return Err(ViewError::Overlapping);
    }
    // The binding holds fewer than 2^32 bytes, so every index inside it fits in 32 bits.
    let small = |x: u64| u32::try_from(x).map_err(|_| ViewError::TooLarge { bytes: bind_size });
    Ok(Bound {
        bind_offset,
        bind_size,
        view: [
            small((first - bind_offset) / 4)?,
            small(strides[0])?,
            small(strides[1])?,
            small(strides[2])?,
        ],
        span: (first, end),
    })
}

/// Whether two elements of the view may share an address: the axes that move, taken from the
/// smallest stride up, must each step over everything the smaller ones span (a nesting that rules out
/// overlap; interleavings it also refuses are not needed by any layout attention writes).
fn overlaps(shape: [usize; 3], strides: [u64; 3]) -> bool {
    let mut axes: Vec<(u64, u64)> = shape
        .iter()
        .zip(strides)
        .filter(|(n, _)| **n > 1)
        .map(|(&n, s)| (n as u64, s))
        .collect();
    axes.sort_by_key(|&(_, s)| s);
    // Elements spanned by the axes so far (their last element's index + 1); the caller has checked
    // that the whole view's last index fits in 64 bits.
    let mut spanned = 1u64;
    for (n, s) in axes {
        if s < spanned {
            return true;
        }
        spanned = s.saturating_mul(n - 1).saturating_add(spanned);
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    const MB: u64 = 1 << 20;

    #[test]
    fn a_contiguous_view_from_0_binds_its_own_bytes() {
        let b = bind(4096, 0, [2, 4, 8], [32, 8, 1], 256, MB, true).unwrap();
        assert_eq!(
            b,
            Bound {
                bind_offset: 0,
                bind_size: 256,
                view: [0, 32, 8, 1],
                span: (0, 256),
            }
        );
    }

    #[test]
    fn the_query_part_of_fused_qkv_rows_is_bound_from_an_aligned_byte() {
        // Rows of [q (4 heads x 8) | k (2 x 8) | v (2 x 8)] = 64 floats; k of rows 1 to 3.
        let b = bind(64 * 4 * 8, 64 + 32, [3, 2, 8], [64, 8, 1], 256, MB, false).unwrap();
        assert_eq!(b.bind_offset, 256);
        assert_eq!(b.view, [32, 64, 8, 1]);
        assert_eq!(b.span, (384, (96 + 2 * 64 + 15 + 1) * 4));
        assert_eq!(b.bind_offset + b.bind_size, b.span.1);
        // Element 1 of the buffer: no alignment rule beyond whole f32 elements.
        let b = bind(64, 1, [1, 1, 3], [3, 3, 1], 256, MB, true).unwrap();
        assert_eq!((b.bind_offset, b.bind_size, b.view[0]), (0, 16, 1));
    }

    #[test]
    fn views_past_the_buffer_or_the_binding_limit_are_refused() {
        assert_eq!(
            bind(255, 0, [1, 4, 16], [64, 16, 1], 256, MB, false),
            Err(ViewError::TooSmall { needed: 256 })
        );
        assert_eq!(
            bind(4096, 1000, [1, 1, 25], [0, 0, 1], 256, MB, false),
            Err(ViewError::TooSmall { needed: 4100 })
        );
        // Only the span counts against the limit, from its aligned start.
        assert!(
            bind(
                8 * MB,
                MB as usize,
                [1, 1, 1024],
                [0, 0, 1],
                256,
                4096,
                false
            )
            .is_ok()
        );
        assert_eq!(
            bind(8 * MB, 1, [1, 1, 1024], [0, 0, 1], 256, 4096, false),
            Err(ViewError::TooLarge { bytes: 4100 })
        );
    }

    #[test]
    fn overflowing_offsets_and_strides_are_refused_without_wrapping() {
        for (offset, strides) in [
            (usize::MAX, [1, 1, 1]),
            (usize::MAX / 4, [1, 1, 1]),
            (0, [usize::MAX, 1, 1]),
            (0, [1, usize::MAX / 2, usize::MAX / 2]),
        ] {
            assert_eq!(
                bind(u64::MAX, offset, [2, 2, 2], strides, 256, u64::MAX, false),
                Err(ViewError::Overflow),
                "{offset} {strides:?}"
            );
        }
        // An axis of extent 1 may have any stride.
        let b = bind(64, 0, [1, 2, 4], [usize::MAX, 4, 1], 256, MB, true).unwrap();
        assert_eq!(b.view, [0, 0, 4, 1]);
    }

    #[test]
    fn written_views_whose_elements_share_an_address_are_refused() {
        let ok = |shape, strides| bind(1 << 16, 0, shape, strides, 256, MB, true).is_ok();
        assert!(ok([2, 4, 8], [32, 8, 1]));
        // Head-major, and rows with a gap between them.
        assert!(ok([3, 4, 8], [8, 24, 1]));
        assert!(ok([3, 4, 8], [100, 8, 1]));
        // Heads overlapping, a repeated element, every other element with heads too close.
        assert!(!ok([2, 4, 8], [32, 4, 1]));
        assert!(!ok([2, 4, 8], [32, 8, 0]));
        assert!(!ok([2, 4, 8], [64, 8, 2]));
        // Head-minor is fine; interleaved heads that never meet are refused: the axes must nest.
        assert!(ok([2, 2, 4], [16, 1, 2]));
        assert!(!ok([2, 4, 8], [64, 16, 3]));
        // Reading the same queries twice is fine.
        assert!(bind(1 << 16, 0, [2, 4, 8], [0, 0, 1], 256, MB, false).is_ok());
    }
}
