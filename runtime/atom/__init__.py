"""ATOM inference engine: piecewise torch.compile, CUDA graphs, paged KV cache, OpenAI server."""

__version__ = "0.1.0"
