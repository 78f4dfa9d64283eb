"""Speculative decoding: drafters (n-gram prompt lookup, a draft model), verification of
k + 1 query rows per request in one target forward, rejection-sampling acceptance, and the
rollback of rejected tokens' KV (docs/architecture.md, "Speculative decoding")."""

from atom.config import SpecMethod, SpeculativeConfig

__all__ = ["SpecMethod", "SpeculativeConfig"]
