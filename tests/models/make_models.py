#!/usr/bin/env python3
"""Writes the small test models of tests/models/: one byte-level BPE tokenizer trained on a
corpus written below, and per model a tokenizer.json + tokenizer_config.json (+ chat_template.jinja).

    python3 tests/models/make_models.py [OUT_DIR]     # default: the folder of this script

The output is byte-identical on every run (the `text` crate's parity test checks it), so the
committed folders are what this script writes. Needs the `tokenizers` package only
(tests/models/requirements.txt).

Models (each exercises a different way tokenizer_config.json is written):
  chatml/  Qwen3-like ChatML; chat_template as a list of named templates (default, tool_use);
           NFC normalizer, a Split pre-tokenizer with a look-ahead regex; no BOS.
  llama3/  Llama-3.1-like; bos/eos as AddedToken objects; chat_template as a string; the
           post-processor adds <|begin_of_text|>; BPE with ignore_merges.
  parts/   Gemma-3-like, content as a string or a list of parts; chat_template.jinja beside the
           config; the GPT-2 ByteLevel regex; additional_special_tokens, a model-specific boi_token.
"""

import json
import sys
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
from tokenizers import pre_tokenizers, processors, trainers

HERE = Path(__file__).resolve().parent
TEMPLATES = HERE / "templates"
VOCAB_SIZE = 3000

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|python_tag|>",
    "<bos>",
    "<eos>",
    "<pad>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<start_of_image>",
]
# Added but not special, like Qwen's: decode(skip_special_tokens=True) keeps them.
PLAIN_ADDED_TOKENS = ["<tool_call>", "</tool_call>", "<think>", "</think>"]

# Llama 3's pre-tokenizer pattern (look-ahead `\s+(?!\S)`: needs fancy-regex or onig).
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

PROSE = """\
A router decides which worker serves a prompt. It looks at two facts: which worker already
holds the longest prefix of the prompt's KV-cache blocks, and how busy every worker is.
The index is a radix tree of block hashes; each node remembers the workers that hold it.
When a worker stores a block it publishes an event, and every indexer applies the events in
the same order, so every replica of the index holds the same state.
Sessions keep a conversation on the worker that already holds its history.
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs!
How vexingly quick daft zebras jump; the five boxing wizards jump quickly.
What's the weather like in Paris today? It's sunny, 21 degrees, with a light breeze.
I'd like to book a table for two at 7:30 pm, please. We'll be there on time; they've said so.
You are a helpful assistant. Answer the user's questions truthfully and concisely.
Please summarize the following document in three bullet points.
Translate to French: "Where is the train station?" -> « Où est la gare ? »
Übersetze ins Deutsche: Die Straße ist naß, und die Bäume grünen. Größe, Maß, Fußgänger.
日本語のテキストも少し含めます。東京は日本の首都です。キャッシュとルーター。
中文文本：路由器根据缓存选择工作节点。你好，世界！
Emoji are bytes too: 🚀 🎉 👍🏽 ❤️ 🧪 — and so are dashes – and quotes “like these”.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 256 1024 4096 65536 3.14159 2.71828 -17 1e-5.
"""

CODE = """\
fn main() {
    let blocks: Vec<u64> = prompt.chunks(16).map(|c| hash(c)).collect();
    for (i, block) in blocks.iter().enumerate() {
        println!("{i}: {block:#x}");
    }
}
def render(messages, tools=None, add_generation_prompt=True):
    return template.render(messages=messages, tools=tools)
SELECT worker_id, COUNT(*) FROM blocks WHERE tier = 'device' GROUP BY worker_id;
{"type": "function", "function": {"name": "get_weather", "description": "Get the current weather",
 "parameters": {"type": "object", "properties": {"location": {"type": "string"},
 "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["location"]}}}
<tool_call>
{"name": "get_weather", "arguments": {"location": "Paris", "unit": "celsius"}}
</tool_call>
"""

ROLES = ["system", "user", "assistant", "tool"]
WORDS = (
    "cache prefix block worker router index event session token prompt model engine "
    "request reply load queue shard replica snapshot digest stream lease weather city "
    "time date function arguments result error message content system user assistant"
).split()


def corpus() -> list[str]:
    """The training text: fixed prose and code, plus chat-shaped lines built by rule."""
    lines = PROSE.splitlines() + CODE.splitlines()
    for i in range(400):
        role = ROLES[i % len(ROLES)]
        a, b, c = WORDS[i % len(WORDS)], WORDS[(i * 7) % len(WORDS)], WORDS[(i * 13) % len(WORDS)]
        lines.append(f"<|im_start|>{role}\nThe {a} of the {b} holds {i} {c}s.<|im_end|>")
        lines.append(f"{role}: {a.capitalize()} {b}, {c}? {i * 37 % 1000}")
    return lines * 3


def train() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        show_progress=False,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in PLAIN_ADDED_TOKENS])
    tok.decoder = decoders.ByteLevel()
    return tok


def variant(base: Tokenizer, name: str) -> str:
    """The trained tokenizer with the model's own normalizer, pre-tokenizer and post-processor."""
    tok = Tokenizer.from_str(base.to_str())
    split = pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)
    if name == "chatml":
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    elif name == "llama3":
        tok.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
        bos = "<|begin_of_text|>"
        tok.post_processor = processors.Sequence(
            [
                processors.ByteLevel(trim_offsets=False),
                processors.TemplateProcessing(
                    single=f"{bos}:0 $A:0",
                    pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
                    special_tokens=[(bos, tok.token_to_id(bos))],
                ),
            ]
        )
    elif name == "parts":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.post_processor = processors.TemplateProcessing(
            single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", tok.token_to_id("<bos>"))]
        )
    else:
        raise ValueError(name)
    data = json.loads(tok.to_str())
    if name == "llama3":
        data["model"]["ignore_merges"] = True
    return json.dumps(data, ensure_ascii=False, separators=(",", ":")) + "\n"


def added_token(content: str) -> dict:
    return {
        "__type": "AddedToken",
        "content": content,
        "lstrip": False,
        "normalized": False,
        "rstrip": False,
        "single_word": False,
        "special": True,
    }


def configs() -> dict[str, tuple[dict, str | None]]:
    """Per model: tokenizer_config.json's content, and a chat_template.jinja (or None)."""
    chatml = (TEMPLATES / "chatml.jinja").read_text()
    tool_use = chatml.replace("# Tools\\n\\n", "# Tools (tool_use template)\\n\\n")
    assert tool_use != chatml
    llama3 = (TEMPLATES / "llama3.jinja").read_text()
    parts = (TEMPLATES / "parts.jinja").read_text()
    base = {"clean_up_tokenization_spaces": False, "model_max_length": 32768}
    return {
        "chatml": (
            {
                **base,
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": None,
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "unk_token": None,
                "chat_template": [
                    {"name": "default", "template": chatml},
                    {"name": "tool_use", "template": tool_use},
                ],
            },
            None,
        ),
        "llama3": (
            {
                **base,
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": added_token("<|begin_of_text|>"),
                "eos_token": added_token("<|eot_id|>"),
                "chat_template": llama3,
            },
            None,
        ),
        "parts": (
            {
                **base,
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<bos>",
                "eos_token": "<eos>",
                "pad_token": "<pad>",
                "boi_token": "<start_of_image>",
                "additional_special_tokens": ["<start_of_turn>", "<end_of_turn>", "<start_of_image>"],
            },
            parts,
        ),
    }


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else HERE
    base = train()
    for name, (config, jinja) in configs().items():
        folder = out / name
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "tokenizer.json").write_text(variant(base, name), encoding="utf-8")
        text = json.dumps(config, ensure_ascii=False, indent=2) + "\n"
        (folder / "tokenizer_config.json").write_text(text, encoding="utf-8")
        if jinja is not None:
            (folder / "chat_template.jinja").write_text(jinja, encoding="utf-8")
    print(f"wrote {', '.join(configs())} into {out}")


if __name__ == "__main__":
    main()
