"""Who may steer a KV transfer, and who may read held blocks (docs/architecture.md, contract).

- The router and the P/D instances share `ATOM_INTERNAL_TOKEN` (a Secret the operator makes per
  AtomDeployment). The router sends it as `X-Atom-Internal-Token` on every backend request; an
  instance honours a `kv_transfer` field only when that header matches. Without the token set
  an instance refuses every `kv_transfer`: a client can never make it dial an address.
- Each held prompt gets a per-transfer secret, an HMAC of its handle under a key that lives
  only in the prefill process; the handle carries it to the decode instance, which sends it with
  its PULL or RELEASE. A stolen or guessed handle without it reads nothing. Stateless: nothing
  to clean up when a hold ends.

Pure Python, no torch: the router imports it.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Mapping

TOKEN_ENV = "ATOM_INTERNAL_TOKEN"
TOKEN_HEADER = "X-Atom-Internal-Token"


def internal_token() -> str | None:
    """The shared router/instance secret, or None when unset (or blank)."""
    return os.environ.get(TOKEN_ENV, "").strip() or None


def is_internal(headers: Mapping[str, str], token: str | None = None) -> bool:
    """Whether a request carries the internal token (constant-time compare). Always False when
    no token is configured."""
    token = token if token is not None else internal_token()
    sent = headers.get(TOKEN_HEADER)
    if not token or not sent:
        return False
    return hmac.compare_digest(sent.encode(), token.encode())


def token_verdict(headers: Mapping[str, str]) -> str | None:
    """What /health tells a prober that sent X-Atom-Internal-Token: "match", "mismatch", or
    "unset" (this instance has none); None when the header was not sent. Says no more than a
    kv_transfer's 403 would, and compares in constant time."""
    if headers.get(TOKEN_HEADER) is None:
        return None
    if internal_token() is None:
        return "unset"
    return "match" if is_internal(headers) else "mismatch"


def internal_headers(token: str) -> dict[str, str]:
    return {TOKEN_HEADER: token}


class TransferKeys:
    """Per-transfer secrets of one prefill process."""

    def __init__(self, key: bytes | None = None) -> None:
        self._key = key or secrets.token_bytes(32)

    def secret_for(self, handle: str) -> str:
        return hmac.new(self._key, handle.encode(), hashlib.sha256).hexdigest()[:32]

    def verify(self, handle: str, secret: object) -> bool:
        if not isinstance(secret, str) or not secret:
            return False
        return hmac.compare_digest(secret.encode(), self.secret_for(handle).encode())
