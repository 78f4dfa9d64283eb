"""The KV handle: a prefill instance's answer, handed by the router to a decode instance.

JSON (the `kv_transfer` field of the prefill response and of the decode request):

    {"version": 1, "handle": "cmpl-...", "kv_host": "10.0.0.5" | null, "kv_port": 8001,
     "identity": "<model identity>", "model": "llama-3.2-1b", "num_blocks": 32,
     "prompt_token_ids": [...], "first_token_id": 42, "first_logprob": -1.3 | null,
     "expires_in": 30.0, "secret": "<per-transfer secret>",
     "cached_tokens": 0}

`secret` (trust.TransferKeys) is what the prefill's KV server asks of a PULL or RELEASE besides
the handle; only our router ever sees it (it reaches no client).

`kv_host` is null when the prefill instance does not know its own address (no --kv-host or
ATOM_KV_HOST); the router then fills in the host it reached the instance at. `cached_tokens`
(optional, default 0): prompt tokens the prefill instance found in its prefix cache, which the
decode instance reports as `usage.prompt_tokens_details.cached_tokens`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from atom.disagg.wire import WIRE_VERSION


@dataclass
class KVHandle:
    handle: str
    kv_host: str | None
    kv_port: int
    identity: str
    model: str
    num_blocks: int
    prompt_token_ids: list[int]
    first_token_id: int
    first_logprob: float | None = None
    expires_in: float = 0.0
    version: int = WIRE_VERSION
    secret: str = ""
    cached_tokens: int = 0
    # The first token's top_logprobs alternatives, (id, logprob) best first (None: not asked)
    first_top_logprobs: list[tuple[int, float]] | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def address(self) -> str:
        return f"{self.kv_host}:{self.kv_port}"

    @classmethod
    def from_dict(cls, data: Any) -> KVHandle:
        """ValueError naming the field (the server answers 400 with it)."""
        if not isinstance(data, dict):
            raise ValueError("kv_transfer must be an object")

        def get(name: str, kind: type | tuple[type, ...], optional: bool = False) -> Any:
            value = data.get(name)
            if value is None and optional:
                return None
            if not isinstance(value, kind) or isinstance(value, bool):
                raise ValueError(f"kv_transfer.{name} is missing or has the wrong type: {value!r}")
            return value

        version = get("version", int)
        if version != WIRE_VERSION:
            raise ValueError(
                f"kv_transfer.version {version} is not supported (this instance speaks "
                f"{WIRE_VERSION})"
            )
        prompt = get("prompt_token_ids", list)
        if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise ValueError("kv_transfer.prompt_token_ids must be a non-empty list of integers")
        port = get("kv_port", int)
        if not 0 < port < 65536:
            raise ValueError(f"kv_transfer.kv_port {port} is not a TCP port")
        logprob = get("first_logprob", (int, float), optional=True)
        top = _top_pairs(get("first_top_logprobs", list, optional=True))
        return cls(
            handle=get("handle", str),
            kv_host=get("kv_host", str, optional=True),
            kv_port=port,
            identity=get("identity", str),
            model=get("model", str),
            num_blocks=get("num_blocks", int),
            prompt_token_ids=list(prompt),
            first_token_id=get("first_token_id", int),
            first_logprob=None if logprob is None else float(logprob),
            expires_in=float(get("expires_in", (int, float), optional=True) or 0.0),
            version=version,
            secret=get("secret", str, optional=True) or "",
            cached_tokens=int(get("cached_tokens", int, optional=True) or 0),
            first_top_logprobs=top,
        )


def _top_pairs(value: list | None) -> list[tuple[int, float]] | None:
    """kv_transfer.first_top_logprobs: [[token id, logprob], ...] (at most 20 of them)."""
    if value is None:
        return None
    ok = len(value) <= 20 and all(
        isinstance(p, (list, tuple)) and len(p) == 2 and isinstance(p[0], int)
        and isinstance(p[1], (int, float)) and not isinstance(p[0], bool) for p in value
    )
    if not ok:
        raise ValueError("kv_transfer.first_top_logprobs must be at most 20 [token id, logprob] "
                         "pairs")
    return [(int(i), float(v)) for i, v in value]
