//! The GPU-source planner: checks one [`crate::GpuSlab`] completely against its destination slot and
//! the device's limits, and decides how its rows move (a plain copy or the slab-write kernel, 4-byte
//! or 16-byte entry point) — before anything is recorded. Pure: buffers enter as their size and usage,
//! so every rule is unit-tested on the CPU.

use crate::codec::DType;
use crate::error::{CopyBlocker, Error, Result, SourceProblem};
use crate::kernels::{Held, MAX_SOURCE_RANK, WriteParams};

/// What the planner needs to know of a source: its buffer's size and usage, and the slab's layout.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Source<'a> {
    pub buffer_size: u64,
    pub usage: wgpu::BufferUsages,
    /// The source buffer is the destination slot's own buffer.
    pub is_destination: bool,
    /// Whether the app holds the source buffer: mapped for the host (whole or in part) or destroyed
    /// ([`crate::kernels::held`]: a mapping still pending is not seen).
    pub held: Held,
    pub dtype: DType,
    pub offset: u64,
    pub shape: &'a [usize],
    pub strides: Option<&'a [usize]>,
}

/// The destination slot and the device's binding rules.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Destination {
    pub storage: DType,
    /// A scaled fp8 slot: the bits of `1 / scale` its writes multiply by; 0 for any other slot.
    pub inv_scale: u32,
    pub row_elems: usize,
    pub row_bytes: u64,
    pub min_offset_alignment: u64,
    pub max_binding: u64,
}

/// How one GPU source reaches its slot.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum SourceJob {
    Nothing,
    Copy {
        src_offset: u64,
    },
    Kernel {
        /// Every field but the destination offset and the loop stride, which the recorder fills in.
        params: WriteParams,
        bind_offset: u64,
        bind_size: u64,
        /// Whole 16-byte vectors per invocation (`main_vec4` of shaders/slab_write.wgsl).
        vec4: bool,
    },
}

/// Row-major element strides of `shape` (saturating: a shape that large is refused elsewhere).
pub(crate) fn contiguous_strides(shape: &[usize]) -> Vec<usize> {
    let mut strides = vec![1usize; shape.len()];
    for k in (0..shape.len().saturating_sub(1)).rev() {
        strides[k] = strides[k + 1].saturating_mul(shape[k + 1]);
    }
    strides
}

/// The trailing axes as `(extent, stride)` with axes of extent 1 dropped and axes that are contiguous
/// with each other merged (`[heads, dim]` with strides `[dim, 1]` is one run of `heads · dim`).
fn merged_trailing(shape: &[usize], strides: &[usize]) -> Vec<(u64, u64)> {
    let mut dims: Vec<(u64, u64)> = Vec::with_capacity(shape.len());
    for (&n, &s) in shape.iter().zip(strides).skip(1) {
        if n == 1 {
            continue;
        }
        let (n, s) = (n as u64, s as u64);
        match dims.last_mut() {
            Some(last) if last.1 == s.saturating_mul(n) => *last = (last.0 * n, s),
            _ => dims.push((n, s)),
        }
    }
    dims
}

/// Checks the source of slot `slot` of `layer` for an append of `n_new` rows and plans its move.
pub(crate) fn plan_source(
    layer: usize,
    slot: usize,
    src: &Source<'_>,
    dst: &Destination,
    n_new: usize,
) -> Result<SourceJob> {
    let layout_err = |problem: SourceProblem| Error::SourceLayout {
        layer,
        slot,
        problem,
    };
    let contiguous: Vec<usize>;
    let strides = match src.strides {
        Some(s) => s,
        None => {
            contiguous = contiguous_strides(src.shape);
            &contiguous
        }
    };
    if strides.len() != src.shape.len() {
        return Err(layout_err(SourceProblem::StrideCount {
            strides: strides.len(),
            rank: src.shape.len(),
            shape: src.shape.to_vec(),
        }));
    }
    if src.dtype.is_quantized() {
        return Err(layout_err(SourceProblem::QuantizedSource {
            dtype: src.dtype,
        }));
    }
    if src.is_destination {
        return Err(layout_err(SourceProblem::IsDestination));
    }
    match src.held {
        Held::Mapped => return Err(layout_err(SourceProblem::Mapped)),
        Held::Destroyed => return Err(layout_err(SourceProblem::Destroyed)),
        Held::Invalid => return Err(layout_err(SourceProblem::Invalid)),
        Held::No => {}
    }
    if n_new == 0 || src.shape.contains(&0) {
        return Ok(SourceJob::Nothing);
    }
    let esize = src.dtype.size() as u64;
    let buffer_elements = src.buffer_size / esize;
    let last_element = src
        .shape
        .iter()
        .zip(strides)
        .try_fold(src.offset, |acc, (&n, &s)| {
            acc.checked_add((n as u64 - 1).checked_mul(s as u64)?)
        })
        .unwrap_or(u64::MAX);
    if last_element >= buffer_elements {
        return Err(Error::SourceOutOfBounds {
            layer,
            slot,
            dtype: src.dtype,
            last_element,
            buffer_elements,
        });
    }
    // From here every element index, and so every byte offset, lies inside the buffer.
    let usage = src.usage;
    let dense = src.strides.is_none() || strides == contiguous_strides(src.shape).as_slice();
    let aligned =
        (dst.row_elems as u64 * esize).is_multiple_of(4) && (src.offset * esize).is_multiple_of(4);
    if src.dtype == dst.storage && dense && aligned && usage.contains(wgpu::BufferUsages::COPY_SRC)
    {
        return Ok(SourceJob::Copy {
            src_offset: src.offset * esize,
        });
    }
    if !usage.contains(wgpu::BufferUsages::STORAGE) {
        let why = if src.dtype != dst.storage {
            CopyBlocker::Type {
                held: src.dtype,
                storage: dst.storage,
            }
        } else if !dense {
            CopyBlocker::Strided
        } else if !aligned {
            CopyBlocker::Unaligned {
                start: src.offset * esize,
                row_bytes: dst.row_elems as u64 * esize,
            }
        } else {
            CopyBlocker::NoCopySrc
        };
        return Err(layout_err(SourceProblem::NeedsStorage { usage, why }));
    }
    let dims = merged_trailing(src.shape, strides);
    if dims.len() > MAX_SOURCE_RANK {
        return Err(layout_err(SourceProblem::TooManyAxes {
            axes: dims.len(),
            max: MAX_SOURCE_RANK,
        }));
    }
    let first_word = src.offset * esize / 4;
    let end_word = ((last_element + 1) * esize).div_ceil(4);
    let align = dst.min_offset_alignment.max(4);
    let bind_offset = first_word * 4 / align * align;
    // The 16-byte path: an f32 source, or a 16-bit source of the storage type, whose rows are
    // contiguous runs starting on 16-byte boundaries (binding offsets are multiples of 16), into rows
    // of whole 16-byte vectors.
    let seq_stride = if n_new > 1 { strides[0] as u64 } else { 0 };
    let row_words = dst.row_bytes / 4;
    let per_vec = 16 / esize;
    let vec4 = (src.dtype == DType::F32 || src.dtype == dst.storage)
        && !dst.storage.is_quantized()
        && matches!(dims.as_slice(), [(_, 1)])
        && src.offset.is_multiple_of(per_vec)
        && seq_stride.is_multiple_of(per_vec)
        && row_words.is_multiple_of(4)
        && (end_word * 4).next_multiple_of(16) <= src.buffer_size;
    let bind_end = if vec4 {
        (end_word * 4).next_multiple_of(16)
    } else {
        end_word * 4
    };
    if bind_end > src.buffer_size {
        return Err(Error::SourceWordTail {
            layer,
            slot,
            needed: bind_end,
            size: src.buffer_size,
        });
    }
    let bind_size = bind_end - bind_offset;
    if bind_size > dst.max_binding {
        return Err(layout_err(SourceProblem::BindingTooLarge {
            bytes: bind_size,
            limit: dst.max_binding,
        }));
    }
    // Everything below is bounded by the binding size, which fits a u32.
    let mut params = WriteParams {
        src_offset: (src.offset - bind_offset / esize) as u32,
        seq_stride: seq_stride as u32,
        n_rows: n_new as u32,
        row_elems: dst.row_elems as u32,
        row_words: row_words as u32,
        rank: dims.len() as u32,
        inv_scale: dst.inv_scale,
        ..Default::default()
    };
    for (k, (n, s)) in dims.into_iter().enumerate() {
        params.shape[k] = n as u32;
        params.stride[k] = s as u32;
    }
    Ok(SourceJob::Kernel {
        params,
        bind_offset,
        bind_size,
        vec4,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const BOTH: wgpu::BufferUsages =
        wgpu::BufferUsages::STORAGE.union(wgpu::BufferUsages::COPY_SRC);

    fn dst(storage: DType, row_elems: usize) -> Destination {
        Destination {
            storage,
            inv_scale: 0,
            row_elems,
            row_bytes: (row_elems * storage.size()).div_ceil(4) as u64 * 4,
            min_offset_alignment: 256,
            max_binding: 128 << 20,
        }
    }

    fn src<'a>(
        size: u64,
        dtype: DType,
        offset: u64,
        shape: &'a [usize],
        strides: Option<&'a [usize]>,
    ) -> Source<'a> {
        Source {
            buffer_size: size,
            usage: BOTH,
            is_destination: false,
            held: Held::No,
            dtype,
            offset,
            shape,
            strides,
        }
    }

    #[test]
    fn a_contiguous_same_type_source_is_copied() {
        let job = plan_source(
            0,
            0,
            &src(1024, DType::F16, 2, &[3, 2, 4], None),
            &dst(DType::F16, 8),
            3,
        );
        assert_eq!(job.unwrap(), SourceJob::Copy { src_offset: 4 });
    }

    #[test]
    fn fused_qkv_rows_take_the_16_byte_path_with_merged_axes() {
        // K of [tokens, q 64 | k 32 | v 32] f32 into f16 [4 heads, 8].
        let (shape, strides) = ([5, 4, 8], [128, 8, 1]);
        let job = plan_source(
            1,
            0,
            &src(5 * 128 * 4, DType::F32, 64, &shape, Some(&strides)),
            &dst(DType::F16, 32),
            5,
        )
        .unwrap();
        let SourceJob::Kernel {
            params,
            vec4,
            bind_offset,
            ..
        } = job
        else {
            panic!("{job:?}")
        };
        assert!(vec4);
        // Element 64 starts at byte 256, a multiple of the binding alignment: the binding starts there.
        assert_eq!(bind_offset, 256);
        assert_eq!((params.rank, params.shape[0], params.stride[0]), (1, 32, 1));
        assert_eq!((params.seq_stride, params.src_offset), (128, 0));
    }

    #[test]
    fn strided_16_bit_rows_of_the_storage_type_take_the_16_byte_path() {
        // K of [tokens, q 64 | k 32 | v 32] f16 into f16 [4 heads, 8]: whole vectors of 8 halves.
        let (shape, strides) = ([5, 4, 8], [128, 8, 1]);
        let plan = |offset: u64, dtype: DType| {
            let job = plan_source(
                1,
                0,
                &src(5 * 128 * 2, dtype, offset, &shape, Some(&strides)),
                &dst(DType::F16, 32),
                5,
            )
            .unwrap();
            let SourceJob::Kernel { vec4, .. } = job else {
                panic!("{job:?}")
            };
            vec4
        };
        assert!(plan(64, DType::F16));
        // Rows starting inside a vector, or a type to convert: element by element.
        assert!(!plan(68, DType::F16));
        assert!(!plan(64, DType::BF16));
    }

    #[test]
    fn a_16_bit_source_whose_last_word_passes_the_buffer_end_is_refused() {
        let e = plan_source(
            0,
            2,
            &src(6, DType::F16, 0, &[1, 3], None),
            &dst(DType::F16, 3),
            1,
        );
        assert_eq!(
            e.unwrap_err(),
            Error::SourceWordTail {
                layer: 0,
                slot: 2,
                needed: 8,
                size: 6
            }
        );
    }

    #[test]
    fn sources_reaching_past_their_buffer_or_overflowing_are_refused() {
        let d = dst(DType::F32, 4);
        for (offset, shape, strides) in [
            (0u64, [2usize, 4usize], [4usize, 1usize]),
            (u64::MAX, [1, 4], [4, 1]),
            (0, [2, 4], [usize::MAX, 1]),
            (0, [2, 4], [4, usize::MAX]),
        ] {
            let e = plan_source(
                0,
                0,
                &src(28, DType::F32, offset, &shape, Some(&strides)),
                &d,
                2,
            );
            assert!(
                matches!(e, Err(Error::SourceOutOfBounds { .. })),
                "{offset} {strides:?}: {e:?}"
            );
        }
    }

    #[test]
    fn layout_errors_name_the_cause() {
        let d = dst(DType::F32, 4);
        let e = plan_source(0, 0, &src(64, DType::F32, 0, &[2, 4], Some(&[4])), &d, 2).unwrap_err();
        assert!(
            matches!(
                &e,
                Error::SourceLayout {
                    problem: SourceProblem::StrideCount {
                        strides: 1,
                        rank: 2,
                        ..
                    },
                    ..
                }
            ),
            "{e}"
        );
        let own = Source {
            is_destination: true,
            ..src(64, DType::F32, 0, &[2, 4], None)
        };
        assert!(matches!(
            plan_source(0, 0, &own, &d, 2),
            Err(Error::SourceLayout {
                problem: SourceProblem::IsDestination,
                ..
            })
        ));
        let copy_only = Source {
            usage: wgpu::BufferUsages::COPY_SRC,
            ..src(64, DType::F16, 0, &[2, 4], None)
        };
        let e = plan_source(0, 0, &copy_only, &d, 2).unwrap_err();
        assert!(
            matches!(
                &e,
                Error::SourceLayout {
                    problem: SourceProblem::NeedsStorage {
                        why: CopyBlocker::Type {
                            held: DType::F16,
                            storage: DType::F32
                        },
                        ..
                    },
                    ..
                }
            ),
            "{e}"
        );
    }

    #[test]
    fn empty_appends_move_nothing() {
        let d = dst(DType::F32, 4);
        assert_eq!(
            plan_source(0, 0, &src(64, DType::F32, 0, &[0, 4], None), &d, 0).unwrap(),
            SourceJob::Nothing
        );
    }
}
