//! A bind-group cache bounded by entries and by the bytes of the outside buffers its entries keep
//! alive. A cached bind group holds a reference to every buffer it binds, so a cache bounded only by
//! its entry count could keep the memory of many dropped buffers; this one never pins more than
//! `max_bytes` of them (a bind group that alone would is built but not kept). The value may also be a
//! plain marker, for facts about a buffer worth remembering (it belongs to this device).

use std::collections::{HashMap, HashSet};
use std::hash::Hash;

#[derive(Debug)]
pub(crate) struct GroupCache<K, V = wgpu::BindGroup> {
    entries: HashMap<K, V>,
    pinned: HashSet<wgpu::Buffer>,
    pinned_bytes: u64,
    max_entries: usize,
    max_bytes: u64,
}

impl<K: Hash + Eq, V: Clone> GroupCache<K, V> {
    pub(crate) fn new(max_entries: usize, max_bytes: u64) -> Self {
        Self {
            entries: HashMap::new(),
            pinned: HashSet::new(),
            pinned_bytes: 0,
            max_entries,
            max_bytes,
        }
    }

    /// The cached group of `key`, if any.
    pub(crate) fn get(&self, key: &K) -> Option<V> {
        self.entries.get(key).cloned()
    }

    /// Keeps `group` under `key` when it fits the bounds, after emptying the cache if need be (a
    /// group whose buffers alone pass `max_bytes` is not kept). `pins` are the outside buffers the
    /// group binds.
    pub(crate) fn keep(&mut self, key: K, pins: &[&wgpu::Buffer], group: V) {
        // The distinct outside buffers the group binds: all their bytes, and those not pinned yet.
        let mut distinct: Vec<&wgpu::Buffer> = Vec::with_capacity(pins.len());
        for b in pins {
            if !distinct.contains(b) {
                distinct.push(b);
            }
        }
        if distinct.iter().map(|b| b.size()).sum::<u64>() > self.max_bytes {
            return;
        }
        let added: u64 = distinct
            .iter()
            .filter(|b| !self.pinned.contains(**b))
            .map(|b| b.size())
            .sum();
        if self.entries.len() >= self.max_entries || self.pinned_bytes + added > self.max_bytes {
            self.clear();
        }
        for b in distinct {
            if self.pinned.insert(b.clone()) {
                self.pinned_bytes += b.size();
            }
        }
        self.entries.insert(key, group);
    }

    /// Moves every cached group out into the cache returned, leaving this one empty (same bounds).
    pub(crate) fn take(&mut self) -> Self {
        let empty = Self::new(self.max_entries, self.max_bytes);
        std::mem::replace(self, empty)
    }

    /// Drops every cached group (and with them the references they hold).
    pub(crate) fn clear(&mut self) {
        self.entries.clear();
        self.pinned.clear();
        self.pinned_bytes = 0;
    }
}
