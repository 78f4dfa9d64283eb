"""The guide's import path: re-exports atom.cudagraph.region_graph
(runtime code imports that module itself)."""

from atom.cudagraph.region_graph import *  # noqa: F401,F403
