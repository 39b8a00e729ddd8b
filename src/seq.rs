//! Sequence ids: the one name a sequence has in a cache, its plans and its errors.

use std::sync::atomic::{AtomicU32, Ordering};

/// A sequence of a cache. A [`crate::KvCache`] holds one, [`SeqId::FIRST`]; a [`crate::PagedCache`]
/// holds many, each named by the id `add_sequence` or `fork` returned (ids are never reused).
///
/// An id carries the pool that handed it out: given to another pool, it is refused with
/// [`crate::Error::ForeignSequence`] instead of naming that pool's sequence of the same number.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeqId {
    /// The pool's tag ([`pool_tag`]; 0 for the sequence of a single-sequence cache).
    pub(crate) pool: u32,
    /// The sequence's number within its pool, in creation order.
    pub(crate) n: u32,
}

impl SeqId {
    /// The one sequence of a single-sequence cache.
    pub const FIRST: SeqId = SeqId { pool: 0, n: 0 };
}

/// `sequence 3 of pool 7`: errors name the pool too, so that an id given to another pool reads as
/// what it is. The sequence of a single-sequence cache is `sequence 0`.
impl std::fmt::Display for SeqId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.pool {
            0 => write!(f, "sequence {}", self.n),
            pool => write!(f, "sequence {} of pool {pool}", self.n),
        }
    }
}

/// A tag for a new pool, never 0 (the single-sequence caches' tag) and distinct from every other
/// pool's of this process until 2<sup>32</sup> - 1 pools have been made.
pub(crate) fn pool_tag() -> u32 {
    static NEXT: AtomicU32 = AtomicU32::new(1);
    loop {
        let tag = NEXT.fetch_add(1, Ordering::Relaxed);
        if tag != 0 {
            return tag;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_id_names_its_pool() {
        assert_eq!(SeqId::FIRST.to_string(), "sequence 0");
        assert_eq!(SeqId { pool: 7, n: 3 }.to_string(), "sequence 3 of pool 7");
    }
}
