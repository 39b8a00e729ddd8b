//! kvgpu keeps the KV / latent cache of LLM inference on the GPU.
pub mod attention;
pub mod cache;
pub mod device;
pub mod error;
pub mod kernels;
pub mod ledger;
pub mod reference;
pub mod spec;

pub use attention::{Attention, AttentionOptions, MlaQueries, Queries};
pub use cache::{GpuSlab, HostData, HostSlab, KvCache, SlotView};
pub use device::Gpu;
pub use error::{Error, Result};
pub use kernels::{Kernels, PARAM_RING_ENTRIES};
pub use ledger::{AppendPlan, DroppedRows, Ledger};
pub use spec::{CacheSpec, DType, DeviceLimits, LayerSpec, SlotSpec};
