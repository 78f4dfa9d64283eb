"""Events are posted once per transition, never once per reconcile."""

from __future__ import annotations

from atom_operator.events import transitions


def st(phase: str, degraded: str | None = None, revision: str = "r1") -> dict:
    conds = [{"type": "Ready", "status": "True" if phase == "Ready" else "False", "message": "m"}]
    conds.append(
        {"type": "Degraded", "status": "True", "reason": degraded, "message": f"{degraded}!"}
        if degraded
        else {"type": "Degraded", "status": "False", "reason": "AsExpected"}
    )
    return {"phase": phase, "revision": revision, "conditions": conds}


def test_phase_change_and_new_degraded_reason() -> None:
    evs = transitions(st("Progressing"), st("Degraded", "FailedCreate"))
    assert [(e.type, e.reason) for e in evs] == [
        ("Warning", "FailedCreate"),
        ("Warning", "PhaseDegraded"),
    ]
    assert evs[0].message == "FailedCreate!"


def test_nothing_changed_posts_nothing() -> None:
    assert transitions(st("Ready"), st("Ready")) == []
    assert transitions(st("Degraded", "X"), st("Degraded", "X")) == []


def test_reason_change_recovery_and_rollout() -> None:
    assert [e.reason for e in transitions(st("Degraded", "A"), st("Degraded", "B"))] == ["B"]
    rec = transitions(st("Degraded", "A"), st("Ready"))
    assert [(e.type, e.reason) for e in rec] == [("Normal", "Recovered"), ("Normal", "PhaseReady")]
    roll = transitions(st("Ready"), st("Progressing", revision="r2"))
    assert roll[0].reason == "RolloutStarted" and "r2" in roll[0].message
    assert [e.reason for e in transitions(None, st("Pending"))] == ["PhasePending"]
