"""Old import path (kept for the guide and existing callers): re-exports atom.engine.model_runner."""

from atom.engine.model_runner import *  # noqa: F401,F403
