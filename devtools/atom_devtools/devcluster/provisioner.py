"""A hostPath volume provisioner for the real node (`python -m ...provisioner`, stdlib only).

Every Pending claim of its StorageClass gets a directory under --root and a PersistentVolume
bound to that claim (hostPath, node affinity to the real node); a Released volume of the class
whose reclaim policy is Delete loses its directory and its object. Polls: a local cluster has
a handful of claims, and polling needs no watch bookkeeping.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
import time
from pathlib import Path

from .api import ApiClient

PROVISIONER = "atom.dev/local-path"


def _client(kubeconfig: str) -> ApiClient:
    config = json.loads(Path(kubeconfig).read_text())
    cluster = config["clusters"][0]["cluster"]
    return ApiClient(
        cluster["server"], config["users"][0]["user"]["token"], cluster.get("certificate-authority")
    )


def volume(claim: dict, path: Path, node: str, storage_class: str, reclaim: str) -> dict:
    meta = claim["metadata"]
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {
            "name": f"pvc-{meta['uid']}",
            "annotations": {"pv.kubernetes.io/provisioned-by": PROVISIONER},
        },
        "spec": {
            "capacity": {"storage": claim["spec"]["resources"]["requests"]["storage"]},
            "accessModes": claim["spec"].get("accessModes") or ["ReadWriteOnce"],
            "persistentVolumeReclaimPolicy": reclaim,
            "storageClassName": storage_class,
            "hostPath": {"path": str(path), "type": "DirectoryOrCreate"},
            "claimRef": {
                "apiVersion": "v1",
                "kind": "PersistentVolumeClaim",
                "namespace": meta["namespace"],
                "name": meta["name"],
                "uid": meta["uid"],
            },
            "nodeAffinity": {
                "required": {
                    "nodeSelectorTerms": [
                        {
                            "matchExpressions": [
                                {
                                    "key": "kubernetes.io/hostname",
                                    "operator": "In",
                                    "values": [node],
                                }
                            ]
                        }
                    ]
                }
            },
        },
    }


def sync(api: ApiClient, root: Path, node: str, storage_class: str) -> None:
    status, classes = api.get(f"/apis/storage.k8s.io/v1/storageclasses/{storage_class}")
    reclaim = classes.get("reclaimPolicy", "Delete") if status == 200 else "Delete"
    status, claims = api.get("/api/v1/persistentvolumeclaims")
    if status != 200:
        return
    for claim in claims.get("items", []):
        spec, meta = claim["spec"], claim["metadata"]
        if (
            spec.get("storageClassName") != storage_class
            or spec.get("volumeName")
            or claim.get("status", {}).get("phase") != "Pending"
            or meta.get("deletionTimestamp")
        ):
            continue
        path = root / f"{meta['namespace']}_{meta['name']}_{meta['uid']}"
        path.mkdir(parents=True, exist_ok=True)
        path.chmod(0o777)  # the runtime image runs as a non-root user
        code, body = api.create(
            "/api/v1/persistentvolumes", volume(claim, path, node, storage_class, reclaim)
        )
        if code not in (200, 201, 409):
            print(
                f"creating the volume of {meta['namespace']}/{meta['name']}: {code} {body}",
                file=sys.stderr,
                flush=True,
            )
        else:
            print(f"provisioned {path} for {meta['namespace']}/{meta['name']}", flush=True)
    status, volumes = api.get("/api/v1/persistentvolumes")
    for pv in volumes.get("items", []) if status == 200 else []:
        spec = pv["spec"]
        if (
            spec.get("storageClassName") != storage_class
            or pv.get("status", {}).get("phase") != "Released"
            or spec.get("persistentVolumeReclaimPolicy") != "Delete"
        ):
            continue
        path = Path(spec["hostPath"]["path"])
        if path.is_relative_to(root):
            shutil.rmtree(path, ignore_errors=True)
        api.request("DELETE", f"/api/v1/persistentvolumes/{pv['metadata']['name']}")
        print(f"deleted {path} ({pv['metadata']['name']} released)", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--root", required=True, type=Path)
    parser.add_argument("--node", required=True)
    parser.add_argument("--class", dest="storage_class", required=True)
    parser.add_argument("--interval", type=float, default=0.5)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    api = _client(args.kubeconfig)
    while True:
        try:
            sync(api, args.root, args.node, args.storage_class)
        except OSError as exc:  # the API server restarting or going away: try again
            print(f"sync failed: {exc}", file=sys.stderr, flush=True)
        time.sleep(args.interval)


if __name__ == "__main__":
    sys.exit(main())
