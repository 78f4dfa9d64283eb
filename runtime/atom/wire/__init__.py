"""The wire contract shared by the server, the router and P/D disaggregation (torch-free).

- `errors`: error codes and the OpenAI error body.
- `kv_modes`: the `kv_transfer.mode` values a router sends and an instance honours.
"""
