"""Error codes and the OpenAI error body, as the server and the router both answer them.

Torch-free and aiohttp-free so that any process (router, API server, engine core) can build
the same body for the same failure.
"""

from __future__ import annotations

from typing import Any

# HTTP status -> OpenAI error "type".
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "invalid_request_error",
    404: "invalid_request_error",
    408: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    503: "service_unavailable",
}

# Codes (the body's "code" field); one name per failure, shared by every component.
INVALID_REQUEST = "invalid_request"
INVALID_JSON = "invalid_json"
INVALID_API_KEY = "invalid_api_key"
REQUEST_TIMEOUT = "request_timeout"
RATE_LIMIT_EXCEEDED = "rate_limit_exceeded"
NOT_READY = "not_ready"
SHUTTING_DOWN = "shutting_down"
ENGINE_UNAVAILABLE = "engine_unavailable"
NO_BACKEND = "no_backend"
PREFILL_FAILED = "prefill_failed"
DECODE_FAILED = "decode_failed"
KV_BAD_REQUEST = "kv_bad_request"
KV_NOT_ENABLED = "kv_not_enabled"
KV_MISMATCH = "kv_mismatch"
KV_TRANSFER_FAILED = "kv_transfer_failed"
KV_VERSION_MISMATCH = "kv_version_mismatch"
KV_TRANSFER_FORBIDDEN = "kv_transfer_forbidden"
KV_HOLD_CAP = "kv_hold_cap"
ENGINE_STALLED = "engine_stalled"
MODEL_NOT_FOUND = "model_not_found"
KV_TOKEN_MISMATCH = "kv_token_mismatch"

# Seconds a client is told to wait (Retry-After) before retrying a 429 or a 503.
RETRY_AFTER_S = 1
RETRY_STATUSES = (429, 503)


def retry_headers(status: int, seconds: int = RETRY_AFTER_S) -> dict[str, str]:
    """{"Retry-After": ...} for a status worth retrying (429, 503), else {}."""
    return {"Retry-After": str(seconds)} if status in RETRY_STATUSES else {}


def error_type(status: int) -> str:
    return ERROR_TYPES.get(
        status, "service_unavailable" if status >= 500 else "invalid_request_error"
    )


def error_body(
    status: int,
    message: str,
    code: str | None = None,
    param: str | None = None,
    err_type: str | None = None,
) -> dict[str, Any]:
    """{"error": {"message", "type", "param", "code"}}: what OpenAI clients parse."""
    return {
        "error": {
            "message": message,
            "type": err_type or error_type(status),
            "param": param,
            "code": code,
        }
    }


def kv_status(code: str) -> int:
    """The HTTP status a KV transfer failure is answered with (a mismatch is the caller's)."""
    return 409 if code == KV_MISMATCH else 503
