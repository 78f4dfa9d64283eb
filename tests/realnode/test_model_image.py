"""spec.model.image on a real node: the kubelet mounts the model image (hack/images: FROM
scratch + the SmolLM2 GGUF) read-only as an image volume, the runtime loads the GGUF from it and
answers a question; a model image that cannot be pulled turns the AtomDeployment Degraded with
the pull's reason.

Level 0 and no compile cache: the pods start as fast as the model loads."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from realnode_helpers import EXAMPLE, NAMESPACE, apply, atomd, pod_ready, runtime_pods

from atom_devtools.kubectl import Kubectl, is_ready
from testutil import wait_for

pytestmark = [pytest.mark.realnode, pytest.mark.slow]

READY_TIMEOUT = 600
IMAGE = EXAMPLE["spec"]["model"]["image"]


def manifest(name: str, image: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(EXAMPLE)
    out["metadata"] = {"name": name, "namespace": NAMESPACE}
    out["spec"]["model"]["image"] = image
    out["spec"]["compilation"] = {"level": 0}
    out["spec"]["compileCache"] = {"enabled": False}
    return out


def degraded(kubectl: Kubectl, name: str) -> dict[str, Any] | None:
    conditions = atomd(kubectl, name).get("status", {}).get("conditions") or []
    cond = next((c for c in conditions if c["type"] == "Degraded"), None)
    return cond if cond and cond["status"] == "True" else None


def test_model_image_pod_is_ready_and_answers(operator_release: str, kubectl: Kubectl) -> None:
    from openai import OpenAI

    name = "smollm2-image"
    apply(kubectl, manifest(name, IMAGE))
    try:
        wait_for(
            f"atomd/{name} Ready",
            lambda: is_ready(atomd(kubectl, name)) and all(map(pod_ready, runtime_pods(kubectl, name))),
            timeout=READY_TIMEOUT,
            interval=2,
        )  # fmt: skip
        pod = runtime_pods(kubectl, name)[0]
        volume = next(v for v in pod["spec"]["volumes"] if v["name"] == "model")
        assert volume["image"]["reference"] == IMAGE["reference"]
        args = pod["spec"]["containers"][0]["args"]
        assert args[args.index("--model") + 1] == f"/models/{IMAGE['path']}"
        svc = kubectl.json("service", name, "-n", NAMESPACE)
        client = OpenAI(base_url=f"http://{svc['spec']['clusterIP']}:8000/v1", api_key="unused",
                        max_retries=0, timeout=120)  # fmt: skip
        chat = client.chat.completions.create(
            model=EXAMPLE["spec"]["model"]["name"],
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=32,
            temperature=0.0,
        )
        choice = chat.choices[0]
        assert "Paris" in (choice.message.content or ""), choice
        assert choice.finish_reason == "stop", choice  # <|im_end|> ends the turn
    finally:
        kubectl("delete", "atomd", name, "-n", NAMESPACE, "--wait=false", check=False)


@pytest.mark.parametrize(
    ("name", "image", "reasons"),
    [
        # nothing under that tag: the kubelet tries to pull it and fails, then backs off
        (
            "smollm2-missing",
            {"reference": "localhost/atom-model-missing:0.0.0"},
            ("ErrImagePull", "ImagePullBackOff"),
        ),
        # a wrong tag of the right image, never pulled
        (
            "smollm2-wrong-tag",
            {"reference": "localhost/atom-model-smollm2:9.9.9", "pullPolicy": "Never"},
            ("ErrImageNeverPull",),
        ),
    ],
)
def test_model_image_that_cannot_be_pulled_is_degraded_with_the_pull_reason(
    operator_release: str, kubectl: Kubectl, name: str, image: dict[str, Any],
    reasons: tuple[str, ...],
) -> None:  # fmt: skip
    apply(kubectl, manifest(name, image))
    try:
        cond = wait_for(f"atomd/{name} Degraded", lambda: degraded(kubectl, name),
                        timeout=180, interval=2)  # fmt: skip
        assert cond["reason"] == "ImagePullFailed", cond
        assert image["reference"] in cond["message"], cond
        assert any(r in cond["message"] for r in reasons), cond
        assert not is_ready(atomd(kubectl, name))
    finally:
        kubectl("delete", "atomd", name, "-n", NAMESPACE, "--wait=false", check=False)
