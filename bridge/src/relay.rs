//! One engine's event path: the ZMQ subscriber threads of its ranks → decode → sequence check
//! (replay on a gap) → mirror → kvroute's `EventPublisher`. Also the engine's resync source.
//!
//! (Interface fixed; implementation in progress.)

use std::sync::Arc;

use kvroute_common::DpRank;
use kvroute_common::worker::{EventPublisher, ResyncSource};

use crate::config::EngineSpec;
use crate::metrics::BridgeMetrics;

/// Settings of a [`Relay`].
#[derive(Debug, Clone)]
pub struct RelaySettings {
    /// Most blocks one rank's mirror holds.
    pub mirror_max_blocks: usize,
}

/// A running relay for one engine. Events are received and mirrored from [`Relay::start`] on;
/// they reach kvroute only while a publisher is attached.
#[derive(Debug, Clone)]
pub struct Relay {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    #[allow(dead_code)]
    label: String,
}

impl Relay {
    /// Starts the subscriber threads of `ranks`.
    pub fn start(
        spec: &EngineSpec,
        ranks: Vec<DpRank>,
        settings: RelaySettings,
        metrics: Arc<BridgeMetrics>,
    ) -> anyhow::Result<Self> {
        let _ = (ranks, settings, metrics);
        Ok(Self {
            inner: Arc::new(Inner {
                label: spec.label(),
            }),
        })
    }

    /// What answers kvroute's resync requests for this engine (hand it to `WorkerAgent::start`).
    pub fn resync_source(&self) -> Arc<dyn ResyncSource> {
        Arc::new(self.clone())
    }

    /// Publishes through `publisher` from now on. Call right after `WorkerAgent::start` (which
    /// published `Cleared` for every rank): the relay first publishes the mirror's chains, so
    /// what the engine stored before registration is not lost.
    pub fn attach(&self, publisher: EventPublisher) {
        let _ = publisher;
    }

    /// Stops publishing (the engine is being deregistered); events are still mirrored.
    pub fn detach(&self) {}

    /// The engine restarted (its `/health` failed and recovered): its cache is empty, so the
    /// mirror is cleared and the next `seq` may start anywhere.
    pub fn new_incarnation(&self) {}

    /// Blocks mirrored over every rank.
    pub fn mirror_blocks(&self) -> usize {
        0
    }

    /// Stops the subscriber threads.
    pub fn shutdown(&self) {}
}

impl ResyncSource for Relay {
    fn resync(&self, publisher: &EventPublisher) {
        let _ = publisher;
    }
}
