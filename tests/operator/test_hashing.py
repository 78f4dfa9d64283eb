"""Revision and compile-cache key: what moves them and what never does."""

from __future__ import annotations

from atomd_helpers import IMAGE, OWNER, spec

from atom_operator import builders
from atom_operator.builders import Owner
from atom_operator.snapshot import Snapshot


def rev_and_keys(s, owner: Owner = OWNER, image: str = IMAGE) -> tuple[str, dict[str, str]]:
    p = builders.plan(owner, s, image, Snapshot())
    return p.revision, p.cache_keys


def test_replicas_change_nothing() -> None:
    assert rev_and_keys(spec("unified", replicas=1)) == rev_and_keys(spec("unified", replicas=7))
    a = spec("disaggregated")
    b = spec(
        "disaggregated",
        disaggregation={
            "prefill": {"replicas": 5},
            "decode": {"replicas": 4},
            "router": {"replicas": 3},
        },
    )
    assert rev_and_keys(a) == rev_and_keys(b)


def test_cache_key_ignores_instance_name_namespace_and_uid() -> None:
    other = Owner(name="another", namespace="elsewhere", uid="ffff")
    assert rev_and_keys(spec("unified"))[1] == rev_and_keys(spec("unified"), owner=other)[1]


def test_graph_mode_sizes_and_level_move_both() -> None:
    base = rev_and_keys(spec("unified"))
    for comp in (
        {"cudagraphMode": "FULL"},
        {"cudagraphCaptureSizes": [1, 2]},
        {"level": 2},
    ):
        changed = rev_and_keys(spec("unified", compilation=comp))
        assert changed[0] != base[0], comp
        assert changed[1]["unified"] != base[1]["unified"], comp


def test_restart_id_rolls_pods_but_keeps_the_cache() -> None:
    base = rev_and_keys(spec("unified"))
    restarted = rev_and_keys(spec("unified", restartId="again"))
    assert restarted[0] != base[0] and restarted[1] == base[1]


def test_sizes_ignored_under_none_do_not_split_the_cache() -> None:
    a = rev_and_keys(spec("unified", compilation={"cudagraphMode": "NONE"}))
    b = rev_and_keys(
        spec("unified", compilation={"cudagraphMode": "NONE", "cudagraphCaptureSizes": [1, 2, 4]})
    )
    assert a == b


def test_image_changes_both() -> None:
    a, b = rev_and_keys(spec("unified")), rev_and_keys(spec("unified"), image="other:2")
    assert a[0] != b[0] and a[1] != b[1]


def test_prefill_and_decode_share_one_revision() -> None:
    p = builders.plan(OWNER, spec("disaggregated"), IMAGE, Snapshot())
    revisions = {
        o["spec"]["template"]["metadata"]["labels"]["atom.dev/revision"]
        for o in p.apply
        if o["kind"] == "Deployment"
        and "runtime" == o["metadata"]["labels"]["app.kubernetes.io/component"]
    }
    assert revisions == {p.revision}
