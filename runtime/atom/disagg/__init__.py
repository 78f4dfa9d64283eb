"""Prefill/decode disaggregation: KV blocks held by a prefill instance, pulled by a decode one.

- `layout`: what must match before any block is copied (model identity, dtype, block shape).
- `handle`: the JSON a prefill instance answers with and a decode instance is given.
- `wire`: the versioned TCP framing of the transfer.
- `holds`: blocks pinned after prefill until pulled or timed out (thread-safe).
- `kv_blocks`: gather/scatter of blocks in the runner's KV cache tensor (torch).
- `server` / `client`: the KV server on `--kv-port` and the puller (asyncio streams).

docs/architecture.md, "Disaggregation", is the contract.
"""
