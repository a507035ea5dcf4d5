"""Stand-in for vllm.config.utils: only `config`, the decorator the wheel's
vllm/config/kv_events.py uses (a pydantic dataclass that forbids extra fields, as vLLM's)."""

from typing import Any

from pydantic import ConfigDict
from pydantic.dataclasses import dataclass


def config(cls: Any = None, *, config: ConfigDict | None = None, **kwargs: Any) -> Any:
    merged = ConfigDict(extra="forbid")
    if config is not None:
        merged.update(config)

    def decorator(cls: Any) -> Any:
        return dataclass(cls, config=merged, **kwargs)

    return decorator if cls is None else decorator(cls)
