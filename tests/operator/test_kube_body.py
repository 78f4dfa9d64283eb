"""Apply bodies are UTF-8 JSON: characters outside the Basic Multilingual Plane survive."""

from __future__ import annotations

import json

import yaml

from atom_operator.kube import apply_body


def test_non_bmp_characters_are_sent_raw_not_as_surrogate_escapes() -> None:
    obj = {"data": {"model": "/models/🦙-llama", "note": "ü"}}
    body = apply_body(obj)
    assert b"\\ud83e" not in body and "🦙".encode() in body
    # the API server reads apply bodies as YAML: the body is the same object as YAML
    assert yaml.safe_load(body.decode("utf-8")) == obj
    # what the client would otherwise send: escapes that a YAML parser reads one by one
    assert "\\ud83e\\udd99" in json.dumps(obj)
