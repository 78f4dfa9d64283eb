"""Old import path (kept for the guide and existing callers): re-exports atom.compilation.prefetch."""

from atom.compilation.prefetch import *  # noqa: F401,F403
