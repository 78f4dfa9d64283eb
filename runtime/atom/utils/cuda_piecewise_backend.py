"""The guide's import path: re-exports atom.compilation.backends
(runtime code imports that module itself)."""

from atom.compilation.backends import *  # noqa: F401,F403
