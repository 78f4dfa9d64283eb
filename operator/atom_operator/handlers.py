"""Kopf handlers: thin triggers around `Reconciler.run` (one level-triggered reconcile).

create / update / resume of an AtomDeployment reconcile it; an event on any child requeues its
owner (found by owner reference or instance label, so a child whose managed-by label was edited
is still seen, and restored within seconds); a periodic resync pass reconciles everything (`background`); a deleted object is
forgotten. No timer and no delete handler: children carry ownerReferences for the garbage
collector, and no Kopf finalizer is added.
What `configure` starts lives in Kopf's memo, not in module globals.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from http.server import ThreadingHTTPServer
from typing import Any

import kopf

from atom_operator import metrics, naming
from atom_operator.background import Background
from atom_operator.kube import Kube
from atom_operator.leader import AlwaysLeader, LeaderElector
from atom_operator.logs import Logger
from atom_operator.reconciler import Reconciler
from atom_operator.settings import Settings
from atom_operator.spec import GROUP, KIND, PLURAL, VERSION

RESOURCE = (GROUP, VERSION, PLURAL)
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
MEMO_KEY = "operator"


@dataclass
class Operator:
    """What `configure` starts and `shutdown` stops."""

    reconciler: Reconciler
    background: Background
    leader: LeaderElector | AlwaysLeader
    metrics: ThreadingHTTPServer | None = None


def _operator(memo: Any) -> Operator | None:
    """The running operator (None before `configure` has run). Kopf types each handler's memo
    as Any (the operator's own object, a `kopf.Memo` by default)."""
    found = memo.get(MEMO_KEY)
    return found if isinstance(found, Operator) else None


class DigestDiffBaseStorage(kopf.AnnotationsDiffBaseStorage):
    """Store a digest of the last handled essence instead of the essence itself: Kopf only needs
    to know *that* something changed (the reconcile reads no diff), and a digest never
    overflows the 256 KiB annotation limit however large the spec is."""

    def build(self, *, body: kopf.Body, extra_fields: Any = None) -> kopf.BodyEssence:
        essence = super().build(body=body, extra_fields=extra_fields)
        blob = json.dumps(essence, sort_keys=True, separators=(",", ":"))
        return {"digest": hashlib.sha256(blob.encode()).hexdigest()}  # type: ignore[typeddict-unknown-key]


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: Any, logger: Logger, **_: Any) -> None:
    settings.persistence.diffbase_storage = DigestDiffBaseStorage(
        prefix=GROUP, key="last-handled-digest"
    )
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.finalizer = f"{GROUP}/finalizer"  # unused: no handler needs one
    settings.posting.level = logging.WARNING  # no event per successful reconcile
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.execution.max_workers = 16
    config = Settings.from_env()  # here, not at import: importing the handlers reads nothing
    kube = Kube.from_environment()
    if config.leader_election:
        leader: LeaderElector | AlwaysLeader = LeaderElector(
            kube,  # unfenced: the elector writes the Lease whether it leads or not
            namespace=config.lease_namespace,
            name=config.lease_name,
            identity=config.identity,
            lease_s=config.lease_seconds,
            renew_deadline_s=config.lease_seconds * 2 / 3,
            # Handlers skipped while standing by: the new leader reconciles everything.
            on_elected=lambda: bg.resync_now(),
            logger=logger,
        )
    else:
        leader = AlwaysLeader()
    # Every write of a reconcile goes through its term's fence (leader.py, kube.py).
    fenced = leader if isinstance(leader, LeaderElector) else None
    reconciler = Reconciler(kube, config, leadership=fenced)
    bg = Background(reconciler, logger=logger, leader=leader)
    op = Operator(reconciler=reconciler, background=bg, leader=leader)
    memo[MEMO_KEY] = op
    bg.start()
    leader.start()
    if config.metrics_port:
        try:
            op.metrics = metrics.serve(
                config.metrics_port, reconciler.stats, lambda: leader.leading
            )
        except OSError as exc:  # a port in use must not stop the operator
            logger.warning("metrics on :%s not served: %s", config.metrics_port, exc)
    logger.info(
        "atom-operator: resync every %ss, default image %s",
        config.reconcile_interval,
        config.default_image,
    )


@kopf.on.cleanup()
def shutdown(memo: Any, **_: Any) -> None:
    op = _operator(memo)
    if op is None:
        return
    op.leader.release()
    op.background.shutdown()
    if op.metrics is not None:
        op.metrics.shutdown()


@kopf.on.create(*RESOURCE, backoff=5)
@kopf.on.update(*RESOURCE, backoff=5)
@kopf.on.resume(*RESOURCE, backoff=5)
def on_change(body: kopf.Body, memo: Any, logger: Logger, **_: Any) -> None:
    op = _operator(memo)
    if op is None or not op.leader.leading:
        return  # another replica acts; this one reconciles everything once elected
    outcome = op.reconciler.run(body, logger)  # writes the status itself (reconciler.py)
    meta = body["metadata"]
    op.background.retry(meta["namespace"], meta["name"], outcome.retry_in)


# Not `kopf.on.delete(optional=True)`: without a finalizer on the object Kopf (1.45) never calls
# a delete handler (the deletion is "FREE" or "GONE" to it), and a mandatory one would add the
# finalizer that makes deletion hang while the operator is down. The watch's DELETED event
# reaches a plain event handler, which adds no finalizer either.
@kopf.on.event(*RESOURCE, id="forget-deleted")
def on_deleted(event: kopf.RawEvent, memo: Any, **_: Any) -> None:
    """Forget a deleted object (a missed event is caught by the resync's listing)."""
    op = _operator(memo)
    if event["type"] == "DELETED" and op is not None:
        op.reconciler.forget(event["object"]["metadata"]["uid"])


def owner_of(meta: Mapping[str, Any]) -> str | None:
    """The AtomDeployment a child belongs to: its controller owner reference, else its instance
    label (retained PVCs and pods have no such reference; pods carry the labels of their
    template). Not the managed-by label alone: a child whose label was edited is still ours,
    and the reconcile this triggers restores the label. An unrelated object with an instance
    label costs one GET of an AtomDeployment that is not there."""
    for ref in meta.get("ownerReferences") or []:
        if ref.get("kind") == KIND and str(ref.get("apiVersion", "")).startswith(f"{GROUP}/"):
            return str(ref.get("name") or "") or None
    labels = meta.get("labels") or {}
    ours = (
        labels.get(naming.LABEL_MANAGED_BY) == naming.MANAGED_BY
        or labels.get(naming.LABEL_NAME) == naming.APP_NAME
    )
    owner = labels.get(naming.LABEL_INSTANCE)
    return owner if owner and ours else None


def _child_changed(body: kopf.Body, memo: Any, **_: Any) -> None:
    """Requeue the owner of a changed child."""
    owner = owner_of(body.metadata)
    namespace = body.metadata.namespace
    op = _operator(memo)
    if owner and namespace and op is not None:  # every child kind is namespaced
        op.background.requeue.add(namespace, owner)


# No label filter: Kopf filters labels in this process anyway (it watches every object of the
# kind), and a filter on managed-by missed children whose label was edited until the resync.
for _group, _version, _plural in CHILD_RESOURCES:
    kopf.on.event(_group, _version, _plural, id=f"child-{_plural}")(_child_changed)


@kopf.on.probe(id="reconcile")
def probe_reconcile(memo: Any, **_: Any) -> dict[str, float]:
    """Reconcile count and latency percentiles (seconds), served on /healthz for the benchmark."""
    op = _operator(memo)
    return op.reconciler.stats.summary() if op is not None else {"count": 0}
