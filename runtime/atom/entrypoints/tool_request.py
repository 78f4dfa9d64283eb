"""A chat request's tools: `tools`, `tool_choice`, `parallel_tool_calls`, checked and rendered.

The model's chat template renders the tools when it knows them (a Jinja `tools` variable, as
Qwen's, Hermes' and Llama 3.1's templates do). A template without tools (SmolLM2's plain
ChatML) gets them the Hermes way, as Qwen2.5's template writes them: a system block listing the
functions in <tools></tools> and asking for <tool_call>{...}</tool_call>; earlier tool calls
and tool results in the conversation are written the same way.
`required` and a named choice become a structural tag (xgrammar's builtin for the format), so
the output is a valid call; `auto` leaves the output free and the parser finds the calls.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Any

from xgrammar import structural_tag as st

from atom.entrypoints.json_schema_check import check_schema
from atom.structured.spec import StructuredKind, StructuredSpec
from atom.tokenizer import BaseTokenizer
from atom.wire.api_error import bad_request

MAX_TOOLS = 128


class ToolFormat(enum.StrEnum):
    HERMES = "hermes"  # <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>
    LLAMA3 = "llama3"  # {"name": ..., "parameters": {...}} (optionally after <|python_tag|>)


# A call's text around its arguments, as xgrammar's builtin tags for Qwen 3 and Llama write it.
CALL_TAGS = {
    ToolFormat.HERMES: ('<tool_call>\n{{"name": "{name}", "arguments": ', "}\n</tool_call>"),
    ToolFormat.LLAMA3: ('{{"name": "{name}", "parameters": ', "}"),
}
MAX_WHITESPACE = 1  # between a call's JSON tokens: a small model otherwise indents forever
CALL_SEPARATOR = {ToolFormat.HERMES: "\n", ToolFormat.LLAMA3: "; "}


@dataclass(frozen=True)
class ToolRequest:
    tools: list[dict[str, Any]]  # OpenAI function tools, as sent
    choice: str  # auto | required | the forced function's name (see forced)
    forced: bool
    parallel: bool
    format: ToolFormat

    @property
    def names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]

    def constraint(self) -> StructuredSpec | None:
        """A structural tag that admits only valid calls (required / named), nothing before
        or between them but the format's separator; None for auto."""
        if self.choice == "auto":
            return None
        begin, end = CALL_TAGS[self.format]
        tags = [
            st.TagFormat(begin=begin.format(name=t["function"]["name"]),
                         content=st.JSONSchemaFormat(json_schema=t["function"]["parameters"],
                                                     max_whitespace_cnt=MAX_WHITESPACE),
                         end=end)
            for t in self.tools
            if not self.forced or t["function"]["name"] == self.choice
        ]
        calls = st.TagsWithSeparatorFormat(tags=tags, separator=CALL_SEPARATOR[self.format],
                                           at_least_one=True,
                                           stop_after_first=self.forced or not self.parallel)
        tag = st.StructuralTag(format=calls)
        return StructuredSpec(StructuredKind.STRUCTURAL_TAG, tag.model_dump_json())


def tool_format(tok: BaseTokenizer) -> ToolFormat:
    template = tok.chat_template or ""
    if "<|python_tag|>" in template or "ipython" in template:
        return ToolFormat.LLAMA3
    return ToolFormat.HERMES


def tool_request(body: dict[str, Any], tok: BaseTokenizer) -> ToolRequest | None:
    """The body's tools, checked (400s name `tools` or `tool_choice`); None: no tools, or
    tool_choice none (the model is not told of them and its output is not parsed)."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise bad_request("parallel_tool_calls must be a boolean", param="parallel_tool_calls")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise bad_request("tool_choice needs tools", param="tool_choice")
        return None
    checked = _tools(tools)
    if choice == "none":
        return None
    names = [t["function"]["name"] for t in checked]
    forced = False
    if choice is None or choice in ("auto", "required"):
        mode = choice or "auto"
    elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(
        choice.get("function"), dict
    ):
        mode = choice["function"].get("name")
        if mode not in names:
            raise bad_request(f"tool_choice names {mode!r}, which is not among the tools",
                              param="tool_choice")
        forced = True
    else:
        raise bad_request('tool_choice must be "none", "auto", "required" or '
                          '{"type": "function", "function": {"name": ...}}', param="tool_choice")
    return ToolRequest(checked, mode, forced, parallel, tool_format(tok))


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise bad_request(f"tools must be a list of at most {MAX_TOOLS} tools", param="tools")
    out = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise bad_request(f'tools.{i} must be {{"type": "function", "function": {{...}}}}',
                              param="tools")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request(f"tools.{i}.function.name must be a non-empty string", param="tools")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        check_schema(params, f"tools.{i}.function.parameters", "tools")
        out.append({"type": "function", "function": {**fn, "parameters": params}})
    return out


# ---- rendering -----------------------------------------------------------------------------

HERMES_SYSTEM = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    "{tools}\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def render_chat(tok: BaseTokenizer, messages: list[dict[str, Any]],
                tools: ToolRequest | None) -> str:
    """The prompt text: the template renders the tools itself when it can."""
    template = tok.chat_template or ""
    if "tools" in template:
        return tok.apply_chat_template(
            [_arguments_as_objects(m) for m in messages], add_generation_prompt=True,
            tools=tools.tools if tools is not None else None,
        )
    return tok.apply_chat_template(hermes_messages(messages, tools), add_generation_prompt=True)


def _arguments_as_objects(message: dict[str, Any]) -> dict[str, Any]:
    """Templates write a call's arguments with tojson: give them the object, not its text."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    out = []
    for call in calls:
        fn = dict(call.get("function") or {})
        if isinstance(fn.get("arguments"), str):
            try:
                fn["arguments"] = json.loads(fn["arguments"])
            except json.JSONDecodeError:
                pass
        out.append({**call, "function": fn})
    return {**message, "tool_calls": out}


def hermes_messages(messages: list[dict[str, Any]],
                    tools: ToolRequest | None) -> list[dict[str, Any]]:
    """Plain role/content messages carrying the tools, calls and results in Hermes' words."""
    out: list[dict[str, Any]] = []
    for m in messages:
        role, content = m["role"], _text(m.get("content"))
        if role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1]["role"] == "user" and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
            continue
        if role == "assistant" and m.get("tool_calls"):
            calls = [_call_text(c) for c in m["tool_calls"]]
            content = "\n".join(([content] if content else []) + calls)
        out.append({"role": role, "content": content})
    if tools is not None:
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools.tools)
        block = HERMES_SYSTEM.format(tools=listing)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + block}
        else:
            out.insert(0, {"role": "system", "content": block})
    return [{"role": m["role"], "content": m["content"]} for m in out]


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content or ""


def _call_text(call: dict[str, Any]) -> str:
    fn = call.get("function") or {}
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            pass
    body = json.dumps({"name": fn.get("name"), "arguments": args}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"
