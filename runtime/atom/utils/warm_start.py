"""Old import path (kept for the guide and existing callers): re-exports atom.compilation.warm_start."""

from atom.compilation.warm_start import *  # noqa: F401,F403
