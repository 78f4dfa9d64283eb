"""Re-export: the trust rules live in atom.wire.trust (torch-free, shared with the router)."""

from atom.wire.trust import (
    TOKEN_ENV,
    TOKEN_HEADER,
    TransferKeys,
    internal_headers,
    internal_token,
    is_internal,
)

__all__ = [
    "TOKEN_ENV",
    "TOKEN_HEADER",
    "TransferKeys",
    "internal_headers",
    "internal_token",
    "is_internal",
]
