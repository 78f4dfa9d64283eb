"""Old import path (kept for the guide and existing callers): re-exports atom.engine.host_staging."""

from atom.engine.host_staging import *  # noqa: F401,F403
