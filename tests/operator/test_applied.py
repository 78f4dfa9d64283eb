"""No-op applies are skipped only while nobody else touched the object."""

from __future__ import annotations

import copy

from atom_operator.applied import AppliedCache


def obj(kind: str = "Service", **meta: object) -> dict:
    return {
        "kind": kind,
        "metadata": {"name": "a", "namespace": "n", "labels": {"l": "1"}, **meta},
        "spec": {"x": 1},
    }


def test_skip_until_someone_else_changes_the_object() -> None:
    cache = AppliedCache()
    desired = obj()
    returned = obj(resourceVersion="5")
    assert not cache.unchanged(desired, returned)  # never applied by us
    cache.record(desired, returned)
    assert cache.unchanged(desired, returned)
    assert not cache.unchanged(desired, obj(resourceVersion="6"))  # edited by hand
    changed = copy.deepcopy(desired)
    changed["spec"]["x"] = 2
    assert not cache.unchanged(changed, returned)  # we want something new
    assert not cache.unchanged(desired, None)  # deleted by hand


def test_deployments_compare_generation_and_labels() -> None:
    cache = AppliedCache()
    desired = obj("Deployment")
    cache.record(desired, obj("Deployment", generation=3, uid="u", resourceVersion="10"))
    # status churn changes resourceVersion only
    assert cache.unchanged(desired, obj("Deployment", generation=3, uid="u", resourceVersion="11"))
    assert not cache.unchanged(desired, obj("Deployment", generation=4, uid="u"))  # spec edited
    relabelled = obj("Deployment", generation=3, uid="u")
    relabelled["metadata"]["labels"] = {"l": "hijacked"}
    assert not cache.unchanged(desired, relabelled)
    assert not cache.unchanged(desired, obj("Deployment", generation=3, uid="recreated"))
    cache.forget("Deployment", "n", "a")
    assert not cache.unchanged(desired, obj("Deployment", generation=3, uid="u"))
