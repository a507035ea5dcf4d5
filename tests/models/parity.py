#!/usr/bin/env python3
"""Renders chat cases the way vLLM renders them, with the real transformers, for the `text`
crate's parity test (text/tests/parity.rs).

    python3 tests/models/parity.py MODEL_DIR CASES_JSON     # prints one JSON list

Each case: {"name", "messages", "tools"?, "add_generation_prompt"? (default true),
"continue_final_message"? (false), "kwargs"? (chat_template_kwargs), "template"? (a template
instead of the model's), "completion"? (a prompt encoded with special tokens), "decode"? (ids)}.
Each result: {"name", "content_format", "text" | "error" + "error_kind" ("raise": the template's
raise_exception, else "other"), "ids" (apply_chat_template(tokenize=True)), "ids_via_text"
(encode(text, add_special_tokens=False)), "completion_ids", "decoded"}.

vLLM's own functions (message parsing, content-format detection, developer-role handling,
template kwargs filtering) are loaded from the vLLM wheel's source that scripts/install-deps
extracts into .tools/engines/vllm, so the reference is the engine's code, not a copy of it.
vLLM's request models for tools are mirrored below with pydantic (their fields and serializers).
"""

import ast
import functools
import inspect
import json
import logging
import sys
from collections import deque
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.sandbox
import transformers
import transformers.utils.chat_template_utils as hf_chat_utils
from pydantic import BaseModel, ConfigDict, model_serializer
from transformers import AutoTokenizer

logging.disable(logging.WARNING)
ROOT = Path(__file__).resolve().parents[2]
VLLM = ROOT / ".tools/engines/vllm/vllm/renderers"


def load_functions(path: Path, names: set[str], namespace: dict) -> None:
    """Executes the named top-level functions, classes and assignments of a module's source."""
    tree = ast.parse(path.read_text(), filename=str(path))
    body = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in names:
            body.append(node)
        elif isinstance(node, ast.Assign) and any(getattr(t, "id", None) in names for t in node.targets):
            body.append(node)
        elif isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) in names:
            body.append(ast.copy_location(ast.Assign(targets=[node.target], value=node.value), node))
    for node in ast.walk(ast.Module(body=body, type_ignores=[])):
        # Annotations name vLLM's types, which are not loaded.
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            node.returns = None
        elif isinstance(node, ast.arg):
            node.annotation = None
    missing = names - {getattr(n, "name", None) or n.targets[0].id for n in body}
    if missing:
        raise SystemExit(f"{path} lacks {sorted(missing)}: is the pinned vLLM wheel extracted?")
    exec(compile(ast.Module(body=body, type_ignores=[]), str(path), "exec"), namespace)


class VLLMValidationError(ValueError):
    def __init__(self, message, **_):
        super().__init__(message)


class NoMedia:
    """vLLM's multimodal tracker for a text-only model: media parts are refused."""

    model_config = type("ModelConfig", (), {"enable_prompt_embeds": False, "multimodal_config": None})()

    def create_parser(self, **_):
        return self

    def mm_placeholder_storage(self):
        return {}

    def __getattr__(self, name):
        if name.startswith("parse_"):
            def refuse(*_args):
                raise ValueError("media content is not supported by a text-only model")
            return refuse
        raise AttributeError(name)


def identity(value):
    return value


def vllm_namespace() -> dict:
    if not VLLM.is_dir():
        raise SystemExit(f"{VLLM} is missing: run scripts/install-deps")
    ns: dict[str, Any] = {
        "jinja2": jinja2,
        "deque": deque,
        "lru_cache": functools.lru_cache,
        "partial": functools.partial,
        "cast": lambda _type, value: value,
        "json": json,
        "logger": logging.getLogger("vllm"),
        "hf_chat_utils": hf_chat_utils,
        "VLLMValidationError": VLLMValidationError,
        "ConversationMessage": dict,
        "_ContentPart": object,
        "ChatCompletionContentPartParam": object,
        "Any": Any,
        "ChatCompletionContentPartTextParam": dict,
        **{
            name: identity
            for name in [
                "_ImageParser", "_AudioParser", "_VideoParser", "_ResponsesInputImageParser",
                "_ImageEmbedsParser", "_AudioEmbedsParser", "_VideoEmbedsParser",
                "_PromptEmbedsParser", "_InputAudioParser", "_PILImageParser",
            ]
        },
        "_TextParser": identity,
        "_ThinkParser": identity,
        "_RefusalParser": identity,
        "_AssistantParser": identity,
        "_ToolParser": identity,
        "_collect_extra_fields": lambda part: {},  # vLLM keeps unknown part fields; kvroute does not
        "supports_kw": lambda fn, kw, allow_var_kwargs=False: kw in inspect.signature(fn).parameters,
        "PythonBackend": transformers.PythonBackend,
        "inspect": inspect,
        "AssistantTracker": None,
    }
    load_functions(
        VLLM / "chat_utils.py",
        {
            "TEXT_PART_TYPES", "_TEXT_CONTENT_PART_TYPES", "PART_TYPES_TO_SKIP_NONE_CONTENT",
            "_CLAUDE_CODE_BILLING_HEADER", "MM_PARSER_MAP", "MODALITY_PLACEHOLDERS_MAP",
            "_strip_claude_code_billing_header", "_parse_chat_message_content",
            "_parse_chat_message_content_parts", "_parse_chat_message_content_part",
            "_parse_chat_message_content_mm_part", "_reject_reserved_placeholder_in_text",
            "_postprocess_messages",
        },
        ns,
    )
    load_functions(
        VLLM / "hf.py",
        {
            "_is_var_access", "_is_attr_access", "_is_var_or_elems_access",
            "_iter_nodes_assign_var_or_elems", "_iter_nodes_assign_messages_item",
            "_iter_nodes_assign_content_item", "_try_extract_ast", "_detect_content_format",
            "_detect_developer_role_support", "_convert_developer_to_system",
            "_consolidate_system_messages", "AssistantTracker", "_resolve_chat_template_kwargs",
            "_get_hf_base_chat_template_params", "resolve_chat_template_kwargs",
        },
        ns,
    )
    ns["_cached_resolve_chat_template_kwargs"] = functools.lru_cache(ns["_resolve_chat_template_kwargs"])
    return ns


# vLLM's FunctionDefinition and ChatCompletionToolsParam (entrypoints/.../protocol.py).
class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    defer_loading: bool | None = None

    @model_serializer(mode="wrap")
    def _serialize(self, handler):
        data = {k: v for k, v in handler(self).items() if k in type(self).model_fields}
        if self.strict is None:
            data.pop("strict", None)
        if self.defer_loading is None:
            data.pop("defer_loading", None)
        return data


class ChatCompletionToolsParam(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str = "function"
    function: FunctionDefinition
    defer_loading: bool | None = None

    def model_post_init(self, _):
        if self.type != "function":
            raise ValueError("type must be function")
        if self.defer_loading is not None and self.function.defer_loading is None:
            self.function.defer_loading = self.defer_loading

    @model_serializer(mode="wrap")
    def _serialize(self, handler):
        data = {k: v for k, v in handler(self).items() if k in type(self).model_fields}
        if self.defer_loading is None:
            data.pop("defer_loading", None)
        return data


def render(tok, ns: dict, case: dict) -> dict:
    """vLLM's chat path: parse_chat_messages, then safe_apply_chat_template(tokenize=False)."""
    out: dict[str, Any] = {"name": case["name"]}
    tools = case.get("tools")
    tool_dicts = None if tools is None else [ChatCompletionToolsParam(**t).model_dump() for t in tools]
    user_kwargs = dict(case.get("kwargs") or {})
    # ChatParams: the request's own fields override chat_template_kwargs; tools from the request
    # are only defaults (merge_kwargs drops None).
    kwargs = {k: v for k, v in {"tools": tool_dicts, "tokenize": False}.items() if v is not None}
    kwargs.update(user_kwargs)
    kwargs["add_generation_prompt"] = case.get("add_generation_prompt", True)
    kwargs["continue_final_message"] = case.get("continue_final_message", False)
    tools = kwargs.pop("tools", None)
    kwargs.pop("tokenize")
    template = tok.get_chat_template(case.get("template"), tools)
    fmt = ns["_detect_content_format"](template, default="string")
    out["content_format"] = fmt
    try:
        conversation = []
        for message in case["messages"]:
            conversation.extend(ns["_parse_chat_message_content"](message, NoMedia(), fmt, interleave_strings=False))
        ns["_postprocess_messages"](conversation)
        if any(m["role"] == "developer" for m in conversation) and not ns["_detect_developer_role_support"](template):
            conversation = ns["_consolidate_system_messages"](ns["_convert_developer_to_system"](conversation))
        kwargs = ns["resolve_chat_template_kwargs"](tok, template, kwargs)
        args = dict(conversation=conversation, tools=tools, chat_template=template, **kwargs)
        text = tok.apply_chat_template(tokenize=False, **args)
        ids = tok.apply_chat_template(tokenize=True, return_dict=False, **args)
    except jinja2.TemplateError as e:
        out["error"] = str(e)
        out["error_kind"] = "raise" if type(e) is jinja2.TemplateError else "other"
        return out
    except Exception as e:  # noqa: BLE001 — every failure is a result to compare
        out["error"] = f"{type(e).__name__}: {e}"
        out["error_kind"] = "other"
        return out
    out["text"] = text
    out["ids"] = list(ids)
    out["ids_via_text"] = tok.encode(text, add_special_tokens=False)
    return out


def main() -> None:
    model_dir, cases_path = sys.argv[1], sys.argv[2]
    tok = AutoTokenizer.from_pretrained(model_dir)
    ns = vllm_namespace()
    results = []
    for case in json.loads(Path(cases_path).read_text()):
        if "messages" in case:
            result = render(tok, ns, case)
        else:
            result = {"name": case["name"]}
        if "completion" in case:
            result["completion_ids"] = tok.encode(case["completion"])
        if "decode" in case:
            result["decoded"] = tok.decode(case["decode"], skip_special_tokens=True)
        results.append(result)
    json.dump(results, sys.stdout, ensure_ascii=False)


if __name__ == "__main__":
    main()
