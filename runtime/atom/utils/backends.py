"""Old import path (kept for the guide and existing callers): re-exports atom.compilation.backends."""

from atom.compilation.backends import *  # noqa: F401,F403
