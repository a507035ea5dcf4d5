"""Stand-in for vllm.v1.core.kv_cache_utils: only the published block-hash type."""

from typing import TypeAlias

# What BlockStored / BlockRemoved carry: vLLM's own hashes are bytes; an int is allowed.
ExternalBlockHash: TypeAlias = bytes | int
