//! The command-line pieces the native examples share (decode, serve, handoff): bounded counts, the
//! model presets with their query heads, and the storage types (of the cache, and of slots stored in
//! their own). Each example includes this file with
//! `#[path = "shared/cli.rs"] mod cli;`.

use clap::ValueEnum;
use kvgpu::DType;

/// A count from 1 to `max`; anything else (negative, zero, too large, not a number) is refused with
/// the bounds, never wrapped.
pub fn count(s: &str, max: usize) -> Result<usize, String> {
    match s.trim().parse::<i128>() {
        Ok(n) if n >= 1 && n <= max as i128 => Ok(n as usize),
        _ => Err(format!("expected a whole number from 1 to {max}")),
    }
}

/// The model presets of [`kvgpu::CacheSpec::preset`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Model {
    /// 32 layers, GQA: 32 query heads over 8 KV heads of 128
    #[value(name = "llama3-8b")]
    Llama3_8b,
    /// 28 layers, GQA: 16 query heads over 8 KV heads of 128
    #[value(name = "qwen3-0.6b")]
    Qwen3_0_6b,
    /// 27 layers, MLA: 16 heads over latents of 512 + rope 64
    #[value(name = "deepseek-v2-lite")]
    DeepseekV2Lite,
    /// 24 layers, every fourth with GQA (16 query heads over 2 KV heads of 256), the rest cache-free
    #[value(name = "hybrid")]
    Hybrid,
}

impl Model {
    pub fn name(self) -> &'static str {
        match self {
            Model::Llama3_8b => "llama3-8b",
            Model::Qwen3_0_6b => "qwen3-0.6b",
            Model::DeepseekV2Lite => "deepseek-v2-lite",
            Model::Hybrid => "hybrid",
        }
    }
}

/// The cache's storage type.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Storage {
    F32,
    F16,
    Bf16,
    /// blocks of 32: an f16 scale and 8-bit values (1.0625 bytes per element)
    #[value(name = "q8_0")]
    Q8_0,
    /// blocks of 32: an f16 scale and 4-bit values (0.5625 bytes per element)
    #[value(name = "q4_0")]
    Q4_0,
    /// 8-bit float e4m3 (1 byte per element)
    Fp8,
    /// 8-bit float e5m2 (1 byte per element; wider range, one mantissa bit less)
    #[value(name = "fp8_e5m2")]
    Fp8E5m2,
}

impl From<Storage> for DType {
    fn from(s: Storage) -> Self {
        match s {
            Storage::F32 => DType::F32,
            Storage::F16 => DType::F16,
            Storage::Bf16 => DType::BF16,
            Storage::Q8_0 => DType::Q8_0,
            Storage::Q4_0 => DType::Q4_0,
            Storage::Fp8 => DType::F8E4M3,
            Storage::Fp8E5m2 => DType::F8E5M2,
        }
    }
}

/// One slot stored in its own type (`--slot-dtype v=q4_0`): keys and values of different types.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SlotStorage {
    pub slot: String,
    pub dtype: Storage,
}

/// Parses `SLOT=TYPE`, the type as `--dtype` takes it.
pub fn slot_storage(s: &str) -> Result<SlotStorage, String> {
    let Some((slot, dtype)) = s.split_once('=') else {
        return Err("expected SLOT=TYPE, such as v=q4_0".into());
    };
    let slot = slot.trim();
    if slot.is_empty() {
        return Err("the slot's name is empty: expected SLOT=TYPE, such as v=q4_0".into());
    }
    let dtype = Storage::from_str(dtype.trim(), true)?;
    Ok(SlotStorage {
        slot: slot.to_string(),
        dtype,
    })
}

/// `spec` with each of `slots` stored in its own type.
pub fn with_slot_storage(
    mut spec: kvgpu::CacheSpec,
    slots: &[SlotStorage],
) -> kvgpu::Result<kvgpu::CacheSpec> {
    for s in slots {
        spec = spec.with_slot_dtype(&s.slot, s.dtype.into())?;
    }
    Ok(spec)
}

/// The storage types of a spec in words: `q8_0`, or `q8_0 (v: q4_0)` when slots have their own.
pub fn describe_storage(spec: &kvgpu::CacheSpec) -> String {
    let mut own: Vec<String> = Vec::new();
    for layer in spec.layers() {
        for slot in &layer.slots {
            if slot.dtype.is_some() || slot.scale.is_some() {
                let dtype = slot.dtype.unwrap_or(spec.dtype());
                let scale = slot.scale.map_or(String::new(), |s| format!(" x {s}"));
                let said = format!("{}: {dtype}{scale}", slot.name);
                if !own.contains(&said) {
                    own.push(said);
                }
            }
        }
    }
    if own.is_empty() {
        spec.dtype().to_string()
    } else {
        format!("{} ({})", spec.dtype(), own.join(", "))
    }
}

/// Query heads per layer of each preset, and MLA's softmax scale (DeepSeek-V2-Lite: 1/sqrt(128 + 64)).
pub fn query_heads(model: Model) -> (usize, Option<f32>) {
    match model {
        Model::Llama3_8b => (32, None),
        Model::Qwen3_0_6b | Model::Hybrid => (16, None),
        Model::DeepseekV2Lite => (16, Some(1.0 / 192f32.sqrt())),
    }
}
