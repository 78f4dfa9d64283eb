"""The guide's import path: re-exports atom.compilation.compiler_interface
(runtime code imports that module itself)."""

from atom.compilation.compiler_interface import *  # noqa: F401,F403
