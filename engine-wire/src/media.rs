//! The engines' storage media (an event's `medium`) and `locality`, and the kvroute storage
//! tier each means (PROTOCOL.md, "Media → tiers").

use kvroute_common::messages::StorageTier;

use crate::EngineKind;

pub const GPU: &str = "GPU";
/// vLLM's host (CPU offload) medium.
pub const CPU: &str = "CPU";
/// SGLang's host medium.
pub const CPU_PINNED: &str = "CPU_PINNED";
/// vLLM's disk and network-backed offload media.
pub const STORAGE: &str = "STORAGE";
/// SGLang's disk medium.
pub const DISK: &str = "DISK";
/// SGLang's L4 "shared / remote pool" (e.g. Mooncake).
pub const EXTERNAL: &str = "EXTERNAL";
/// The `locality` of vLLM's network-backed offload tiers: a pool every engine can load from.
pub const REMOTE: &str = "REMOTE";

/// Whether a `locality` says the blocks are in a remote pool (any case).
pub fn is_remote(locality: Option<&str>) -> bool {
    locality.is_some_and(|l| l.eq_ignore_ascii_case(REMOTE))
}

/// The tier a medium means (`None`: GPU) under a `locality`, or why it is not indexed.
pub fn tier_of(medium: Option<&str>, locality: Option<&str>) -> Result<StorageTier, &'static str> {
    if is_remote(locality) {
        return Ok(StorageTier::Shared);
    }
    let Some(m) = medium else {
        return Ok(StorageTier::Device);
    };
    match m.to_ascii_uppercase().as_str() {
        GPU | "DEVICE" | "HBM" => Ok(StorageTier::Device),
        CPU | CPU_PINNED | "CPU_TIER1" => Ok(StorageTier::Host),
        STORAGE | DISK | "CPU_TIER2" | "NVME" => Ok(StorageTier::Disk),
        EXTERNAL => Ok(StorageTier::Shared),
        _ => Err("unknown_medium"),
    }
}

/// Engine `kind`'s `medium` string for blocks of `tier`. vLLM has no shared medium: its
/// network-backed offload tiers say `STORAGE` with `locality: "REMOTE"` ([`remote_locality`]).
pub fn medium_of(kind: EngineKind, tier: StorageTier) -> &'static str {
    match (tier, kind) {
        (StorageTier::Device, _) => GPU,
        (StorageTier::Host, EngineKind::Vllm) => CPU,
        (StorageTier::Host, EngineKind::Sglang) => CPU_PINNED,
        (StorageTier::Disk | StorageTier::Shared, EngineKind::Vllm) => STORAGE,
        (StorageTier::Disk, EngineKind::Sglang) => DISK,
        (StorageTier::Shared, EngineKind::Sglang) => EXTERNAL,
    }
}

/// Whether engine `kind`'s events for blocks of `tier` carry `locality: "REMOTE"`.
pub fn remote_locality(kind: EngineKind, tier: StorageTier) -> bool {
    tier == StorageTier::Shared && kind == EngineKind::Vllm
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_tier_written_reads_back_as_itself() {
        for kind in [EngineKind::Vllm, EngineKind::Sglang] {
            for tier in [
                StorageTier::Device,
                StorageTier::Host,
                StorageTier::Disk,
                StorageTier::Shared,
            ] {
                let locality = remote_locality(kind, tier).then_some(REMOTE);
                assert_eq!(
                    tier_of(Some(medium_of(kind, tier)), locality),
                    Ok(tier),
                    "{kind} {tier:?}"
                );
            }
        }
        assert_eq!(tier_of(None, None), Ok(StorageTier::Device));
        assert_eq!(
            tier_of(Some("gpu"), Some("remote")),
            Ok(StorageTier::Shared)
        );
        assert_eq!(tier_of(Some("TAPE"), None), Err("unknown_medium"));
    }
}
