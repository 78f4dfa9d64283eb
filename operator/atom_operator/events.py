"""Kubernetes Events for what changed between two statuses (pure; `reconcile` posts them).

One Event per transition, never one per reconcile: a phase change, a new Degraded reason (a
Warning naming it), a recovery, a new revision. `kubectl describe atomd` lists them, and so
does `kubectl get events --field-selector involvedObject.name=<name>`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal


@dataclass(frozen=True)
class Event:
    type: Literal["Normal", "Warning"]
    reason: str
    message: str


def _condition(status: dict[str, Any] | None, ctype: str) -> dict[str, Any]:
    for cond in (status or {}).get("conditions") or []:
        if cond.get("type") == ctype:
            return cond
    return {}


def transitions(previous: dict[str, Any] | None, current: dict[str, Any]) -> list[Event]:
    out: list[Event] = []
    prev_rev, rev = (previous or {}).get("revision"), current.get("revision")
    if rev and prev_rev and rev != prev_rev:
        out.append(Event("Normal", "RolloutStarted", f"revision {rev} replaces {prev_rev}"))
    was, now = _condition(previous, "Degraded"), _condition(current, "Degraded")
    if now.get("status") == "True" and (
        was.get("status") != "True" or was.get("reason") != now.get("reason")
    ):
        out.append(Event("Warning", now.get("reason") or "Degraded", now.get("message", "")))
    elif was.get("status") == "True" and now.get("status") == "False":
        out.append(Event("Normal", "Recovered", f"no longer degraded ({was.get('reason')})"))
    prev_phase, phase = (previous or {}).get("phase"), current.get("phase")
    if phase and phase != prev_phase:
        ready = _condition(current, "Ready").get("message", "")
        out.append(
            Event(
                "Warning" if phase == "Degraded" else "Normal",
                f"Phase{phase}",
                f"phase {prev_phase or 'none'} -> {phase}: {ready}",
            )
        )
    return out
