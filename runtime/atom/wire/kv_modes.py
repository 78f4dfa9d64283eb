"""`kv_transfer.mode`: what a router asks of a prefill or a decode instance."""

from __future__ import annotations

import enum


class KVMode(enum.StrEnum):
    PREFILL = "prefill"  # run the prompt, hold its blocks, answer with the KV handle
    DECODE = "decode"  # pull the handle's blocks, then decode from its first token


MODES = tuple(m.value for m in KVMode)

DEFAULT_KV_PORT = 8001  # where a prefill instance serves its held blocks unless told
RELEASE_PATH = "/internal/kv/release"  # the router frees a hold there (entrypoints/kv_release.py)


def parse_mode(value: object) -> KVMode | None:
    """The mode, or None when it is not one of MODES."""
    try:
        return KVMode(value) if isinstance(value, str) else None
    except ValueError:
        return None
