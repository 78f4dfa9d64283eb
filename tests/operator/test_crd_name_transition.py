"""The metadata.name rules refuse new objects only (issue 49): an object an earlier CRD
accepted keeps its name through every update, so a CRD upgrade never strands it."""

from __future__ import annotations

import pytest
from test_crd_rules import holds

from atom_operator import crd_rules


@pytest.mark.parametrize("name", ["7b-llama", "with.dots", "Upper", "x" * 64])
def test_a_name_refused_on_create_passes_every_update_that_keeps_it(name: str) -> None:
    new = {"metadata": {"name": name}, "spec": {"replicas": 2}}
    old = {"metadata": {"name": name}, "spec": {"replicas": 1}}
    rules = crd_rules.root_rules()
    assert not all(holds(str(r["rule"]), new) for r in rules)  # a create
    assert all(holds(str(r["rule"]), new, old=old) for r in rules)  # an update


def test_valid_names_pass_create_and_update_and_the_rules_are_transition_rules() -> None:
    obj = {"metadata": {"name": "llama-7b"}}
    for rule in crd_rules.root_rules():
        assert rule["optionalOldSelf"] is True and "oldSelf" in str(rule["rule"])
        assert holds(str(rule["rule"]), obj) and holds(str(rule["rule"]), obj, old=obj)
