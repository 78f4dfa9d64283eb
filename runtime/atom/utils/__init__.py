"""Shared leaf helpers (counters, forward context); the other modules are the guide's import
paths, re-exporting atom.compilation and atom.cudagraph (runtime code imports those)."""
