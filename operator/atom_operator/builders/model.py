"""The model's volume and its read-only mount at /models (none for a built-in model)."""

from __future__ import annotations

from typing import Any

from atom_operator import naming
from atom_operator.model_spec import ModelSource

VOLUME_NAME = "model"


def model_volume(model: ModelSource) -> dict[str, Any] | None:
    """An image volume for model.image, the claim (read-only) for model.claim, model.volume
    as it is given; None when the runtime image holds the weights or no weights are loaded."""
    if model.image is not None:
        image: dict[str, Any] = {"reference": model.image.reference}
        if model.image.pull_policy is not None:
            image["pullPolicy"] = model.image.pull_policy
        return {"name": VOLUME_NAME, "image": image}
    if model.claim is not None:
        claim = {"claimName": model.claim.name, "readOnly": True}
        return {"name": VOLUME_NAME, "persistentVolumeClaim": claim}
    if model.volume is not None:
        return {"name": VOLUME_NAME, **model.volume}
    return None


def model_mount(model: ModelSource) -> dict[str, Any] | None:
    if model_volume(model) is None:
        return None
    return {"name": VOLUME_NAME, "mountPath": naming.MODEL_MOUNT, "readOnly": True}
