"""Old import path (kept for the guide and existing callers): re-exports atom.compilation.decorators."""

from atom.compilation.decorators import *  # noqa: F401,F403
