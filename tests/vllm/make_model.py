#!/usr/bin/env python3
"""Writes the real-engine tests' model: a tiny random-weight Llama (seeded) with a tokenizer and
chat template taken from TOKENIZER_DIR (tests/models/chatml). No weights are downloaded.

    python make_model.py TOKENIZER_DIR OUT_DIR

Run with the venv of scripts/install-vllm (torch and transformers at vLLM's pins). 2 layers,
hidden 256, 4 attention heads over 2 KV heads, bfloat16: about 4 MB, and a vLLM engine on one
CPU core serves it in milliseconds per token; what it writes is noise, which the tests ignore.
"""

import shutil
import sys
from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

SEED = 20260


def main() -> None:
    tokenizer_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    # The tokenizer's own files, as committed (their chat template included).
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tokenizer_dir / name, out / name)
    print(f"make_model: {out}: vocabulary {config.vocab_size}, "
          f"{sum(p.numel() for p in model.parameters())} parameters", file=sys.stderr)


if __name__ == "__main__":
    main()
