//! What a cache holds: layers of slots, each slot `[max_seq_len, ...trailing]` of one storage type
//! (the cache's, or the slot's own: K and V may differ); presets for real models, and byte accounting
//! checked against the device's limits.

use crate::codec::{DType, bits_to_f32, f32_to_bits, padded_row_bytes, row_elems};
use crate::error::{Error, Result, SpecProblem};

/// One named slot of a layer: its rows are `trailing`-shaped tensors.
#[derive(Clone, Debug)]
pub struct SlotSpec {
    pub name: String,
    pub trailing: Vec<usize>,
    /// The slot's own storage type; `None`: the cache's. A built [`CacheSpec`] keeps `None` for every
    /// slot of the cache's type, so that two specs storing the same types compare equal.
    pub dtype: Option<DType>,
    /// fp8 slots only: the scale of the stored values, as vLLM's `k_scale` / `v_scale` (a value is its
    /// stored fp8 number times the scale; appends store `x * (1 / scale)` rounded to fp8, so that
    /// values beyond fp8's range of +-448 keep their precision). `None`: 1, no multiplication; a
    /// built [`CacheSpec`] keeps `None` for a scale of 1.
    pub scale: Option<f32>,
}

/// Scales compare by their bits, so that a spec equals itself whatever it holds.
impl PartialEq for SlotSpec {
    fn eq(&self, other: &Self) -> bool {
        self.name == other.name
            && self.trailing == other.trailing
            && self.dtype == other.dtype
            && self.scale.map(f32::to_bits) == other.scale.map(f32::to_bits)
    }
}

impl Eq for SlotSpec {}

impl SlotSpec {
    /// A slot named `name` whose rows are `trailing`-shaped, stored as the cache's type, unscaled.
    pub fn new(name: impl Into<String>, trailing: &[usize]) -> Self {
        Self {
            name: name.into(),
            trailing: trailing.to_vec(),
            dtype: None,
            scale: None,
        }
    }

    /// The same slot stored as `dtype` whatever the cache's storage type.
    pub fn stored_as(mut self, dtype: DType) -> Self {
        self.dtype = Some(dtype);
        self
    }

    /// The same slot with fp8 values scaled by `scale` (see [`SlotSpec::scale`]).
    pub fn scaled(mut self, scale: f32) -> Self {
        self.scale = Some(scale);
        self
    }

    /// Elements per row (the product of the trailing shape; 1 for rank 0).
    pub fn row_elems(&self) -> usize {
        row_elems(&self.trailing).unwrap_or(usize::MAX)
    }
}

/// The slots of one layer, in order. No slots: a layer without attention that owns no memory.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct LayerSpec {
    pub slots: Vec<SlotSpec>,
}

impl LayerSpec {
    /// A layer of these slots, in this order.
    pub fn new(slots: Vec<SlotSpec>) -> Self {
        Self { slots }
    }

    /// A layer with no cache (linear attention, recurrent or other stateless-in-sequence layers).
    pub fn empty() -> Self {
        Self::default()
    }

    /// Standard attention: K `[n_kv_heads, head_dim]` and V `[n_kv_heads, head_dim_v]`.
    pub fn kv(n_kv_heads: usize, head_dim: usize, head_dim_v: usize) -> Self {
        Self::new(vec![
            SlotSpec::new("k", &[n_kv_heads, head_dim]),
            SlotSpec::new("v", &[n_kv_heads, head_dim_v]),
        ])
    }

    /// Multi-head latent attention: `compressed_kv [kv_lora_rank]` and `k_pe [rope_dim]`.
    pub fn mla(kv_lora_rank: usize, rope_dim: usize) -> Self {
        Self::new(vec![
            SlotSpec::new("compressed_kv", &[kv_lora_rank]),
            SlotSpec::new("k_pe", &[rope_dim]),
        ])
    }
}

/// The per-buffer limits a cache must respect; [`DeviceLimits::from_wgpu`] reads them off a device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceLimits {
    pub max_storage_buffer_binding_size: u64,
    pub max_buffer_size: u64,
}

impl DeviceLimits {
    /// WebGPU's defaults: 128 MiB per storage binding, 256 MiB per buffer.
    pub const WEBGPU_DEFAULT: DeviceLimits = DeviceLimits {
        max_storage_buffer_binding_size: 128 << 20,
        max_buffer_size: 256 << 20,
    };

    /// The storage binding and buffer size limits of a device's `wgpu::Limits`.
    pub fn from_wgpu(limits: &wgpu::Limits) -> Self {
        Self {
            max_storage_buffer_binding_size: limits.max_storage_buffer_binding_size,
            max_buffer_size: limits.max_buffer_size,
        }
    }

    /// The storage binding limit kvgpu plans with: the device's, within its largest buffer (a device
    /// may bind more than one buffer holds, and kvgpu makes the scratch and upload buffers it binds),
    /// and at most `u32::MAX` bytes, since kernel parameters address a binding in 32-bit words.
    pub fn binding_bytes(&self) -> u64 {
        self.max_storage_buffer_binding_size
            .min(self.max_buffer_size)
            .min(u32::MAX as u64)
    }

    /// The largest single slot buffer the device can bind whole: [`binding_bytes`](Self::binding_bytes)
    /// in whole 16-byte vectors (the zeroing kernel writes slots so; Vulkan and DX12 report a binding
    /// limit of 2<sup>31</sup> - 1 bytes, which is rounded down). So it is at most 4 GiB on any device.
    pub fn max_slot_bytes(&self) -> u64 {
        crate::kernels::whole_vectors_within(self.binding_bytes())
    }
}

/// The complete description of a cache: layers, storage types and capacity in rows.
///
/// Every slot has one storage type: its own ([`SlotSpec::stored_as`], [`CacheSpec::with_slot_dtype`])
/// or the cache's. So K and V may differ, as llama.cpp's `--cache-type-k` / `--cache-type-v` allow:
///
/// ```
/// use kvgpu::{CacheSpec, DType};
/// // Keys in q8_0, values in q4_0: 0.41 of the f16 bytes.
/// let spec = CacheSpec::llama3_8b(DType::Q8_0, 4096)?.with_slot_dtype("v", DType::Q4_0)?;
/// assert_eq!(spec.slot_dtype(0, 1)?, DType::Q4_0);
/// assert_eq!(spec.bytes_per_token(), 32 * 8 * (136 + 72));
/// # Ok::<(), kvgpu::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CacheSpec {
    layers: Vec<LayerSpec>,
    dtype: DType,
    max_seq_len: usize,
}

/// Most layers [`CacheSpec::uniform`] builds (real models have at most a few hundred).
pub const MAX_LAYERS: usize = 1 << 16;

/// Most bytes a spec's description may take: its layers' slot names and shapes, counted as a
/// snapshot header stores them (a real model's takes a few dozen bytes per slot). So every cache
/// can be snapshotted, and [`CacheSpec::uniform`] never copies a layer into more memory than this
/// bounds.
pub const MAX_DESCRIPTION_BYTES: u64 = 16 << 20;

/// The storage type, `max_seq_len`, the committed length, the page size and the layer count.
const DESCRIPTION_FIXED_BYTES: u64 = 4 + 3 * 8 + 4;

/// The bytes that describe `layer` in a snapshot header: its slot count, then each slot's name and
/// shape with their lengths, its storage type and its scale.
fn layer_description_bytes(layer: &LayerSpec) -> u64 {
    layer.slots.iter().fold(4u64, |acc, s| {
        let shape = (s.trailing.len() as u64).saturating_mul(8);
        acc.saturating_add(16)
            .saturating_add(s.name.len() as u64)
            .saturating_add(shape)
    })
}

pub(crate) fn description_bytes(layers: &[LayerSpec]) -> u64 {
    layers.iter().fold(DESCRIPTION_FIXED_BYTES, |acc, l| {
        acc.saturating_add(layer_description_bytes(l))
    })
}

/// Refuses a description of `bytes` past [`MAX_DESCRIPTION_BYTES`].
fn check_description(n_layers: usize, bytes: u64) -> Result<()> {
    if bytes > MAX_DESCRIPTION_BYTES {
        return Err(Error::InvalidSpec {
            problem: SpecProblem::DescriptionTooLarge {
                n_layers,
                bytes,
                max: MAX_DESCRIPTION_BYTES,
            },
        });
    }
    Ok(())
}

impl CacheSpec {
    /// Checks the description and builds it; `dtype` is the storage type of every slot that does
    /// not name its own. A description that fails a check is refused with [`Error::InvalidSpec`],
    /// which names the first failure. The checks:
    /// - there is at least one layer ([`SpecProblem::NoLayers`]), `max_seq_len` is not 0
    ///   ([`SpecProblem::ZeroCapacity`]) and some layer has a slot ([`SpecProblem::NoSlots`]);
    /// - no slot's trailing shape has a dimension of 0 ([`SpecProblem::ZeroDimension`]);
    /// - only fp8 slots have a scale ([`SpecProblem::ScaleNotFp8`]), and each scale is a positive
    ///   normal number with a normal reciprocal whose product with the slot's largest fp8 value is
    ///   finite ([`SpecProblem::BadScale`]);
    /// - the innermost trailing dimension of a q8_0 or q4_0 slot is whole blocks of 32 elements
    ///   ([`SpecProblem::BlockWidth`]);
    /// - every slot's row has at most `u32::MAX` elements, and its `max_seq_len` rows come to at
    ///   most `u64::MAX / 4` bytes ([`SpecProblem::TooLarge`]);
    /// - the rows of all slots at full capacity come to at most `u64::MAX / 4` bytes
    ///   ([`SpecProblem::TotalTooLarge`]);
    /// - the slot names and shapes of all layers take at most [`MAX_DESCRIPTION_BYTES`] as a
    ///   snapshot header stores them ([`SpecProblem::DescriptionTooLarge`]; checked before the
    ///   slots).
    ///
    /// A slot's own type equal to `dtype`, and a scale of 1, are kept as `None`
    /// ([`SlotSpec::dtype`], [`SlotSpec::scale`]). The device's limits are checked later
    /// ([`CacheSpec::check_limits`], which [`crate::KvCache::new`] calls).
    pub fn new(mut layers: Vec<LayerSpec>, dtype: DType, max_seq_len: usize) -> Result<Self> {
        let invalid = |problem: SpecProblem| Err(Error::InvalidSpec { problem });
        if layers.is_empty() {
            return invalid(SpecProblem::NoLayers);
        }
        if max_seq_len == 0 {
            return invalid(SpecProblem::ZeroCapacity);
        }
        if layers.iter().all(|l| l.slots.is_empty()) {
            return invalid(SpecProblem::NoSlots {
                n_layers: layers.len(),
            });
        }
        check_description(layers.len(), description_bytes(&layers))?;
        for slot in layers.iter_mut().flat_map(|l| &mut l.slots) {
            if slot.dtype == Some(dtype) {
                slot.dtype = None;
            }
        }
        for (l, layer) in layers.iter().enumerate() {
            for (s, slot) in layer.slots.iter().enumerate() {
                let dtype = Self::stored(slot, dtype);
                if slot.trailing.contains(&0) {
                    return invalid(SpecProblem::ZeroDimension {
                        layer: l,
                        slot: s,
                        name: slot.name.clone(),
                        trailing: slot.trailing.clone(),
                    });
                }
                if let Some(scale) = slot.scale {
                    if !dtype.is_fp8() {
                        return invalid(SpecProblem::ScaleNotFp8 {
                            layer: l,
                            slot: s,
                            name: slot.name.clone(),
                            dtype,
                        });
                    }
                    // Positive and normal, with a normal reciprocal: 2^-126 <= scale <= 2^126;
                    // and the type's largest value (its code of f32::MAX) times it finite, so that
                    // no code reads back as an infinity (an append of f32::MAX at 2^120 stored
                    // e4m3's 256).
                    let usable = |x: f32| x.is_normal() && x > 0.0;
                    let largest = bits_to_f32(f32_to_bits(f32::MAX, dtype), dtype);
                    if !usable(scale) || !usable(1.0 / scale) || !(largest * scale).is_finite() {
                        return invalid(SpecProblem::BadScale {
                            layer: l,
                            slot: s,
                            name: slot.name.clone(),
                            scale,
                        });
                    }
                }
                if let Some(block) = dtype.block() {
                    // Blocks never straddle two heads (or two of any outer axis).
                    let width = slot.trailing.last().copied().unwrap_or(1);
                    if !width.is_multiple_of(block) {
                        return invalid(SpecProblem::BlockWidth {
                            layer: l,
                            slot: s,
                            name: slot.name.clone(),
                            width,
                            dtype,
                            block,
                        });
                    }
                }
                // Rows of at most u32::MAX elements, so that row bytes fit u64 before anything multiplies.
                let too_large = row_elems(&slot.trailing)
                    .filter(|&e| e <= u32::MAX as usize)
                    .and_then(|e| padded_row_bytes(e, dtype).checked_mul(max_seq_len as u64))
                    .is_none_or(|bytes| bytes > u64::MAX / 4);
                if too_large {
                    return invalid(SpecProblem::TooLarge {
                        layer: l,
                        slot: s,
                        name: slot.name.clone(),
                        trailing: slot.trailing.clone(),
                        max_seq_len,
                    });
                }
            }
        }
        let total = layers
            .iter()
            .flat_map(|l| &l.slots)
            .try_fold(0u64, |acc, s| {
                acc.checked_add(
                    padded_row_bytes(s.row_elems(), Self::stored(s, dtype)) * max_seq_len as u64,
                )
            });
        if total.is_none_or(|t| t > u64::MAX / 4) {
            return invalid(SpecProblem::TotalTooLarge {
                n_layers: layers.len(),
                max_seq_len,
            });
        }
        // A scale of 1 multiplies by nothing (`x * (1 / 1)` is `x`, bit for bit): kept as `None`, so
        // that two specs storing the same values compare equal.
        for slot in layers.iter_mut().flat_map(|l| &mut l.slots) {
            if slot.scale == Some(1.0) {
                slot.scale = None;
            }
        }
        Ok(Self {
            layers,
            dtype,
            max_seq_len,
        })
    }

    /// `n_layers` identical layers: at most [`MAX_LAYERS`] ([`SpecProblem::TooManyLayers`]), whose
    /// description is checked ([`SpecProblem::DescriptionTooLarge`]) before the layer is copied.
    pub fn uniform(
        n_layers: usize,
        layer: LayerSpec,
        dtype: DType,
        max_seq_len: usize,
    ) -> Result<Self> {
        if n_layers > MAX_LAYERS {
            return Err(Error::InvalidSpec {
                problem: SpecProblem::TooManyLayers {
                    n_layers,
                    max: MAX_LAYERS,
                },
            });
        }
        // Checked before the copies: a layer of a few megabytes of names or shape, copied 65,536
        // times, would not fit in memory.
        let bytes = (n_layers as u64)
            .saturating_mul(layer_description_bytes(&layer))
            .saturating_add(DESCRIPTION_FIXED_BYTES);
        check_description(n_layers, bytes)?;
        Self::new(vec![layer; n_layers], dtype, max_seq_len)
    }

    /// Llama-3-8B: 32 layers, K/V of 8 KV heads x 128.
    pub fn llama3_8b(dtype: DType, max_seq_len: usize) -> Result<Self> {
        Self::uniform(32, LayerSpec::kv(8, 128, 128), dtype, max_seq_len)
    }

    /// Qwen3-0.6B: 28 layers, K/V of 8 KV heads x 128.
    pub fn qwen3_0_6b(dtype: DType, max_seq_len: usize) -> Result<Self> {
        Self::uniform(28, LayerSpec::kv(8, 128, 128), dtype, max_seq_len)
    }

    /// DeepSeek-V2-Lite MLA: 27 layers of `compressed_kv [512]` + `k_pe [64]`.
    pub fn deepseek_v2_lite(dtype: DType, max_seq_len: usize) -> Result<Self> {
        Self::uniform(27, LayerSpec::mla(512, 64), dtype, max_seq_len)
    }

    /// A hybrid model: 24 layers where every fourth (3, 7, 11, ...) is full attention with K/V of
    /// 2 KV heads x 256 and the rest are linear-attention layers that own no cache.
    pub fn hybrid(dtype: DType, max_seq_len: usize) -> Result<Self> {
        let layers = (0..24)
            .map(|l| {
                if l % 4 == 3 {
                    LayerSpec::kv(2, 256, 256)
                } else {
                    LayerSpec::empty()
                }
            })
            .collect();
        Self::new(layers, dtype, max_seq_len)
    }

    /// A preset by name: `llama3-8b`, `qwen3-0.6b`, `deepseek-v2-lite` or `hybrid`.
    pub fn preset(name: &str, dtype: DType, max_seq_len: usize) -> Result<Self> {
        match name {
            "llama3-8b" => Self::llama3_8b(dtype, max_seq_len),
            "qwen3-0.6b" => Self::qwen3_0_6b(dtype, max_seq_len),
            "deepseek-v2-lite" => Self::deepseek_v2_lite(dtype, max_seq_len),
            "hybrid" => Self::hybrid(dtype, max_seq_len),
            other => Err(Error::InvalidSpec {
                problem: SpecProblem::UnknownPreset { name: other.into() },
            }),
        }
    }

    /// The layers, in order.
    pub fn layers(&self) -> &[LayerSpec] {
        &self.layers
    }

    /// The number of layers, those without slots included.
    pub fn n_layers(&self) -> usize {
        self.layers.len()
    }

    /// The cache's storage type: that of every slot not given its own.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The storage type of one slot.
    pub fn slot_dtype(&self, layer: usize, slot: usize) -> Result<DType> {
        Ok(self.dtype_of(self.slot(layer, slot)?))
    }

    /// The scale of one slot's fp8 values ([`SlotSpec::scale`]).
    pub fn slot_scale(&self, layer: usize, slot: usize) -> Result<Option<f32>> {
        Ok(self.slot(layer, slot)?.scale)
    }

    /// This spec with the fp8 values of one slot scaled by `scale` (per layer and slot, as a
    /// calibrated model's `k_scale` / `v_scale`). Refused for a slot that is not fp8, a scale that is
    /// not a positive normal number with a normal reciprocal or whose product with the type's largest
    /// value (448 or 57,344) is not finite, or as [`CacheSpec::slot`] refuses.
    pub fn with_slot_scale(&self, layer: usize, slot: usize, scale: f32) -> Result<Self> {
        self.slot(layer, slot)?;
        let mut layers = self.layers.clone();
        layers[layer].slots[slot].scale = Some(scale);
        Self::new(layers, self.dtype, self.max_seq_len)
    }

    /// Whether any slot is stored in another type than the cache's.
    pub fn is_mixed(&self) -> bool {
        self.slots().any(|s| self.dtype_of(s) != self.dtype)
    }

    /// This spec with every slot named `name` (in every layer) stored as `dtype`: keys in one type and
    /// values in another, say. Refused if no slot has that name, or as [`CacheSpec::new`] refuses.
    pub fn with_slot_dtype(&self, name: &str, dtype: DType) -> Result<Self> {
        if !self.slots().any(|s| s.name == name) {
            return Err(Error::InvalidSpec {
                problem: SpecProblem::UnknownSlotName {
                    name: name.to_string(),
                    names: self.slot_names(),
                },
            });
        }
        let mut layers = self.layers.clone();
        for slot in layers.iter_mut().flat_map(|l| &mut l.slots) {
            if slot.name == name {
                slot.dtype = Some(dtype);
            }
        }
        Self::new(layers, self.dtype, self.max_seq_len)
    }

    /// This spec holding `max_seq_len` rows: a snapshot's spec with room to go on decoding, or a
    /// capacity the device holds ([`CacheSpec::max_capacity_for`]). Refused as [`CacheSpec::new`]
    /// refuses (0 rows, or more bytes than it counts).
    pub fn with_max_seq_len(&self, max_seq_len: usize) -> Result<Self> {
        Self::new(self.layers.clone(), self.dtype, max_seq_len)
    }

    fn slots(&self) -> impl Iterator<Item = &SlotSpec> {
        self.layers.iter().flat_map(|l| &l.slots)
    }

    /// The slots' names, each once, in the order they first appear.
    fn slot_names(&self) -> Vec<String> {
        let mut names: Vec<String> = Vec::new();
        for slot in self.slots() {
            if !names.contains(&slot.name) {
                names.push(slot.name.clone());
            }
        }
        names
    }

    /// A slot's storage type: its own, or the cache's.
    fn stored(slot: &SlotSpec, dtype: DType) -> DType {
        slot.dtype.unwrap_or(dtype)
    }

    /// The storage type of `slot`, one of this spec's slots.
    pub(crate) fn dtype_of(&self, slot: &SlotSpec) -> DType {
        Self::stored(slot, self.dtype)
    }

    /// Capacity in rows (tokens).
    pub fn max_seq_len(&self) -> usize {
        self.max_seq_len
    }

    /// The slot, or the error naming what is out of range.
    pub fn slot(&self, layer: usize, slot: usize) -> Result<&SlotSpec> {
        let l = self.layers.get(layer).ok_or(Error::LayerOutOfRange {
            layer,
            n_layers: self.layers.len(),
        })?;
        l.slots.get(slot).ok_or(Error::SlotOutOfRange {
            layer,
            slot,
            n_slots: l.slots.len(),
        })
    }

    /// Stored bytes of one row of a slot (padded to 4 bytes).
    pub fn row_bytes(&self, layer: usize, slot: usize) -> Result<u64> {
        let s = self.slot(layer, slot)?;
        Ok(padded_row_bytes(s.row_elems(), self.dtype_of(s)))
    }

    /// Bytes of a slot's rows at full capacity: row bytes times `max_seq_len`. The buffer
    /// [`crate::KvCache`] allocates for the slot is this rounded up to whole 16-byte vectors
    /// (32-byte ones on devices that zero with 64-bit words, where that stays within the device's
    /// limits), so it may be up to 28 bytes larger.
    pub fn slot_bytes(&self, layer: usize, slot: usize) -> Result<u64> {
        Ok(self.row_bytes(layer, slot)? * self.max_seq_len as u64)
    }

    /// Bytes one token takes in one layer (0 for a layer without slots).
    pub fn layer_bytes_per_token(&self, layer: usize) -> Result<u64> {
        let l = self.layers.get(layer).ok_or(Error::LayerOutOfRange {
            layer,
            n_layers: self.layers.len(),
        })?;
        Ok(l.slots
            .iter()
            .map(|s| padded_row_bytes(s.row_elems(), self.dtype_of(s)))
            .sum())
    }

    /// Bytes one token takes across all layers.
    pub fn bytes_per_token(&self) -> u64 {
        self.slots()
            .map(|s| padded_row_bytes(s.row_elems(), self.dtype_of(s)))
            .sum()
    }

    /// Bytes of every slot's rows at full capacity: [`CacheSpec::bytes_per_token`] times
    /// `max_seq_len`. It is the sum of [`CacheSpec::slot_bytes`], so the buffers [`crate::KvCache`]
    /// allocates, each rounded up to whole vectors, may take a little more. (A
    /// [`crate::PagedCache`]'s spec bounds one sequence: its pool holds `n_pages * page_size`
    /// rows.)
    pub fn total_bytes(&self) -> u64 {
        self.bytes_per_token() * self.max_seq_len as u64
    }

    /// Refuses a slot that one storage binding of the device cannot hold, naming the largest capacity
    /// that would fit. kvgpu keeps every slot in one buffer so that attention and the app's own kernels
    /// can bind its visible rows as one range; it does not split a slot across buffers.
    pub fn check_limits(&self, limits: &DeviceLimits) -> Result<()> {
        let limit = limits.max_slot_bytes();
        for (l, layer) in self.layers.iter().enumerate() {
            for s in 0..layer.slots.len() {
                let row_bytes = self.row_bytes(l, s)?;
                let bytes = row_bytes * self.max_seq_len as u64;
                if bytes > limit {
                    return Err(Error::SlotTooLarge {
                        layer: l,
                        slot: s,
                        bytes,
                        row_bytes,
                        capacity: self.max_seq_len,
                        limit,
                        max_capacity: usize::try_from(limit / row_bytes).unwrap_or(usize::MAX),
                    });
                }
            }
        }
        Ok(())
    }

    /// The largest capacity whose every slot fits the device's limits.
    pub fn max_capacity_for(&self, limits: &DeviceLimits) -> usize {
        let widest = (0..self.layers.len())
            .flat_map(|l| (0..self.layers[l].slots.len()).map(move |s| (l, s)))
            .filter_map(|(l, s)| self.row_bytes(l, s).ok())
            .max()
            .unwrap_or(4);
        usize::try_from(limits.max_slot_bytes() / widest).unwrap_or(usize::MAX)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_accounting_of_presets() {
        let llama = CacheSpec::llama3_8b(DType::F16, 8192).unwrap();
        // 32 layers x (K + V) x 8 heads x 128 dims x 2 bytes = 128 KiB per token.
        assert_eq!(llama.bytes_per_token(), 32 * 2 * 8 * 128 * 2);
        assert_eq!(llama.layer_bytes_per_token(5).unwrap(), 2 * 8 * 128 * 2);
        assert_eq!(llama.total_bytes(), llama.bytes_per_token() * 8192);

        let mla = CacheSpec::deepseek_v2_lite(DType::BF16, 4096).unwrap();
        assert_eq!(mla.bytes_per_token(), 27 * (512 + 64) * 2);

        let hybrid = CacheSpec::hybrid(DType::F32, 16).unwrap();
        assert_eq!(hybrid.layer_bytes_per_token(0).unwrap(), 0);
        assert_eq!(hybrid.layer_bytes_per_token(3).unwrap(), 2 * 2 * 256 * 4);
        assert_eq!(hybrid.bytes_per_token(), 6 * 2 * 2 * 256 * 4);
    }

    #[test]
    fn odd_16_bit_rows_are_padded_to_words() {
        let spec = CacheSpec::new(
            vec![LayerSpec::new(vec![SlotSpec::new("x", &[3])])],
            DType::F16,
            5,
        )
        .unwrap();
        assert_eq!(spec.row_bytes(0, 0).unwrap(), 8);
        assert_eq!(spec.slot_bytes(0, 0).unwrap(), 40);
        let scalar = CacheSpec::new(
            vec![LayerSpec::new(vec![SlotSpec::new("s", &[])])],
            DType::BF16,
            3,
        )
        .unwrap();
        assert_eq!(scalar.row_bytes(0, 0).unwrap(), 4);
    }

    #[test]
    fn invalid_specs_are_refused_with_reasons() {
        let msg = |r: Result<CacheSpec>| r.unwrap_err().to_string();
        assert!(msg(CacheSpec::new(vec![], DType::F32, 4)).contains("no layers"));
        assert!(
            msg(CacheSpec::new(vec![LayerSpec::kv(1, 1, 1)], DType::F32, 0))
                .contains("max_seq_len is 0")
        );
        assert!(
            msg(CacheSpec::new(vec![LayerSpec::empty()], DType::F32, 4))
                .contains("none of the 1 layers")
        );
        assert!(
            msg(CacheSpec::new(vec![LayerSpec::kv(8, 0, 8)], DType::F32, 4))
                .contains("zero dimension")
        );
        assert!(msg(CacheSpec::preset("gpt-9", DType::F32, 4)).contains("unknown preset"));
    }

    /// The spec's checks at their edges, each naming what it refuses: the most layers `uniform`
    /// takes, a row of `u32::MAX` elements, a slot's and the total bytes past `u64::MAX / 4` (the
    /// slot's in layer 1), a zero dimension in a second slot; the capacity a device holds is set by
    /// the widest slot; slots of other names are other specs.
    #[test]
    fn specs_are_checked_at_their_edges() {
        let problem = |r: Result<CacheSpec>| match r {
            Err(Error::InvalidSpec { problem }) => problem,
            r => panic!("{r:?}"),
        };
        let one = |dims: &[usize]| LayerSpec::new(vec![SlotSpec::new("x", dims)]);
        assert!(CacheSpec::uniform(MAX_LAYERS, LayerSpec::kv(1, 1, 1), DType::F32, 1).is_ok());
        assert_eq!(
            problem(CacheSpec::uniform(
                MAX_LAYERS + 1,
                LayerSpec::kv(1, 1, 1),
                DType::F32,
                1
            )),
            SpecProblem::TooManyLayers {
                n_layers: MAX_LAYERS + 1,
                max: MAX_LAYERS
            }
        );
        assert!(CacheSpec::new(vec![one(&[u32::MAX as usize])], DType::F32, 1).is_ok());
        // Counts past 32 bits: a 64-bit machine's.
        #[cfg(target_pointer_width = "64")]
        {
            assert!(matches!(
                problem(CacheSpec::new(vec![one(&[1 << 32])], DType::F32, 1)),
                SpecProblem::TooLarge {
                    layer: 0,
                    slot: 0,
                    ..
                }
            ));
            // 2^61 bytes per layer: each slot fits, the two together do not.
            assert_eq!(
                problem(CacheSpec::uniform(2, one(&[1]), DType::F32, 1 << 59)),
                SpecProblem::TotalTooLarge {
                    n_layers: 2,
                    max_seq_len: 1 << 59
                }
            );
            assert!(CacheSpec::uniform(1, one(&[1]), DType::F32, 1 << 59).is_ok());
            // 2^62 bytes in layer 1's slot.
            assert!(matches!(
                problem(CacheSpec::new(vec![LayerSpec::empty(), one(&[4])], DType::F32, 1 << 58)),
                SpecProblem::TooLarge { layer: 1, slot: 0, max_seq_len, .. } if max_seq_len == 1 << 58
            ));
        }
        assert!(matches!(
            problem(CacheSpec::new(vec![LayerSpec::kv(1, 4, 0)], DType::F32, 4)),
            SpecProblem::ZeroDimension {
                layer: 0,
                slot: 1,
                ..
            }
        ));
        // DeepSeek-V2-Lite in f32: the latent's 2,048-byte rows bound it, not k_pe's 256.
        let mla = CacheSpec::deepseek_v2_lite(DType::F32, 1).unwrap();
        assert_eq!(mla.max_capacity_for(&DeviceLimits::WEBGPU_DEFAULT), 65_536);
        let renamed = LayerSpec::new(vec![SlotSpec::new("a", &[4]), SlotSpec::new("k_pe", &[2])]);
        assert_ne!(
            CacheSpec::new(vec![LayerSpec::mla(4, 2)], DType::F32, 4).unwrap(),
            CacheSpec::new(vec![renamed], DType::F32, 4).unwrap()
        );
    }

    /// A description past 16 MiB is refused by `new` and by `uniform`, naming its bytes: `uniform`
    /// before it copies the layer (a layer of a million dimensions copied 65,536 times would take
    /// 512 GiB, and aborted); the largest real description passes.
    #[test]
    fn descriptions_past_16_mib_are_refused_before_any_copy() {
        let problem = |r: Result<CacheSpec>| match r {
            Err(Error::InvalidSpec { problem }) => problem,
            r => panic!("{r:?}"),
        };
        let wide = LayerSpec::new(vec![SlotSpec::new("x", &[1; 1 << 20])]);
        let per_layer = 4 + 16 + 1 + 8 * (1u64 << 20);
        assert_eq!(
            problem(CacheSpec::uniform(MAX_LAYERS, wide.clone(), DType::F32, 4)),
            SpecProblem::DescriptionTooLarge {
                n_layers: MAX_LAYERS,
                bytes: DESCRIPTION_FIXED_BYTES + MAX_LAYERS as u64 * per_layer,
                max: MAX_DESCRIPTION_BYTES,
            }
        );
        assert_eq!(
            problem(CacheSpec::uniform(2, wide.clone(), DType::F32, 4)),
            SpecProblem::DescriptionTooLarge {
                n_layers: 2,
                bytes: DESCRIPTION_FIXED_BYTES + 2 * per_layer,
                max: MAX_DESCRIPTION_BYTES,
            }
        );
        assert_eq!(
            problem(CacheSpec::new(
                vec![wide.clone(), wide.clone()],
                DType::F32,
                4
            )),
            problem(CacheSpec::uniform(2, wide.clone(), DType::F32, 4))
        );
        // One layer of it fits; so do 65,536 of Llama's.
        assert!(CacheSpec::uniform(1, wide, DType::F32, 4).is_ok());
        let llama = CacheSpec::uniform(MAX_LAYERS, LayerSpec::kv(8, 128, 128), DType::F32, 4);
        assert_eq!(
            description_bytes(llama.unwrap().layers()),
            DESCRIPTION_FIXED_BYTES + MAX_LAYERS as u64 * (4 + 2 * (16 + 1 + 16))
        );
    }

    /// `with_max_seq_len` keeps every layer, slot type and scale, and refuses what `new` refuses.
    #[test]
    fn a_spec_takes_another_capacity() {
        let spec = CacheSpec::llama3_8b(DType::Q8_0, 4096)
            .unwrap()
            .with_slot_dtype("v", DType::F8E4M3)
            .unwrap()
            .with_slot_scale(0, 1, 0.5)
            .unwrap();
        let longer = spec.with_max_seq_len(8192).unwrap();
        assert_eq!(longer.max_seq_len(), 8192);
        assert_eq!(longer.layers(), spec.layers());
        assert_eq!(longer.dtype(), spec.dtype());
        assert_eq!(longer.bytes_per_token(), spec.bytes_per_token());
        assert_eq!(longer.with_max_seq_len(4096).unwrap(), spec);
        assert!(matches!(
            spec.with_max_seq_len(0),
            Err(Error::InvalidSpec {
                problem: SpecProblem::ZeroCapacity
            })
        ));
    }

    #[test]
    fn slots_may_take_their_own_storage_types() {
        let spec = CacheSpec::llama3_8b(DType::Q8_0, 4096)
            .unwrap()
            .with_slot_dtype("v", DType::Q4_0)
            .unwrap();
        assert!(spec.is_mixed());
        assert_eq!(spec.dtype(), DType::Q8_0);
        assert_eq!(spec.slot_dtype(31, 0).unwrap(), DType::Q8_0);
        assert_eq!(spec.slot_dtype(31, 1).unwrap(), DType::Q4_0);
        // K: 8 x 128 q8_0 = 1024 + 64 bytes of scales; V: 512 + 64.
        assert_eq!(spec.row_bytes(0, 0).unwrap(), 1088);
        assert_eq!(spec.row_bytes(0, 1).unwrap(), 576);
        assert_eq!(spec.layer_bytes_per_token(0).unwrap(), 1088 + 576);
        assert_eq!(spec.bytes_per_token(), 32 * (1088 + 576));
        assert_eq!(spec.total_bytes(), 32 * (1088 + 576) * 4096);
        assert_eq!(
            spec.slot_dtype(32, 0).unwrap_err(),
            Error::LayerOutOfRange {
                layer: 32,
                n_layers: 32
            }
        );
        // A slot of the cache's own type is the same spec whichever way it was said.
        let said = CacheSpec::new(
            vec![LayerSpec::new(vec![
                SlotSpec::new("k", &[8, 128]).stored_as(DType::Q8_0),
                SlotSpec::new("v", &[8, 128]).stored_as(DType::Q4_0),
            ])],
            DType::Q8_0,
            4096,
        )
        .unwrap();
        assert_eq!(said.layers()[0], spec.layers()[0]);
        assert_eq!(said.layers()[0].slots[0].dtype, None);
        let uniform = spec.with_slot_dtype("v", DType::Q8_0).unwrap();
        assert_eq!(uniform, CacheSpec::llama3_8b(DType::Q8_0, 4096).unwrap());
        assert!(!uniform.is_mixed());
        // Rebuilt with another cache type, slots of their own keep theirs.
        let f16 = CacheSpec::new(spec.layers().to_vec(), DType::F16, 16).unwrap();
        assert_eq!(f16.slot_dtype(0, 0).unwrap(), DType::F16);
        assert_eq!(f16.slot_dtype(0, 1).unwrap(), DType::Q4_0);
    }

    /// An fp8 slot said to have a scale of 1 is the unscaled slot (the same stored bits), so that
    /// a snapshot of one restores into the other; a scale of 1 on a slot of another type is still
    /// refused.
    #[test]
    fn a_scale_of_one_is_no_scale() {
        let slots = |scale: Option<f32>| {
            let mut k = SlotSpec::new("k", &[2, 4]).stored_as(DType::F8E4M3);
            k.scale = scale;
            vec![LayerSpec::new(vec![k])]
        };
        let one = CacheSpec::new(slots(Some(1.0)), DType::F32, 8).unwrap();
        let none = CacheSpec::new(slots(None), DType::F32, 8).unwrap();
        assert_eq!(one, none);
        assert_eq!(one.layers()[0].slots[0].scale, None);
        let header = |spec: &CacheSpec| crate::snapshot::SnapshotHeader {
            spec: spec.clone(),
            len: 0,
            page_size: 0,
        };
        header(&one).check_compatible(&none).unwrap();
        let two = CacheSpec::new(slots(Some(2.0)), DType::F32, 8).unwrap();
        assert_eq!(two.layers()[0].slots[0].scale, Some(2.0));
        assert!(header(&two).check_compatible(&none).is_err());
        let mut f16 = SlotSpec::new("k", &[2, 4]);
        f16.scale = Some(1.0);
        let e = CacheSpec::new(vec![LayerSpec::new(vec![f16])], DType::F16, 8).unwrap_err();
        assert!(
            matches!(
                e,
                Error::InvalidSpec {
                    problem: SpecProblem::ScaleNotFp8 { .. }
                }
            ),
            "{e}"
        );
    }

    #[test]
    fn slot_types_are_checked_per_slot() {
        let e = CacheSpec::llama3_8b(DType::F32, 8)
            .unwrap()
            .with_slot_dtype("value", DType::F16)
            .unwrap_err();
        assert_eq!(
            e,
            Error::InvalidSpec {
                problem: SpecProblem::UnknownSlotName {
                    name: "value".into(),
                    names: vec!["k".into(), "v".into()],
                }
            }
        );
        assert!(e.to_string().contains("\"value\" (the slots: k, v)"), "{e}");
        // A width of 48 is not whole blocks of 32: refused, naming the slot. Stored as fp8, its own
        // type, it is taken.
        let spec = CacheSpec::uniform(2, LayerSpec::kv(2, 32, 48), DType::Q8_0, 8);
        assert!(matches!(
            spec.unwrap_err(),
            Error::InvalidSpec {
                problem: SpecProblem::BlockWidth {
                    layer: 0,
                    slot: 1,
                    width: 48,
                    ..
                }
            }
        ));
        let spec = CacheSpec::new(
            vec![LayerSpec::new(vec![
                SlotSpec::new("k", &[2, 32]),
                SlotSpec::new("v", &[2, 48]).stored_as(DType::F8E4M3),
            ])],
            DType::Q4_0,
            8,
        )
        .unwrap();
        assert_eq!(spec.row_bytes(0, 1).unwrap(), 96);
        let refused = spec.with_slot_dtype("v", DType::Q4_0).unwrap_err();
        assert!(refused.to_string().contains("48"), "{refused}");
    }

    #[test]
    fn fp8_slots_take_a_scale_and_nothing_else_does() {
        let spec = CacheSpec::llama3_8b(DType::F8E4M3, 16).unwrap();
        let scaled = spec.with_slot_scale(3, 1, 0.0625).unwrap();
        assert_eq!(scaled.slot_scale(3, 1).unwrap(), Some(0.0625));
        assert_eq!(scaled.slot_scale(3, 0).unwrap(), None);
        assert_ne!(scaled, spec);
        assert_eq!(scaled, scaled.clone());
        // The bytes do not change: the scale is one number of the spec.
        assert_eq!(scaled.bytes_per_token(), spec.bytes_per_token());
        // The largest scales whose largest code reads back finite: e4m3's 448 and e5m2's 57,344
        // times them.
        let e4m3_top = f32::MAX / 448.0;
        let e5m2 = CacheSpec::llama3_8b(DType::F8E5M2, 16).unwrap();
        assert!(spec.with_slot_scale(0, 0, e4m3_top).is_ok());
        assert!(e5m2.with_slot_scale(0, 0, e4m3_top).is_err());
        assert!(e5m2.with_slot_scale(0, 0, f32::MAX / 57344.0).is_ok());
        let past = f32::from_bits(e4m3_top.to_bits() + 1);
        assert!((448.0 * past).is_infinite(), "{past}");
        for bad in [0.0, -1.0, f32::NAN, f32::INFINITY, 1e-39, 1e38, past] {
            let e = spec.with_slot_scale(0, 0, bad).unwrap_err();
            assert!(
                matches!(
                    e,
                    Error::InvalidSpec {
                        problem: SpecProblem::BadScale {
                            layer: 0,
                            slot: 0,
                            ..
                        }
                    }
                ),
                "{bad}: {e}"
            );
        }
        let q8 = CacheSpec::llama3_8b(DType::Q8_0, 16).unwrap();
        let e = q8.with_slot_scale(0, 1, 0.5).unwrap_err();
        assert!(e.to_string().contains("only fp8 slots take a scale"), "{e}");
        assert_eq!(
            q8.with_slot_scale(32, 0, 0.5).unwrap_err(),
            Error::LayerOutOfRange {
                layer: 32,
                n_layers: 32
            }
        );
        // A slot stored as fp8 in a cache of another type takes one too.
        let own = q8
            .with_slot_dtype("v", DType::F8E4M3)
            .and_then(|s| s.with_slot_scale(0, 1, 4.0))
            .unwrap();
        assert_eq!(own.slot_scale(0, 1).unwrap(), Some(4.0));
    }

    #[test]
    fn slot_over_the_binding_limit_names_the_capacity_that_fits() {
        // K of 8 x 128 f32 is 4 KiB a row: 128 MiB holds exactly 32768 rows.
        let spec = CacheSpec::llama3_8b(DType::F32, 40_000).unwrap();
        let err = spec
            .check_limits(&DeviceLimits::WEBGPU_DEFAULT)
            .unwrap_err();
        assert_eq!(
            err,
            Error::SlotTooLarge {
                layer: 0,
                slot: 0,
                bytes: 4096 * 40_000,
                row_bytes: 4096,
                capacity: 40_000,
                limit: 128 << 20,
                max_capacity: 32_768,
            }
        );
        assert!(err.to_string().contains("134217728") && err.to_string().contains("32768"));
        assert_eq!(spec.max_capacity_for(&DeviceLimits::WEBGPU_DEFAULT), 32_768);
        CacheSpec::llama3_8b(DType::F32, 32_768)
            .unwrap()
            .check_limits(&DeviceLimits::WEBGPU_DEFAULT)
            .unwrap();
    }

    /// Vulkan and DX12 report a binding limit of 2^31 - 1 bytes; a slot buffer is whole 16-byte
    /// vectors, so a slot of 2^31 - 4 bytes (which would become 2^31) is refused, and the capacity
    /// named fits once rounded.
    #[test]
    fn a_limit_that_is_not_whole_vectors_is_rounded_down() {
        let odd = DeviceLimits {
            max_storage_buffer_binding_size: (1 << 31) - 1,
            max_buffer_size: u64::MAX,
        };
        assert_eq!(odd.max_slot_bytes(), (1 << 31) - 16);
        let layer = LayerSpec::new(vec![SlotSpec::new("s", &[1])]);
        let spec = CacheSpec::new(vec![layer.clone()], DType::F32, (1 << 29) - 1).unwrap();
        let err = spec.check_limits(&odd).unwrap_err();
        assert!(
            matches!(err, Error::SlotTooLarge { limit, max_capacity, .. }
                if limit == (1 << 31) - 16 && max_capacity == (1 << 29) - 4),
            "{err:?}"
        );
        assert_eq!(spec.max_capacity_for(&odd), (1 << 29) - 4);
        let fits = CacheSpec::new(vec![layer], DType::F32, (1 << 29) - 4).unwrap();
        fits.check_limits(&odd).unwrap();
        assert!(fits.total_bytes().next_multiple_of(16) < 1 << 31);
    }

    /// A device that binds and holds more than 4 GiB still gets slots of at most 4 GiB, which its
    /// 32-bit addressing reaches.
    #[test]
    fn slots_stay_within_32_bit_addressing() {
        let huge = DeviceLimits {
            max_storage_buffer_binding_size: 1 << 40,
            max_buffer_size: 1 << 40,
        };
        assert_eq!(huge.max_slot_bytes(), (1 << 32) - 16);
        let layer = LayerSpec::new(vec![SlotSpec::new("s", &[4])]);
        let over = CacheSpec::new(vec![layer.clone()], DType::F32, 1 << 28).unwrap();
        let err = over.check_limits(&huge).unwrap_err();
        assert!(
            matches!(err, Error::SlotTooLarge { limit, max_capacity, .. }
                if limit == (1 << 32) - 16 && max_capacity == (1 << 28) - 1),
            "{err:?}"
        );
        let fits = CacheSpec::new(vec![layer], DType::F32, (1 << 28) - 1).unwrap();
        fits.check_limits(&huge).unwrap();
    }
}
