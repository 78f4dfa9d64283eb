"""The API key check of the server and the router: `Authorization: Bearer KEY`.

The scheme is case-insensitive (RFC 9110: `bearer`, `BEARER` and `Bearer` are the same);
the key is compared in constant time.
"""

from __future__ import annotations

import hmac


def bearer_matches(authorization: str, key: str) -> bool:
    """Whether an Authorization header value carries `key` as its bearer token."""
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(token.strip().encode(), key.encode())
