"""Kopf handlers: thin triggers around `runner.run_one` (one level-triggered reconcile).

create / update / resume of an AtomDeployment reconcile it; an event on any child requeues its
owner; a periodic resync pass reconciles everything (`background`). No delete handler and no
timer: children carry ownerReferences for the garbage collector, and no Kopf finalizer is added.
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Any

import kopf

from atom_operator import metrics, models, naming
from atom_operator.background import Background
from atom_operator.kube import Kube
from atom_operator.leader import AlwaysLeader, LeaderElector
from atom_operator.runner import latency_summary, run_one
from atom_operator.settings import Settings

SETTINGS = Settings.from_env()
RESOURCE = (models.GROUP, models.VERSION, models.PLURAL)
CHILD_RESOURCES = [
    ("apps", "v1", "deployments"),
    ("batch", "v1", "jobs"),
    ("", "v1", "pods"),
    ("", "v1", "services"),
    ("", "v1", "configmaps"),
    ("", "v1", "persistentvolumeclaims"),
    ("policy", "v1", "poddisruptionbudgets"),
    ("networking.k8s.io", "v1", "networkpolicies"),
]
OURS = {naming.LABEL_MANAGED_BY: naming.MANAGED_BY}
_state: dict[str, Any] = {}


class DigestDiffBaseStorage(kopf.AnnotationsDiffBaseStorage):
    """Store a digest of the last handled essence instead of the essence itself: Kopf only needs
    to know *that* something changed (the reconcile reads no diff), and a digest never
    overflows the 256 KiB annotation limit however large the spec is."""

    def build(self, *, body: kopf.Body, extra_fields: Any = None) -> kopf.BodyEssence:
        essence = super().build(body=body, extra_fields=extra_fields)
        blob = json.dumps(essence, sort_keys=True, separators=(",", ":"))
        return {"digest": hashlib.sha256(blob.encode()).hexdigest()}  # type: ignore[return-value]


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, logger: logging.Logger, **_: Any) -> None:
    settings.persistence.diffbase_storage = DigestDiffBaseStorage(
        prefix=models.GROUP, key="last-handled-digest"
    )
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=models.GROUP)
    settings.persistence.finalizer = f"{models.GROUP}/finalizer"  # unused: no handler needs one
    settings.posting.level = logging.WARNING  # no event per successful reconcile
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.execution.max_workers = 16
    kube = Kube.from_environment()
    _state["kube"] = kube
    if SETTINGS.leader_election:
        leader: LeaderElector | AlwaysLeader = LeaderElector(
            kube,
            namespace=SETTINGS.lease_namespace,
            name=SETTINGS.lease_name,
            identity=SETTINGS.identity,
            lease_s=SETTINGS.lease_seconds,
            renew_deadline_s=SETTINGS.lease_seconds * 2 / 3,
            # Handlers skipped while standing by: the new leader reconciles everything.
            on_elected=lambda: _state["background"].resync_now(),
            logger=logger,
        )
    else:
        leader = AlwaysLeader()
    _state["leader"] = leader
    _state["background"] = bg = Background(
        kube,
        namespaces=SETTINGS.namespaces,
        interval=SETTINGS.reconcile_interval,
        default_image=SETTINGS.default_image,
        logger=logger,
        allow_host_volumes=SETTINGS.allow_host_volumes,
        leader=leader,
    )
    bg.start()
    leader.start()
    if SETTINGS.metrics_port:
        try:
            _state["metrics"] = metrics.serve(SETTINGS.metrics_port, lambda: leader.leading)
        except OSError as exc:  # a port in use must not stop the operator
            logger.warning("metrics on :%s not served: %s", SETTINGS.metrics_port, exc)
    logger.info(
        "atom-operator: resync every %ss, default image %s",
        SETTINGS.reconcile_interval,
        SETTINGS.default_image,
    )


@kopf.on.cleanup()
def shutdown(**_: Any) -> None:
    if "leader" in _state:
        _state["leader"].release()
    if "background" in _state:
        _state["background"].shutdown()
    if "metrics" in _state:
        _state["metrics"].shutdown()


@kopf.on.create(*RESOURCE, backoff=5)
@kopf.on.update(*RESOURCE, backoff=5)
@kopf.on.resume(*RESOURCE, backoff=5)
def on_change(
    meta: kopf.Meta,
    spec: kopf.Spec,
    status: kopf.Status,
    patch: kopf.Patch,
    logger: logging.Logger,
    **_: Any,
) -> None:
    if not _state["leader"].leading:
        return  # another replica acts; this one reconciles everything once elected
    outcome = run_one(
        _state["kube"],
        meta=meta,
        spec=spec,
        status=status,
        default_image=SETTINGS.default_image,
        logger=logger,
        allow_host_volumes=SETTINGS.allow_host_volumes,
    )
    if outcome.patch:
        patch.status.update(outcome.patch)
    _state["background"].retry(meta["namespace"], meta["name"], outcome.retry_in)


def _child_changed(body: kopf.Body, **_: Any) -> None:
    """Requeue the owner named by the child's instance label (retained PVCs have no owner
    reference, so the label is the link)."""
    owner = (body.metadata.labels or {}).get(naming.LABEL_INSTANCE)
    if owner and "background" in _state:
        _state["background"].requeue.add(body.metadata.namespace, owner)


for _group, _version, _plural in CHILD_RESOURCES:
    kopf.on.event(_group, _version, _plural, labels=OURS, id=f"child-{_plural}")(_child_changed)


@kopf.on.probe(id="reconcile")
def probe_reconcile(**_: Any) -> dict[str, float]:
    """Reconcile count and latency percentiles (seconds), served on /healthz for the benchmark."""
    return latency_summary()
