//! Random sequences of valid and invalid operations, applied to the GPU cache and to a plain-Rust model
//! written independently of the ledger: after every step the ledger and every word of GPU memory equal
//! the model. Natively `tests/model.rs` draws the sequences with proptest (and shrinks a failure); the
//! browser suite runs sequences of [`pseudo_random_ops`].

use super::{cache_on, snapshot, values};
use kvgpu::reference::{self, CpuCache};
use kvgpu::wgpu::{self, util::DeviceExt};
use kvgpu::*;

const CAPACITY: usize = 10;

#[derive(Clone, Debug)]
pub enum Op {
    /// Host append to `layer` of `n` rows; `bad` 1 breaks slot 1's row count, 2 its trailing shape.
    Host {
        layer: usize,
        n: usize,
        seed: u64,
        bad: u8,
    },
    /// Strided GPU append (every other source row) of `n` rows.
    Gpu {
        layer: usize,
        n: usize,
        seed: u64,
    },
    Advance(usize),
    Truncate {
        new_len: usize,
        scrub: bool,
    },
    Reset,
    ResetFast,
}

/// Model of positions, written from the contract, not from the ledger's code.
struct Model {
    len: usize,
    pending: Vec<usize>,
    words: CpuCache,
    slotted: Vec<bool>,
}

/// Odd widths, or whole blocks of 32 for the block-quantized types.
fn spec(dtype: DType) -> CacheSpec {
    let (mla, kv) = match dtype.block() {
        Some(b) => (LayerSpec::mla(b, b), LayerSpec::kv(2, b, b)),
        None => (LayerSpec::mla(5, 3), LayerSpec::kv(2, 3, 1)),
    };
    CacheSpec::new(vec![mla, LayerSpec::empty(), kv], dtype, CAPACITY).unwrap()
}

/// Applies `ops` to a cache on `g` and to the model, checking the outcome of every operation, the
/// positions and every word of GPU memory after each.
pub async fn random_operations_match_the_model(g: &Gpu, dtype: DType, ops: &[Op]) {
    let spec = spec(dtype);
    let mut c = cache_on(g, spec.clone());
    let mut m = Model {
        len: 0,
        pending: vec![0; 3],
        words: CpuCache::new(&spec),
        slotted: spec.layers().iter().map(|l| !l.slots.is_empty()).collect(),
    };
    for op in ops {
        match *op {
            Op::Host {
                layer,
                n,
                seed,
                bad,
            } => {
                let trailing: Vec<Vec<usize>> = spec
                    .layers()
                    .get(layer)
                    .map(|l| l.slots.iter().map(|s| s.trailing.clone()).collect())
                    .unwrap_or_default();
                let mut shapes: Vec<Vec<usize>> =
                    trailing.iter().map(|t| [&[n][..], t].concat()).collect();
                if let Some(s1) = shapes.get_mut(1) {
                    match bad {
                        1 => s1[0] += 1,
                        2 => s1.push(1),
                        _ => {}
                    }
                }
                let data: Vec<Vec<f32>> = shapes
                    .iter()
                    .enumerate()
                    .map(|(i, s)| values(seed ^ i as u64, s.iter().product()))
                    .collect();
                let slabs: Vec<HostSlab> = data
                    .iter()
                    .zip(&shapes)
                    .map(|(d, s)| HostSlab::f32(d, s))
                    .collect();
                let valid = layer < 3
                    && (bad == 0 || trailing.len() < 2)
                    && (!m.slotted[layer] || m.len + m.pending[layer] + n <= CAPACITY);
                let got = c.append(layer, &slabs);
                assert_eq!(got.is_ok(), valid, "{:?} -> {:?}", op, got);
                // A refusal names what was wrong: the layer, then slot 1's shape, then room.
                if let Err(e) = &got {
                    let named = match e {
                        Error::LayerOutOfRange { .. } => layer >= 3,
                        Error::RowCountMismatch { slot: 1, .. } => bad == 1,
                        Error::SlabShape { slot: 1, .. } => bad == 2,
                        Error::CapacityExceeded { .. } => layer < 3 && m.slotted[layer],
                        _ => false,
                    };
                    assert!(named, "{op:?} -> {e}");
                }
                if valid {
                    for (slot, d) in data.iter().enumerate() {
                        let bits: Vec<u32> = d
                            .iter()
                            .map(|&x| reference::f32_to_bits(x, dtype))
                            .collect();
                        m.words
                            .write_rows(layer, slot, m.len + m.pending[layer], &bits);
                    }
                    // A layer without slots takes no slabs, so no rows.
                    m.pending[layer] += if m.slotted[layer] { n } else { 0 };
                }
            }
            Op::Gpu { layer, n, seed } => {
                let trailing: Vec<Vec<usize>> = spec.layers()[layer]
                    .slots
                    .iter()
                    .map(|s| s.trailing.clone())
                    .collect();
                // Every other row of the widest slot, after one leading element.
                let widest = trailing
                    .iter()
                    .map(|t| t.iter().product())
                    .max()
                    .unwrap_or(0);
                let src: Vec<u32> = values(seed, (1 + 2 * n * widest).max(64))
                    .into_iter()
                    .map(f32::to_bits)
                    .collect();
                let buf = g
                    .device
                    .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                        label: None,
                        contents: bytemuck::cast_slice(&src),
                        usage: wgpu::BufferUsages::STORAGE,
                    });
                verify_buffer(&g.device, &buf).await.unwrap();
                let shapes: Vec<Vec<usize>> =
                    trailing.iter().map(|t| [&[n][..], t].concat()).collect();
                let strides: Vec<Vec<usize>> = shapes
                    .iter()
                    .map(|s| {
                        let row: usize = s[1..].iter().product();
                        let mut st = vec![2 * row];
                        st.extend((1..s.len()).map(|k| s[k + 1..].iter().product::<usize>()));
                        st
                    })
                    .collect();
                let slabs: Vec<GpuSlab> = shapes
                    .iter()
                    .zip(&strides)
                    .map(|(s, st)| GpuSlab {
                        buffer: &buf,
                        dtype: DType::F32,
                        offset: 1,
                        shape: s,
                        strides: Some(st),
                    })
                    .collect();
                let valid = !m.slotted[layer] || m.len + m.pending[layer] + n <= CAPACITY;
                let got = c.append_gpu(layer, &slabs);
                assert_eq!(got.is_ok(), valid, "{:?} -> {:?}", op, got);
                if let Err(e) = &got {
                    assert!(matches!(e, Error::CapacityExceeded { .. }), "{op:?} -> {e}");
                }
                if valid {
                    for (slot, (s, st)) in shapes.iter().zip(&strides).enumerate() {
                        let bits: Vec<u32> = reference::gather_strided(&src, 1, s, st)
                            .into_iter()
                            .map(|b| reference::convert_bits(b, DType::F32, dtype))
                            .collect();
                        m.words
                            .write_rows(layer, slot, m.len + m.pending[layer], &bits);
                    }
                    m.pending[layer] += if m.slotted[layer] { n } else { 0 };
                }
            }
            Op::Advance(n) => {
                let valid = (0..3).all(|l| !m.slotted[l] || m.pending[l] == n);
                let got = c.advance(n);
                assert_eq!(got.is_ok(), valid, "{:?} -> {:?}", op, got);
                if let Err(e) = &got {
                    assert!(matches!(e, Error::UnevenAdvance { .. }), "{op:?} -> {e}");
                }
                if valid {
                    m.len += n;
                    m.pending = vec![0; 3];
                }
            }
            Op::Truncate { new_len, scrub } => {
                let valid = new_len <= m.len;
                let got = if scrub {
                    c.truncate_and_scrub(new_len)
                } else {
                    c.truncate(new_len)
                };
                assert_eq!(got.is_ok(), valid, "{:?} -> {:?}", op, got);
                if let Err(e) = &got {
                    assert!(
                        matches!(e, Error::TruncateBeyondLength { .. }),
                        "{op:?} -> {e}"
                    );
                }
                if valid {
                    if scrub {
                        for l in (0..3).filter(|&l| m.slotted[l]) {
                            m.words.zero_rows(l, new_len, m.len + m.pending[l]);
                        }
                    }
                    m.len = new_len;
                    m.pending = vec![0; 3];
                }
            }
            Op::Reset => {
                c.reset().unwrap();
                m.words.zero_all();
                m.len = 0;
                m.pending = vec![0; 3];
            }
            Op::ResetFast => {
                c.reset_fast();
                m.len = 0;
                m.pending = vec![0; 3];
            }
        }
        assert_eq!(c.len(), m.len);
        for l in 0..3 {
            assert_eq!(c.ledger().pending(l).unwrap(), m.pending[l]);
            assert_eq!(c.visible(l).unwrap(), m.len + m.pending[l]);
        }
        assert_eq!(c.remaining(), CAPACITY - m.len);
        assert!(
            snapshot(&c).await == m.words.words,
            "GPU memory differs from the model after {:?}",
            op
        );
    }
}

/// `n` operations drawn with the weights of `tests/model.rs`'s strategy (host appends 4, GPU appends
/// 3, advances 3, truncates 2, resets 1, fast resets 1; one host append in 8 breaks slot 1's row count
/// and one its trailing shape) from a xorshift generator seeded with `seed`.
pub fn pseudo_random_ops(seed: u64, n: usize) -> Vec<Op> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut next = move |below: u64| {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s % below
    };
    (0..n)
        .map(|_| match next(14) {
            0..=3 => Op::Host {
                layer: next(4) as usize,
                n: next(5) as usize,
                seed: next(u64::MAX),
                bad: [0, 0, 0, 0, 0, 0, 1, 2][next(8) as usize],
            },
            4..=6 => Op::Gpu {
                layer: next(3) as usize,
                n: next(4) as usize,
                seed: next(u64::MAX),
            },
            7..=9 => Op::Advance(next(5) as usize),
            10 | 11 => Op::Truncate {
                new_len: next(8) as usize,
                scrub: next(2) == 1,
            },
            12 => Op::Reset,
            _ => Op::ResetFast,
        })
        .collect()
}

/// 24 sequences of 1 to 15 operations from [`pseudo_random_ops`], every storage type in turn.
pub async fn pseudo_random_operations_match_the_model(g: &Gpu) {
    for case in 0..24u64 {
        let dtype = DType::STORAGE[case as usize % DType::STORAGE.len()];
        let ops = pseudo_random_ops(case + 1, 1 + (case as usize * 7) % 15);
        super::note!("case {case}, {dtype}: {ops:?}");
        random_operations_match_the_model(g, dtype, &ops).await;
    }
}
