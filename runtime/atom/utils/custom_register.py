"""Old import path (kept for the guide and existing callers): re-exports atom.compilation.custom_ops."""

from atom.compilation.custom_ops import *  # noqa: F401,F403
