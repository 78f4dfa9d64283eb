"""Old import path (kept for the guide and existing callers): re-exports atom.cudagraph.runner."""

from atom.cudagraph.runner import *  # noqa: F401,F403
