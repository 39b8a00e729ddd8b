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

    /// The cached group of `key`, or the one `make` builds: kept when it fits the bounds (after
    /// emptying the cache if need be). `pins` are the outside buffers the group binds.
    pub(crate) fn get_or_try_insert<E>(
        &mut self,
        key: K,
        pins: &[&wgpu::Buffer],
        make: impl FnOnce() -> Result<V, E>,
    ) -> Result<V, E> {
        if let Some(group) = self.entries.get(&key) {
            return Ok(group.clone());
        }
        let group = make()?;
        let new_bytes = |pinned: &HashSet<wgpu::Buffer>| -> u64 {
            let mut seen: Vec<&wgpu::Buffer> = Vec::new();
            pins.iter()
                .filter(|b| {
                    !pinned.contains(**b) && !seen.contains(b) && {
                        seen.push(b);
                        true
                    }
                })
                .map(|b| b.size())
                .sum()
        };
        if new_bytes(&HashSet::new()) > self.max_bytes {
            return Ok(group);
        }
        if self.entries.len() >= self.max_entries
            || self.pinned_bytes + new_bytes(&self.pinned) > self.max_bytes
        {
            self.clear();
        }
        for b in pins {
            if self.pinned.insert((*b).clone()) {
                self.pinned_bytes += b.size();
            }
        }
        self.entries.insert(key, group.clone());
        Ok(group)
    }

    /// Drops every cached group (and with them the references they hold).
    pub(crate) fn clear(&mut self) {
        self.entries.clear();
        self.pinned.clear();
        self.pinned_bytes = 0;
    }
}
