"""Shared leaf helpers (counters, forward context); the other modules are old import paths."""
