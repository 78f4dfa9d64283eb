"""The model's end-of-sequence ids: the one EOS rule, applied by the engine alone.

The engine stops a sequence at any of them unless ignore_eos (LLMEngine._stop_reason), for
the server and for `LLMEngine.generate` alike. A checkpoint names them in three files, and
chat models often name the end-of-turn token in only some of them (Llama 3 Instruct:
<|eot_id|> is in generation_config.json, not always in config.json): config.json's
eos_token_id (ModelConfig.eos_token_id), generation_config.json's eos_token_id, and
tokenizer_config.json's eos_token, found by its content among the added tokens.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from atom.models.model_config import ModelConfig

logger = logging.getLogger(__name__)


def model_eos_ids(hf_config: ModelConfig) -> frozenset[int]:
    ids = set(hf_config.eos_token_id)
    if hf_config.path is not None:
        model_dir = Path(hf_config.path)
        ids.update(_ids(_read(model_dir / "generation_config.json").get("eos_token_id")))
        tok = _read(model_dir / "tokenizer_config.json")
        eos = _content(tok.get("eos_token"))
        for i, added in (tok.get("added_tokens_decoder") or {}).items():
            if eos is not None and _content(added) == eos and str(i).isdigit():
                ids.add(int(i))
    return frozenset(i for i in ids if 0 <= i < hf_config.vocab_size)


def _ids(value: Any) -> list[int]:
    values = value if isinstance(value, list) else [value]
    return [i for i in values if isinstance(i, int) and not isinstance(i, bool)]


def _content(token: Any) -> str | None:
    if isinstance(token, dict):  # AddedToken serialisation
        token = token.get("content")
    return token if isinstance(token, str) else None


def _read(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        logger.warning("ignoring unreadable %s: %s", path, exc)
        return {}
    return data if isinstance(data, dict) else {}
