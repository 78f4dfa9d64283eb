"""The model's text to OpenAI `tool_calls`, whole and streamed.

Hermes / ChatML (SmolLM2, Qwen): each call is `<tool_call>{"name": ..., "arguments": {...}}
</tool_call>`; text outside the tags is the message's content. Llama 3: the message is one or
more JSON objects `{"name": ..., "parameters": {...}}` (after an optional <|python_tag|>,
separated by `;` or new lines); any other text is content. A call whose JSON does not parse,
or names no tool the request offered, stays content: the client sees what the model wrote.

Streaming: content goes out as it comes, less any tail that could begin a call tag; a call goes
out whole, as one delta with its id, name and arguments, once its closing tag (Llama 3: the end
of the output) is read. Clients assemble deltas by index, so one delta per call is valid.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from atom.entrypoints.tool_request import ToolFormat, ToolRequest

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


@dataclass
class ParsedMessage:
    content: str | None
    calls: list[dict[str, Any]] = field(default_factory=list)  # OpenAI tool_calls entries


def new_call(name: str, arguments: Any, index: int | None = None) -> dict[str, Any]:
    call: dict[str, Any] = {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
    }
    if index is not None:
        call["index"] = index
    return call


def _call_of(obj: Any, names: list[str], args_key: str) -> tuple[str, Any] | None:
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):  # some models write the arguments as JSON text
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    return (obj["name"], args) if isinstance(args, dict) else None


def parse_hermes(text: str, names: list[str]) -> ParsedMessage:
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    pos = 0
    for m in _HERMES_CALL.finditer(text):
        try:
            found = _call_of(json.loads(m.group(1)), names, "arguments")
        except json.JSONDecodeError:
            found = None
        if found is None:
            continue  # left in the content
        kept.append(text[pos : m.start()])
        pos = m.end()
        calls.append(new_call(*found))
    kept.append(text[pos:])
    content = "".join(kept).strip() if calls else text
    return ParsedMessage(content or None, calls)


def parse_llama3(text: str, names: list[str]) -> ParsedMessage:
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG) :].lstrip()
    if not body.startswith("{"):
        return ParsedMessage(text or None)
    decoder = json.JSONDecoder()
    calls: list[dict[str, Any]] = []
    pos = 0
    while pos < len(body):
        try:
            obj, end = decoder.raw_decode(body, pos)
        except json.JSONDecodeError:
            return ParsedMessage(text or None)
        found = _call_of(obj, names, "parameters")
        if found is None:
            return ParsedMessage(text or None)
        calls.append(new_call(*found))
        pos = end
        while pos < len(body) and body[pos] in " \t\r\n;":
            pos += 1
    return ParsedMessage(None, calls)


def parse_tool_calls(text: str, tools: ToolRequest) -> ParsedMessage:
    if tools.format is ToolFormat.LLAMA3:
        return parse_llama3(text, tools.names)
    return parse_hermes(text, tools.names)


@dataclass
class StreamDelta:
    content: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)  # with "index"


class ToolCallStream:
    """Feed the streamed text; get content to send now and whole calls as they close."""

    def __init__(self, tools: ToolRequest) -> None:
        self.tools = tools
        self._buf = ""  # text not yet sent: a possible tag start, or a call being read
        self._in_call = False
        self._llama_json: bool | None = None  # Llama 3: the output is calls (None: not known)
        self.num_calls = 0

    def feed(self, text: str, final: bool = False) -> StreamDelta:
        self._buf += text
        if self.tools.format is ToolFormat.LLAMA3:
            return self._llama(final)
        return self._hermes(final)

    def _emit(self, name: str, args: Any) -> dict[str, Any]:
        call = new_call(name, args, self.num_calls)
        self.num_calls += 1
        return call

    def _hermes(self, final: bool) -> StreamDelta:
        out = StreamDelta()
        while True:
            if not self._in_call:
                at = self._buf.find(HERMES_OPEN)
                if at < 0:
                    keep = 0 if final else _partial_suffix(self._buf, HERMES_OPEN)
                    out.content += self._buf[: len(self._buf) - keep]
                    self._buf = self._buf[len(self._buf) - keep :]
                    return out
                out.content += self._buf[:at]
                self._buf = self._buf[at:]
                self._in_call = True
            end = self._buf.find(HERMES_CLOSE)
            if end < 0 and not final:
                return out
            call_text = self._buf if end < 0 else self._buf[: end + len(HERMES_CLOSE)]
            self._buf = "" if end < 0 else self._buf[end + len(HERMES_CLOSE) :]
            self._in_call = False
            parsed = parse_hermes(call_text, self.tools.names)
            if parsed.calls:
                fn = parsed.calls[0]["function"]
                out.calls.append(self._emit(fn["name"], json.loads(fn["arguments"])))
            else:
                out.content += call_text
            if not self._buf:
                return out

    def _llama(self, final: bool) -> StreamDelta:
        if self._llama_json is None:
            head = self._buf.lstrip()
            if not head:
                return StreamDelta()
            if head.startswith(("{", PYTHON_TAG)):
                self._llama_json = True
            elif not PYTHON_TAG.startswith(head):
                self._llama_json = False
            elif not final:
                return StreamDelta()  # could still be the tag
        if not self._llama_json:
            text, self._buf = self._buf, ""
            return StreamDelta(content=text)
        if not final:
            return StreamDelta()
        parsed = parse_llama3(self._buf, self.tools.names)
        self._buf = ""
        calls = [self._emit(c["function"]["name"], json.loads(c["function"]["arguments"]))
                 for c in parsed.calls]
        return StreamDelta(content=parsed.content or "", calls=calls)


def _partial_suffix(text: str, tag: str) -> int:
    """How many characters at text's end could begin tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def tool_message(text: str, finish_reason: str | None, tools: ToolRequest | None
                 ) -> tuple[dict[str, Any], str | None]:
    """A whole chat answer's message and finish reason: calls found become tool_calls
    (finish_reason "tool_calls", as OpenAI, when the model stopped on its own)."""
    if tools is None:
        return {"role": "assistant", "content": text}, finish_reason
    parsed = parse_tool_calls(text, tools)
    if not parsed.calls:
        return {"role": "assistant", "content": text}, finish_reason
    message = {"role": "assistant", "content": parsed.content, "tool_calls": parsed.calls}
    return message, "tool_calls" if finish_reason == "stop" else finish_reason


class ToolStreams:
    """One ToolCallStream per choice of a streamed answer."""

    def __init__(self, tools: ToolRequest) -> None:
        self.tools = tools
        self._streams: dict[int, ToolCallStream] = {}

    def delta(self, index: int, text: str, finish_reason: str | None
              ) -> tuple[dict[str, Any], str | None]:
        """The chunk's delta (content now sendable, calls now closed) and finish reason."""
        stream = self._streams.get(index)
        if stream is None:
            stream = self._streams[index] = ToolCallStream(self.tools)
        out = stream.feed(text, final=finish_reason is not None)
        delta: dict[str, Any] = {"content": out.content} if out.content else {}
        if out.calls:
            delta["tool_calls"] = out.calls
        if finish_reason == "stop" and stream.num_calls:
            finish_reason = "tool_calls"
        return delta, finish_reason
