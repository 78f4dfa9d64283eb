"""Errors of the dev cluster: each names the missing piece and why."""

from __future__ import annotations

from pathlib import Path


class ProvisionError(RuntimeError):
    """A control-plane binary is missing or could not be installed."""


class ClusterError(RuntimeError):
    """The local cluster did not start (the message carries the failing component's log)."""


def tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return f"(no log at {path})"
    return "\n".join(text.splitlines()[-lines:])
