"""The engine core and its client: the engine loop in its own process, joined to the API
server(s) by typed msgspec messages over ZeroMQ (one output message per engine step).

- `messages`: every message that crosses the seam.
- `engine_core`: the loop (build, warm-up, step, outputs), run in a process or a thread.
- `kv`: the core's KV side (the KV port server and decode-side pulls) on an I/O thread.
- `client`: the API server's view of the core (request streams, state, death detection).
- `process`: spawning the core (and extra API servers), parent-death handling.

Nothing here imports torch at module level except `kv` and what the core builds.
"""
