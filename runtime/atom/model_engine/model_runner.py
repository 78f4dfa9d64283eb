"""The guide's import path: re-exports atom.engine.model_runner
(runtime code imports that module itself)."""

from atom.engine.model_runner import *  # noqa: F401,F403
