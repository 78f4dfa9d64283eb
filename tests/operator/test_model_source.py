"""spec.model's sources of weights (image, claim, builtin): the CRD refuses contradictions and
names the field, specs from before the sources stay valid, the builders render the volume,
the mount and --model, and the model's identity enters the compile-cache key."""

from __future__ import annotations

import copy
import json
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from atomd_helpers import IMAGE, OWNER, SPECS, spec
from test_crd_rules import SCHEMA, violations

from atom.cli.args import build_parser
from atom_operator import builders, crdgen, models, runtime_args
from atom_operator.snapshot import Snapshot

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
GOLDEN = Path(__file__).parent / "golden" / "model-image.yaml"
REF = "localhost/atom-model-smollm2:0.1.2"
DIGEST = "sha256:" + "ab" * 32
FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
IMAGE_SPEC: dict[str, Any] = {
    "device": "cpu",
    "model": {"name": "smollm2", "image": {"reference": REF, "path": FILE}, "dtype": "float32"},
}

# case: (spec.model, field the error names, words of its message)
REFUSED: dict[str, tuple[dict[str, Any], str, str]] = {
    "no source": ({"dtype": "float32"}, "spec.model", "model needs a source of weights"),
    "image and claim": (
        {"image": {"reference": REF}, "claim": {"name": "weights"}},
        "spec.model.claim",
        "model.claim is not allowed with model.image",
    ),
    "image and builtin": (
        {"image": {"reference": REF}, "builtin": "smollm2-135m-instruct"},
        "spec.model.builtin",
        "model.builtin is not allowed with model.image",
    ),
    "claim and builtin": (
        {"claim": {"name": "weights"}, "builtin": "smollm2-135m-instruct"},
        "spec.model.builtin",
        "model.builtin is not allowed with model.claim",
    ),
    "legacy path beside an image": (
        {"image": {"reference": REF}, "path": "/models/x"},
        "spec.model.path",
        "model.path (a directory in the container) is not allowed",
    ),
    "legacy path beside a builtin": (
        {"builtin": "smollm2-135m-instruct", "path": "/models/x"},
        "spec.model.path",
        "model.path (a directory in the container) is not allowed",
    ),
    "volume beside a claim": (
        {"claim": {"name": "weights"}, "volume": {"emptyDir": {}}},
        "spec.model.volume",
        "model.volume is not allowed",
    ),
    "random weights from an image": (
        {"image": {"reference": REF}, "loadFormat": "dummy"},
        "spec.model.loadFormat",
        "model.loadFormat dummy (random weights) contradicts",
    ),
    "absolute image path": (
        {"image": {"reference": REF, "path": "/etc/passwd"}},
        "spec.model.image.path",
        "model.image.path is relative to the image's root",
    ),
    "claim path climbing out": (
        {"claim": {"name": "weights", "path": "models/../../x"}},
        "spec.model.claim.path",
        "model.claim.path is relative to the claim's root",
    ),
    "claim path of '..'": (
        {"claim": {"name": "weights", "path": ".."}},
        "spec.model.claim.path",
        "no leading '/' and no '..'",
    ),
}

ACCEPTED: dict[str, dict[str, Any]] = {
    "image": {"image": {"reference": REF}},
    "image with path and policy": {
        "name": "smollm2",
        "image": {"reference": f"{REF}@{DIGEST}", "path": FILE, "pullPolicy": "Never"},
    },
    "claim": {"claim": {"name": "weights"}},
    "claim with a nested path": {"claim": {"name": "weights", "path": "org/model..v2/file.gguf"}},
    "builtin": {"builtin": "smollm2-135m-instruct"},
    "builtin with a served name": {"builtin": "smollm2-135m-instruct", "name": "chat"},
}


def _with_model(model: dict[str, Any]) -> dict[str, Any]:
    return {"model": copy.deepcopy(model)}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_contradictions_are_refused_naming_the_field(case: str) -> None:
    model, field, words = REFUSED[case]
    found = violations(_with_model(model))
    assert any(f == field and words in m for f, m in found), (case, found)


@pytest.mark.parametrize("case", sorted(ACCEPTED))
def test_one_source_is_accepted(case: str) -> None:
    assert violations(_with_model(ACCEPTED[case])) == []


def _legacy_specs() -> dict[str, dict[str, Any]]:
    """Specs written before the sources: the unit fixtures and every example's model."""
    out = {f"fixture {name}": copy.deepcopy(body) for name, body in SPECS.items()}
    # the CPU example before it took the model image
    out["tiny-cpu"] = {"device": "cpu", "model": {"name": "tiny-llama", "loadFormat": "dummy"}}
    for path in sorted(EXAMPLES.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc.get("kind") != models.KIND:
                continue
            if not {"image", "claim", "builtin"} & doc["spec"]["model"].keys():
                out[f"example {path.name} {doc['metadata']['name']}"] = doc["spec"]
    return out


LEGACY = _legacy_specs()


@pytest.mark.parametrize("case", sorted(LEGACY))
def test_specs_from_before_the_sources_stay_valid(case: str) -> None:
    assert violations(copy.deepcopy(LEGACY[case])) == []


def test_every_source_is_documented_for_kubectl_explain() -> None:
    model = SCHEMA["properties"]["spec"]["properties"]["model"]
    props = model["properties"]
    for source in ("image", "claim", "builtin"):
        assert props[source]["description"].startswith("Source of weights:"), source
    for field in ("reference", "path", "pullPolicy"):
        assert props["image"]["properties"][field]["description"], field
    assert props["image"]["required"] == ["reference"]
    assert props["claim"]["required"] == ["name"]
    assert props["image"]["properties"]["pullPolicy"]["enum"] == ["Always", "IfNotPresent", "Never"]


def _render(model: dict[str, Any], **changes: Any) -> tuple[dict[str, Any], Any]:
    s = spec({**IMAGE_SPEC, "model": model, **changes})
    pod = builders.runtime.pod_spec(OWNER, s, "unified", IMAGE, "k")
    ns = build_parser().parse_args(runtime_args.render_args(s, "unified", cache_dir=None))
    return pod, ns


def _model_volume(pod: dict[str, Any]) -> dict[str, Any] | None:
    return next((v for v in pod["volumes"] if v["name"] == "model"), None)


def _model_mount(pod: dict[str, Any]) -> dict[str, Any] | None:
    mounts = pod["containers"][0]["volumeMounts"]
    return next((m for m in mounts if m["name"] == "model"), None)


def test_image_is_an_image_volume_mounted_read_only() -> None:
    pod, ns = _render(
        {"name": "smollm2", "image": {"reference": REF, "path": FILE, "pullPolicy": "Never"}}
    )
    assert _model_volume(pod) == {
        "name": "model",
        "image": {"reference": REF, "pullPolicy": "Never"},
    }
    assert _model_mount(pod) == {"name": "model", "mountPath": "/models", "readOnly": True}
    assert ns.model == f"/models/{FILE}" and ns.served_model_name == "smollm2"
    assert ns.load_format == "auto"


def test_image_without_path_or_policy_passes_the_mount_and_kubernetes_defaults() -> None:
    pod, ns = _render({"image": {"reference": REF}})
    assert _model_volume(pod) == {"name": "model", "image": {"reference": REF}}
    assert ns.model == "/models" and ns.served_model_name is None


def test_claim_is_mounted_read_only() -> None:
    pod, ns = _render({"name": "m", "claim": {"name": "weights", "path": "llama/8b"}})
    assert _model_volume(pod) == {
        "name": "model",
        "persistentVolumeClaim": {"claimName": "weights", "readOnly": True},
    }
    assert _model_mount(pod) == {"name": "model", "mountPath": "/models", "readOnly": True}
    assert ns.model == "/models/llama/8b" and ns.served_model_name == "m"


def test_builtin_mounts_nothing_and_names_itself() -> None:
    pod, ns = _render({"builtin": "smollm2-135m-instruct"})
    assert _model_volume(pod) is None and _model_mount(pod) is None
    assert ns.model == "smollm2-135m-instruct" and ns.served_model_name is None
    _, named = _render({"builtin": "smollm2-135m-instruct", "name": "chat"})
    assert named.served_model_name == "chat"


def test_legacy_fields_render_as_before() -> None:
    pod, ns = _render({"name": "tiny-llama", "loadFormat": "dummy"})
    assert _model_volume(pod) is None and ns.model == "tiny-llama" and ns.served_model_name is None
    legacy = {
        "name": "q",
        "path": "/models/q",
        "volume": {"persistentVolumeClaim": {"claimName": "w"}},
    }
    pod, ns = _render(legacy)
    assert _model_volume(pod) == {"name": "model", "persistentVolumeClaim": {"claimName": "w"}}
    assert ns.model == "/models/q" and ns.served_model_name == "q"


def _key(model: dict[str, Any]) -> str:
    return runtime_args.cache_key(spec({**IMAGE_SPEC, "model": model}), "unified", IMAGE)


def test_image_digest_is_the_identity_where_given() -> None:
    pinned = _key({"image": {"reference": f"{REF}@{DIGEST}", "path": FILE}})
    retagged = _key({"image": {"reference": f"mirror.example/smollm2:9@{DIGEST}", "path": FILE}})
    assert pinned == retagged  # same digest, same weights: one cache
    other = _key({"image": {"reference": f"{REF}@sha256:{'cd' * 32}", "path": FILE}})
    assert other != pinned
    assert runtime_args.image_identity(f"{REF}@{DIGEST}") == DIGEST
    assert runtime_args.image_identity(REF) == REF


def test_reference_path_claim_and_builtin_each_move_the_key() -> None:
    keys = {
        _key({"image": {"reference": REF, "path": FILE}}),
        _key({"image": {"reference": REF.replace("0.1.2", "0.1.3"), "path": FILE}}),
        _key({"image": {"reference": REF, "path": "other.gguf"}}),
        _key({"claim": {"name": "weights", "path": FILE}}),
        _key({"claim": {"name": "weights", "path": "other.gguf"}}),
        _key({"claim": {"name": "other", "path": FILE}}),
        _key({"builtin": "smollm2-135m-instruct"}),
        _key({"name": "smollm2-135m-instruct"}),  # the same name through the legacy field
    }
    assert len(keys) == 8


def test_served_name_and_pull_policy_change_no_compiled_code() -> None:
    base = _key({"image": {"reference": REF, "path": FILE}})
    assert _key({"name": "chat", "image": {"reference": REF, "path": FILE}}) == base
    assert _key({"image": {"reference": REF, "path": FILE, "pullPolicy": "Always"}}) == base
    assert _key({"builtin": "smollm2-135m-instruct", "name": "a"}) == _key(
        {"builtin": "smollm2-135m-instruct"}
    )


def test_legacy_identity_keeps_its_fields() -> None:
    # The key of every spec from before the sources is unchanged (the goldens pin its value).
    s = spec("disaggregated")
    assert runtime_args.model_identity(s.model) == {
        "name": "qwen3-0.6b",
        "path": "/models/qwen3",
        "loadFormat": "auto",
    }


def test_model_image_children_match_golden() -> None:
    body = {**IMAGE_SPEC, "nodeSelector": {"type": "real"}}
    text = yaml.safe_dump_all(builders.plan(OWNER, spec(body), IMAGE, Snapshot()).apply,
                              sort_keys=True)  # fmt: skip
    if os.environ.get("UPDATE_GOLDEN"):
        GOLDEN.write_text(text)
    assert GOLDEN.exists(), f"missing golden {GOLDEN}: run with UPDATE_GOLDEN=1"
    assert list(yaml.safe_load_all(GOLDEN.read_text())) == list(yaml.safe_load_all(text))


# --- the same judgments by a real API server (hack/controlplane install) -------------------


@pytest.fixture(scope="module")
def api(cluster: Any) -> Iterator[tuple[Any, str]]:
    from atom_devtools.devcluster.crds import wait_crd_established

    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(crdgen.CRD_PATH))
    wait_crd_established(cluster.kubectl, f"{models.PLURAL}.{models.GROUP}")
    namespace = f"model-{uuid.uuid4().hex[:8]}"
    cluster.kubectl("create", "namespace", namespace)
    yield cluster, namespace
    cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


def _dry_run(api: tuple[Any, str], body: dict[str, Any]) -> Any:
    cluster, namespace = api
    doc = {
        "apiVersion": f"{models.GROUP}/{models.VERSION}",
        "kind": models.KIND,
        "metadata": {"name": "model", "namespace": namespace},
        "spec": body,
    }
    return cluster.kubectl("apply", "--dry-run=server", "-o", "json", "-f", "-",
                           input=json.dumps(doc), check=False)  # fmt: skip


@pytest.mark.slow
def test_api_server_refuses_each_contradiction_and_keeps_old_specs(api: tuple[Any, str]) -> None:
    for case, (model, field, words) in REFUSED.items():
        result = _dry_run(api, _with_model(model))
        assert result.returncode != 0, case
        assert field in result.stderr and words in result.stderr, (case, result.stderr)
    for case, model in ACCEPTED.items():
        result = _dry_run(api, _with_model(model))
        assert result.returncode == 0, (case, result.stderr)
    for case, body in LEGACY.items():
        result = _dry_run(api, copy.deepcopy(body))
        assert result.returncode == 0, (case, result.stderr)


def test_cpu_example_mounts_the_model_image() -> None:
    doc = yaml.safe_load((EXAMPLES / "atomdeployment-cpu.yaml").read_text())
    assert violations(copy.deepcopy(doc["spec"])) == []
    s = models.AtomDeploymentSpec.model_validate(doc["spec"])
    assert s.model.source == "image" and s.model.image is not None
    assert s.model.image.reference.startswith("localhost/atom-model-smollm2:")
    pod = builders.runtime.pod_spec(OWNER, s, "unified", IMAGE, "k")
    assert _model_volume(pod) == {"name": "model", "image": {"reference": s.model.image.reference}}
    args = runtime_args.render_args(s, "unified", cache_dir=None)
    assert args[args.index("--model") + 1] == f"/models/{FILE}"


def _waiting_pod(volumes: list[dict[str, Any]], reason: str, message: str) -> dict[str, Any]:
    status = {
        "image": IMAGE,
        "ready": False,
        "state": {"waiting": {"reason": reason, "message": message}},
    }
    return {
        "metadata": {"name": "demo-unified-0", "labels": {"atom.dev/role": "unified"}},
        "spec": {"volumes": volumes},
        "status": {"phase": "Pending", "containerStatuses": [status]},
    }


def test_a_model_image_pull_failure_names_the_model_image() -> None:
    from atom_operator import problems

    missing = "localhost/atom-model-missing:0.0.0"
    volume = {"name": "model", "image": {"reference": missing}}
    message = f'Back-off pulling image "{missing}": ErrImagePull: not found'
    found = problems.containers(
        Snapshot(pods=[_waiting_pod([volume], "ImagePullBackOff", message)])
    )
    assert [p.reason for p in found] == ["ImagePullFailed"]
    assert f"cannot pull image {missing} (image volume model): ImagePullBackOff" in found[0].message
    # the runtime image's own failure still names the runtime image
    runtime = f'Back-off pulling image "{IMAGE}": not found'
    found = problems.containers(
        Snapshot(pods=[_waiting_pod([volume], "ImagePullBackOff", runtime)])
    )
    assert f"cannot pull image {IMAGE}: ImagePullBackOff" in found[0].message
