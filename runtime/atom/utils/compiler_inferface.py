"""Old import path (kept for the guide and existing callers): re-exports atom.compilation.compiler_interface."""

from atom.compilation.compiler_interface import *  # noqa: F401,F403
