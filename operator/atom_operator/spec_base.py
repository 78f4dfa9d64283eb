"""The base of every spec and status model: camelCase aliases, and opaque Kubernetes objects.

Its own module so the spec's parts (`spec`, `model_spec`, `status_models`) share it without
importing one another in a circle.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

# Kubernetes-native sub-objects (volume source, resources, ...) are passed through untouched.
OPAQUE: dict[str, Any] = {"x-kubernetes-preserve-unknown-fields": True}


class CamelModel(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")


def opaque_object(description: str) -> Any:
    return Field(default=None, description=description, json_schema_extra=OPAQUE)
