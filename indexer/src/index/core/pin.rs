//! Copying the pairs' maps for a snapshot while the writer goes on. The tree part of a snapshot
//! is a pinned view (`shared.rs`); the maps exist once, on the writer's side, so a pin makes
//! the writer copy each map before its first change from then on, and the snapshot's thread
//! copies the rest a bounded amount at a time (`copy_pending`, under the writer's lock). The
//! copies then hold every map as it was at the pin, and the writer never waits for more than
//! one map's copy (a `memcpy` of its table).

use std::sync::{Arc, Mutex, MutexGuard};

use super::Core;
use crate::index::blockmap::BlockMap;
use crate::index::view::Slot;

/// The maps of every pair as of a pin, by slot (`None`: no pair in that slot then).
#[derive(Debug, Default)]
pub(crate) struct PinMaps {
    maps: Mutex<Vec<Option<BlockMap>>>,
}

impl PinMaps {
    pub fn lock(&self) -> MutexGuard<'_, Vec<Option<BlockMap>>> {
        self.maps.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[derive(Debug, Clone)]
pub(crate) struct PinState {
    maps: Arc<PinMaps>,
    /// Pairs whose map is not copied yet.
    pending: Vec<bool>,
    left: usize,
    /// Where `copy_pending` goes on from.
    next: usize,
}

impl Core {
    /// Starts copying every pair's map as it is now (see the module docs).
    pub fn start_pin(&mut self) -> Arc<PinMaps> {
        let pending: Vec<bool> = self.pairs.iter().map(Option::is_some).collect();
        let left = pending.iter().filter(|&&p| p).count();
        let maps = Arc::new(PinMaps {
            maps: Mutex::new(vec![None; self.pairs.len()]),
        });
        self.pin = Some(PinState {
            maps: maps.clone(),
            pending,
            left,
            next: 0,
        });
        maps
    }

    /// Stops copying for the pin that owns `maps` (a later pin has its own).
    pub fn end_pin(&mut self, maps: &Arc<PinMaps>) {
        if self
            .pin
            .as_ref()
            .is_some_and(|p| Arc::ptr_eq(&p.maps, maps))
        {
            self.pin = None;
        }
    }

    /// Called before any change to `slot`'s map (or its removal).
    #[inline]
    pub(super) fn before_map_change(&mut self, slot: Slot) {
        if let Some(pin) = &mut self.pin
            && pin.pending.get(slot as usize).copied().unwrap_or(false)
        {
            copy_one(pin, &self.pairs, slot as usize);
        }
    }

    /// Copies pending maps worth about `budget` entries; true when every map is copied.
    pub fn copy_pending(&mut self, budget: usize) -> bool {
        let Some(pin) = &mut self.pin else {
            return true;
        };
        let mut spent = 0;
        while pin.left > 0 && spent < budget {
            let slot = pin.next;
            pin.next += 1;
            if pin.pending[slot] {
                spent += copy_one(pin, &self.pairs, slot).max(1);
            }
        }
        pin.left == 0
    }
}

fn copy_one(pin: &mut PinState, pairs: &[Option<super::Pair>], slot: usize) -> usize {
    pin.pending[slot] = false;
    pin.left -= 1;
    let map = pairs[slot]
        .as_ref()
        .expect("a pending pair is in use")
        .map
        .clone();
    let n = map.len();
    pin.maps.lock()[slot] = Some(map);
    n
}
