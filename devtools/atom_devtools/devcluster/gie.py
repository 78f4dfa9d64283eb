"""The Gateway API Inference Extension's InferencePool CRD (inference.networking.k8s.io/v1),
copied from its Go module (fetched with `go mod download`, nothing built) into the cache, so
tests validate the operator's InferencePool against the upstream schema on a real API server."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from . import gotool, versions
from .build import publish
from .cache import Component
from .errors import ProvisionError

GIE = Component("gateway-api-inference-extension", versions.GATEWAY_API_INFERENCE_EXTENSION, ())
MODULE = "sigs.k8s.io/gateway-api-inference-extension"
CRD = "config/crd/bases/inference.networking.k8s.io_inferencepools.yaml"


def install_gie(go: str) -> None:
    comp, version = GIE, versions.GATEWAY_API_INFERENCE_EXTENSION
    wd, log = comp.build_dir, comp.build_dir / "build.log"
    wd.mkdir(parents=True, exist_ok=True)
    info = json.loads(gotool.run([go, "mod", "download", "-json", f"{MODULE}@{version}"],
                                 what=f"download of {MODULE}@{version}", log=log, cwd=wd))
    src = Path(info["Dir"]) / CRD
    if not src.is_file():
        raise ProvisionError(f"{CRD} missing from {MODULE}@{version} at {info['Dir']}")
    crds = wd / "crds"
    shutil.rmtree(crds, ignore_errors=True)
    crds.mkdir()
    shutil.copyfile(src, crds / src.name)
    out = wd / "out"
    out.mkdir(exist_ok=True)
    publish(comp, out, {"crd": f"{MODULE}@{version}/{CRD}"}, {"crds": crds})


def inference_pool_crd() -> Path:
    """The cached upstream InferencePool CRD (install it with `hack/controlplane install
    --addons`)."""
    return GIE.bin_dir / "crds" / Path(CRD).name
