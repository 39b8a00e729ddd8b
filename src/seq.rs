//! Sequence ids: the one name a sequence has in a cache, its plans and its errors.

/// A sequence of a cache. A [`crate::KvCache`] holds one, [`SeqId::FIRST`]; a [`crate::PagedCache`]
/// holds many, each named by the id `add_sequence` or `fork` returned (ids are never reused).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeqId(pub(crate) u32);

impl SeqId {
    /// The one sequence of a single-sequence cache.
    pub const FIRST: SeqId = SeqId(0);
}

impl std::fmt::Display for SeqId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "sequence {}", self.0)
    }
}
