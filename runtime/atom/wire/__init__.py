"""The wire contract shared by the server, the router and P/D disaggregation (torch-free).

- `errors`: error codes and the OpenAI error body.
- `kv_modes`: the `kv_transfer.mode` values a router sends and an instance honours.
- `api_error`, `middleware`, `body`: APIError, the JSON-errors middleware, bounded bodies.
- `trust`: the internal token and the per-transfer secrets; `auth`: the API key check.

Imports no other atom package (tests/runtime/test_architecture.py).
"""
