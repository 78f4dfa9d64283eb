"""Re-export: APIError lives in atom.wire.api_error (torch-free, shared with the router)."""

from atom.wire.api_error import ERROR_TYPES, APIError, bad_request

__all__ = ["ERROR_TYPES", "APIError", "bad_request"]
