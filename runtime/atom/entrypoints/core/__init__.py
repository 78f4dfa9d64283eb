"""The engine core and its client: the engine loop in its own process, joined to the API
server(s) by typed msgspec messages over Unix sockets (one output message per engine step).

- `messages`: every message that crosses the seam.
- `channel`: the framed Unix-socket transport (the core's Inbox and Outboxes, the client's).
- `engine_core`: the loop (build, warm-up, step, outputs) over an `EngineAPI`
  (atom.engine.api), run in a process or a thread.
- `kv`: the core's KV side (the KV port server and decode-side pulls) on an I/O thread.
- `client`: the API server's view of the core (request streams, state, death detection).
- `process`: spawning the core process, parent-death handling (the extra API servers of
  --api-server-count are atom.entrypoints.launcher's).
- `step_trace`: per-step timing records (ATOM_STEP_TRACE).

Nothing here imports torch at module level except `kv` and what the core builds.
"""
