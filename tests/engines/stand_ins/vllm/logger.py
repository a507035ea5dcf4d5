"""Stand-in for vllm.logger: plain `logging` loggers (vLLM's adds formatting and *_once)."""

import logging


def init_logger(name: str) -> logging.Logger:
    return logging.getLogger(name)
