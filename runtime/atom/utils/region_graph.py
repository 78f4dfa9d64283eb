"""Old import path (kept for the guide and existing callers): re-exports atom.cudagraph.region_graph."""

from atom.cudagraph.region_graph import *  # noqa: F401,F403
