"""`--speculative-config`: SpeculativeConfig lives in atom.config (config imports no other
atom package); this is its speculative-decoding home name."""

from atom.config import SpecMethod, SpeculativeConfig

__all__ = ["SpecMethod", "SpeculativeConfig"]
