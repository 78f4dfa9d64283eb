"""The serving engine: sequences, paged KV blocks, scheduler, sampler, LLMEngine."""

from atom.engine.params import RequestOutput, SamplingParams

__all__ = ["LLMEngine", "RequestOutput", "SamplingParams"]


def __getattr__(name: str):
    # LLMEngine pulls in torch and the model; import it only when asked for.
    if name == "LLMEngine":
        from atom.engine.llm_engine import LLMEngine

        return LLMEngine
    raise AttributeError(name)
