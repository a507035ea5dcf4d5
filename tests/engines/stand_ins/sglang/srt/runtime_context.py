"""Stand-in for sglang.srt.runtime_context: `get_parallel()` answers this process's ranks.

SGLang's ParallelContext reads ranks stamped by its launcher; here the driver sets them with
`set_parallel` (not an SGLang function) before creating each rank's publisher.
"""

from dataclasses import dataclass
from typing import Optional


@dataclass
class ParallelContext:
    pp_rank: int = 0
    attn_tp_rank: int = 0
    attn_cp_rank: int = 0
    attn_dp_size: int = 1
    attn_dp_rank: int = 0
    dp_rank: Optional[int] = None


_PARALLEL = ParallelContext()


def get_parallel() -> ParallelContext:
    return _PARALLEL


def set_parallel(**ranks) -> None:
    global _PARALLEL
    _PARALLEL = ParallelContext(**ranks)
