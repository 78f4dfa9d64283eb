"""Tokenizers for the server: Hugging Face `tokenizers` or a byte-level fallback.

`load_tokenizer(model, vocab_size)` picks the tokenizer a GGUF file describes for a GGUF
model, the Hugging Face tokenizer when the model directory holds a `tokenizer.json`, and a
byte-level tokenizer otherwise (dummy and built-in models).
Both share one small interface (`encode`, `decode`, `eos_token_ids`, `apply_chat_template`), so
the server never cares which one it has. Streaming detokenisation and stop strings live here too
because they depend only on the tokenizer.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

logger = logging.getLogger(__name__)

REPLACEMENT_CHAR = "\ufffd"


class BaseTokenizer:
    """The interface the server uses."""

    bos_token_id: int | None = None
    eos_token_ids: list[int]
    chat_template: str | None = None
    add_bos: bool = False

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        raise NotImplementedError

    # Template variables; subclasses fill in their special tokens.
    def _template_vars(self) -> dict[str, Any]:
        return {}

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """Render chat messages to a prompt string (the template adds BOS, so encode without it).
        tools: the request's tools, for a template that renders them (`tools` in Jinja)."""
        if self.chat_template:
            extra = self._template_vars() if tools is None else {**self._template_vars(),
                                                                 "tools": tools}
            return _render_jinja(self.chat_template, messages, add_generation_prompt, extra)
        return plain_chat_prompt(messages, add_generation_prompt)


def plain_chat_prompt(messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
    """Fallback template: one "role: content" line per message, then "assistant:"."""
    lines = [f"{m['role']}: {content_text(m.get('content'))}" for m in messages]
    if add_generation_prompt:
        lines.append("assistant:")
    return "\n".join(lines)


def content_text(content: Any) -> str:
    """OpenAI message content is a string or a list of parts; keep the text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if isinstance(part, dict))


def _render_jinja(
    template: str,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    extra: dict[str, Any],
) -> str:
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    # Same environment settings as transformers, so HF chat templates render identically.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)  # Llama 3.x templates
    env.filters["tojson"] = lambda value, indent=None: json.dumps(
        value, ensure_ascii=False, indent=indent
    )
    msgs = [{**m, "content": content_text(m.get("content"))} for m in messages]
    return env.from_string(template).render(
        messages=msgs, add_generation_prompt=add_generation_prompt, **extra
    )


class ByteTokenizer(BaseTokenizer):
    """UTF-8 bytes as ids 0-255; BOS and EOS are the model's ids when it names them, else 256/257.

    Every id stays inside the model's vocab (which must hold the 256 bytes). A tiny model whose
    specials sit among the bytes (vocab 256, BOS 1, EOS 2) gives those control bytes up: they
    decode as the special they are. A dummy model samples ids across its whole vocab; ids past
    255 that are not specials decode as the byte `id % 256`, so random output still streams as
    (garbled) text rather than vanishing.
    """

    def __init__(
        self,
        vocab_size: int = 258,
        bos_token_id: int | None = None,
        eos_token_ids: Sequence[int] | None = None,
    ) -> None:
        if vocab_size < 256:
            raise ValueError(
                f"the byte-level tokenizer needs a vocab of at least 256 ids, the model has {vocab_size}"
            )
        self.vocab_size = vocab_size
        if bos_token_id is None and vocab_size > 256:
            bos_token_id = 256
        if not eos_token_ids and vocab_size > 257:
            eos_token_ids = [257]
        self.bos_token_id = bos_token_id
        self.eos_token_ids = list(eos_token_ids or [])
        for i in [bos_token_id, *self.eos_token_ids]:
            if i is not None and not 0 <= i < vocab_size:
                raise ValueError(f"special token id {i} is outside the model vocab of {vocab_size}")
        self._specials = {i for i in [bos_token_id, *self.eos_token_ids] if i is not None}
        self.add_bos = bos_token_id is not None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return (
            [self.bos_token_id, *ids]
            if add_special_tokens and self.bos_token_id is not None
            else ids
        )

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        out = bytearray()
        for i in ids:
            if i in self._specials:
                if not skip_special_tokens:
                    out += b"<s>" if i == self.bos_token_id else b"</s>"
                continue
            out.append(i % 256)
        return out.decode("utf-8", errors="replace")


class FastTokenizer(BaseTokenizer):
    """A `tokenizers.Tokenizer` with its specials and template (the subclasses fill them)."""

    _tok: Tokenizer
    bos_token: str | None = None
    eos_token: str | None = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def _template_vars(self) -> dict[str, Any]:
        return {"bos_token": self.bos_token or "", "eos_token": self.eos_token or ""}


class GGUFTokenizer(FastTokenizer):
    """The tokenizer a GGUF file's metadata describes (atom.gguf_tokenizer)."""

    def __init__(self, path: Path) -> None:
        from atom.gguf_tokenizer import gguf_vocab
        from atom.models.gguf_file import read_gguf

        vocab = gguf_vocab(read_gguf(path))
        self._tok = vocab.tokenizer
        self.bos_token, self.eos_token = vocab.bos_token, vocab.eos_token
        self.bos_token_id = vocab.bos_token_id
        self.eos_token_ids = vocab.eos_token_ids
        self.add_bos = vocab.add_bos
        self.chat_template = vocab.chat_template


class HFTokenizer(FastTokenizer):
    """A `tokenizers.Tokenizer` from tokenizer.json plus tokenizer_config.json's specials and template."""

    def __init__(self, model_dir: Path) -> None:
        self._tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        cfg = _read_json(model_dir / "tokenizer_config.json")
        gen = _read_json(model_dir / "generation_config.json")
        model_cfg = _read_json(model_dir / "config.json")
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        eos_ids: list[int] = []
        eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        if eos_token_id is not None:
            eos_ids.append(eos_token_id)
        # generation_config / config may list several EOS ids (Llama 3: <|eot_id|> and <|end_of_text|>).
        for source in (gen.get("eos_token_id"), model_cfg.get("eos_token_id")):
            for i in source if isinstance(source, list) else [source]:
                if isinstance(i, int) and i not in eos_ids:
                    eos_ids.append(i)
        self.eos_token_ids = eos_ids
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if template is None and (model_dir / "chat_template.jinja").is_file():
            template = (model_dir / "chat_template.jinja").read_text()
        self.chat_template = template
        # The tokenizer.json post-processor adds BOS itself for Llama; remember whether it does.
        probe = self._tok.encode("a", add_special_tokens=True).ids
        self.add_bos = (
            bool(probe) and self.bos_token_id is not None and probe[0] == self.bos_token_id
        )


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        logger.warning("ignoring unreadable %s: %s", path, exc)
        return {}


def _token_text(token: Any) -> str | None:
    if isinstance(token, dict):  # AddedToken serialisation
        return token.get("content")
    return token if isinstance(token, str) else None


def load_tokenizer(
    model: str,
    vocab_size: int,
    bos_token_id: int | None = None,
    eos_token_ids: Sequence[int] | None = None,
) -> BaseTokenizer:
    """The GGUF file's tokenizer for a GGUF model, the model directory's tokenizer.json if
    present, else the byte-level tokenizer.

    The model's own BOS/EOS ids (config.json) are used by the byte-level tokenizer, so the ids it
    hands the engine are the ones the model was built with.
    """
    from atom.models.gguf_file import find_gguf

    gguf = find_gguf(model)
    if gguf is not None:
        return GGUFTokenizer(gguf)
    path = Path(model)
    if path.is_dir() and (path / "tokenizer.json").is_file():
        return HFTokenizer(path)
    logger.info("no tokenizer.json for %s: using the byte-level tokenizer", model)
    return ByteTokenizer(vocab_size, bos_token_id, eos_token_ids)


@dataclass
class IncrementalDetokenizer:
    """Turns a growing list of output ids into text deltas for streaming.

    Decodes a small window (`prefix_offset:`) rather than everything each step, and emits text only
    once it no longer ends in a partial UTF-8 sequence, so multi-byte characters are never split
    and tokenizers that merge a leading space into the next word stay right.
    """

    tokenizer: BaseTokenizer
    skip_special_tokens: bool = True
    ids: list[int] = field(default_factory=list)
    prefix_offset: int = 0
    read_offset: int = 0

    def add(self, new_ids: Sequence[int]) -> str:
        self.ids.extend(new_ids)
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset : self.read_offset], self.skip_special_tokens)
        full = decode(self.ids[self.prefix_offset :], self.skip_special_tokens)
        if len(full) > len(prefix) and not full.endswith(REPLACEMENT_CHAR):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return full[len(prefix) :]
        return ""

    def flush(self) -> str:
        """At the end, whatever is left (even an incomplete character, as a replacement char)."""
        prefix = self.tokenizer.decode(
            self.ids[self.prefix_offset : self.read_offset], self.skip_special_tokens
        )
        full = self.tokenizer.decode(self.ids[self.prefix_offset :], self.skip_special_tokens)
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix) :] if full.startswith(prefix) else ""


class StopStringChecker:
    """Holds back text that could be the start of a stop string; truncates at a match.

    `feed(delta)` returns (text safe to emit, stopped). On a stop the returned text ends right
    before the stop string (OpenAI semantics: the stop sequence is not included).
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.stopped = False

    def feed(self, delta: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        if not self.stops:
            return delta, False
        text = self.pending + delta
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            self.pending = ""
            return text[: min(hits)], True
        hold = self._held_suffix(text)
        self.pending = text[len(text) - hold :] if hold else ""
        return text[: len(text) - hold], False

    def flush(self) -> str:
        text, self.pending = self.pending, ""
        return "" if self.stopped else text

    def _held_suffix(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of some stop string."""
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:n]):
                    best = n
                    break
        return best
