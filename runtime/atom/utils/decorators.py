"""The guide's import path: re-exports atom.compilation.decorators
(runtime code imports that module itself)."""

from atom.compilation.decorators import *  # noqa: F401,F403
