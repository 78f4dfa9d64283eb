"""Old import path (kept for the guide and existing callers): re-exports atom.compilation.hashing."""

from atom.compilation.hashing import *  # noqa: F401,F403
