//! The index's configuration: memory cap and the shared wrapper's catch-up rate.

/// Largest accepted [`IndexConfig::max_entries`]: eviction stamps are 32-bit and must not wrap
/// inside one cap's worth of stores.
pub const MAX_ENTRIES_LIMIT: usize = 1 << 31;

/// Largest accepted [`IndexConfig::write_chunk_events`] (2^20: a catch-up of 8 Mi view ops per
/// write is already far beyond any useful setting), so `8 ×` it never overflows.
pub const WRITE_CHUNK_EVENTS_LIMIT: usize = 1 << 20;

/// How a [`crate::RadixIndex`] (and a [`crate::SharedIndex`]) behaves. Build with
/// `IndexConfig::default()` and override fields; check with [`IndexConfig::validate`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IndexConfig {
    /// Maximum resident (block, worker, dp rank) entries. `None` (the default): no cap.
    ///
    /// When a store would exceed the cap, the index evicts the entry that was stored (or
    /// re-stored) longest ago, whichever worker holds it, until it is back at the cap. An
    /// evicted entry is dropped as if its worker had sent `Removed` for it in every tier; it is
    /// counted in `IndexStats::anomalies.evicted_entries`. Allowed: 1 to [`MAX_ENTRIES_LIMIT`].
    pub max_entries: Option<usize>,
    /// How fast a [`crate::SharedIndex`] view that was pinned for a snapshot catches up: each
    /// write also replays at most 8 × this many of the changes (view ops) it missed, or twice
    /// the write's own if more, so the catch-up never stalls the writer for long (unit: 8 ops;
    /// default 64, i.e. 512 ops per write; 1 to [`WRITE_CHUNK_EVENTS_LIMIT`]).
    pub write_chunk_events: usize,
}

impl Default for IndexConfig {
    fn default() -> Self {
        Self {
            max_entries: None,
            write_chunk_events: 64,
        }
    }
}

/// A configuration value outside its allowed range.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error("max_entries must be between 1 and {MAX_ENTRIES_LIMIT}, got {value}")]
    MaxEntries { value: usize },
    #[error("write_chunk_events must be between 1 and {WRITE_CHUNK_EVENTS_LIMIT}")]
    WriteChunk,
}

impl IndexConfig {
    /// Checks every field against its documented range.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if let Some(value) = self.max_entries
            && (value == 0 || value > MAX_ENTRIES_LIMIT)
        {
            return Err(ConfigError::MaxEntries { value });
        }
        if self.write_chunk_events == 0 || self.write_chunk_events > WRITE_CHUNK_EVENTS_LIMIT {
            return Err(ConfigError::WriteChunk);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_is_valid_and_bounds_are_checked() {
        assert_eq!(IndexConfig::default().validate(), Ok(()));
        let zero = IndexConfig {
            max_entries: Some(0),
            ..IndexConfig::default()
        };
        assert_eq!(zero.validate(), Err(ConfigError::MaxEntries { value: 0 }));
        let chunk = IndexConfig {
            write_chunk_events: 0,
            ..IndexConfig::default()
        };
        assert_eq!(chunk.validate(), Err(ConfigError::WriteChunk));
        // Found by the index_snapshot fuzz target: a snapshot naming a huge chunk overflowed
        // the shared index's `8 ×` on restore.
        for huge in [WRITE_CHUNK_EVENTS_LIMIT + 1, usize::MAX] {
            let chunk = IndexConfig {
                write_chunk_events: huge,
                ..IndexConfig::default()
            };
            assert_eq!(chunk.validate(), Err(ConfigError::WriteChunk));
        }
        let largest = IndexConfig {
            write_chunk_events: WRITE_CHUNK_EVENTS_LIMIT,
            ..IndexConfig::default()
        };
        assert_eq!(largest.validate(), Ok(()));
    }
}
