"""The guide's import path: re-exports atom.compilation.custom_ops
(runtime code imports that module itself)."""

from atom.compilation.custom_ops import *  # noqa: F401,F403
