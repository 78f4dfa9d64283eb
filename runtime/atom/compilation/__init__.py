"""torch.compile for the runtime: what each level compiles and how it is cached.

Owns the compilation levels and graph-mode enums (`levels`), the `@support_torch_compile`
decorator and the level-1 wrapper (`decorators`), the Dynamo backend that splits the graph
at the splitting ops and compiles each piece, with the per-piece shape dispatch
(`backends`, `splitting`), the compiler adaptors (`compiler_interface`), the on-disk cache
and its key (`cache`, `hashing`), the saved-trace warm start (`warm_start`), the Inductor
prefetch thread (`prefetch`) and custom-op registration (`custom_ops`).

Imports only atom.config and atom.utils (counters, forward context): never the engine,
the CUDA-graph engine or the entrypoints.
"""
