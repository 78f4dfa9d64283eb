"""A small synchronous Kubernetes client over plain dicts: server-side apply, list, delete.

The typed clients return generated model objects; the operator's builders produce plain dicts,
so a thin layer over `kubernetes.client.ApiClient` keeps both sides in one shape.

Every write goes through `request`, the one place a `Fence` is checked (`Kube.fenced`): the
reconciler writes through the fence of the leader term it began in, so a reconcile that finds
its replica no longer leading raises `NotLeading` at its next apply, prune, event or status
patch, and writes nothing more.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any, Protocol
from urllib.parse import quote

from kubernetes import client, config

FIELD_MANAGER = "atom-operator"
READS = ("GET",)
STATUS_ATTEMPTS = 3  # a status write that loses its resourceVersion race reads and tries again

# kind -> (api prefix, plural); every child kind the operator touches.
RESOURCES: dict[str, tuple[str, str]] = {
    "ConfigMap": ("/api/v1", "configmaps"),
    "Service": ("/api/v1", "services"),
    "PersistentVolumeClaim": ("/api/v1", "persistentvolumeclaims"),
    "Pod": ("/api/v1", "pods"),
    "Event": ("/api/v1", "events"),
    "Deployment": ("/apis/apps/v1", "deployments"),
    "Job": ("/apis/batch/v1", "jobs"),
    "Secret": ("/api/v1", "secrets"),
    "PodDisruptionBudget": ("/apis/policy/v1", "poddisruptionbudgets"),
    "NetworkPolicy": ("/apis/networking.k8s.io/v1", "networkpolicies"),
    "HorizontalPodAutoscaler": ("/apis/autoscaling/v2", "horizontalpodautoscalers"),
    "Lease": ("/apis/coordination.k8s.io/v1", "leases"),
    "PodMonitor": ("/apis/monitoring.coreos.com/v1", "podmonitors"),
    "ScaledObject": ("/apis/keda.sh/v1alpha1", "scaledobjects"),
    "InferencePool": ("/apis/inference.networking.k8s.io/v1", "inferencepools"),
    "AtomDeployment": ("/apis/atom.dev/v1alpha1", "atomdeployments"),
}


class ApiError(Exception):
    def __init__(self, status: int, body: str) -> None:
        self.status = status
        self.body = body
        try:
            self.message = json.loads(body).get("message", body)
        except (ValueError, AttributeError):
            self.message = body
        super().__init__(f"HTTP {status}: {self.message}")


class NotLeading(Exception):
    """A write refused: this replica no longer leads in the term the caller began in."""


class StaleStatus(ApiError):
    """A status write refused by its own precondition: the stored status already describes a
    newer generation than the one this writer observed."""


class Fence(Protocol):
    def check(self) -> None:
        """Raise NotLeading unless the caller may write now."""


def apply_body(obj: dict[str, Any]) -> bytes:
    """The apply body as UTF-8 JSON (JSON is YAML). Left to the client, a dict is sent through
    `json.dumps` with ASCII escapes, so a character outside the Basic Multilingual Plane becomes
    a surrogate pair `\\ud83d\\ude00`; the API server parses apply bodies as YAML, whose `\\u`
    escapes are single code points, and refuses the lone surrogates. Raw UTF-8 has no escapes."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


@dataclass(frozen=True)
class Kube:
    api: client.ApiClient
    fence: Fence | None = None  # checked before every write; None: unfenced (the elector's)

    def fenced(self, fence: Fence) -> Kube:
        """This client, writing only while `fence` allows it (same connection pool)."""
        return replace(self, fence=fence)

    @classmethod
    def from_environment(cls) -> Kube:
        """In-cluster config when running in a pod, else $KUBECONFIG."""
        configuration = client.Configuration()
        if os.environ.get("KUBERNETES_SERVICE_HOST") and not os.environ.get("KUBECONFIG"):
            config.load_incluster_config(client_configuration=configuration)
        else:
            config.load_kube_config(client_configuration=configuration)
        return cls._client(configuration)

    @staticmethod
    def _client(configuration: client.Configuration) -> Kube:
        configuration.connection_pool_maxsize = 32  # handler threads + the resync pool
        return Kube(client.ApiClient(configuration))

    @classmethod
    def from_kubeconfig(cls, path: str) -> Kube:
        configuration = client.Configuration()
        config.load_kube_config(config_file=str(path), client_configuration=configuration)
        return cls._client(configuration)

    def request(
        self,
        method: str,
        path: str,
        *,
        query: list[tuple[str, str]] | None = None,
        body: Any = None,
        content_type: str = "application/json",
    ) -> dict[str, Any]:
        if self.fence is not None and method not in READS:
            self.fence.check()  # the last moment before the write leaves this process
        headers = {"Accept": "application/json", "Content-Type": content_type}
        _, url, headers, body, _ = self.api.param_serialize(
            method,
            path,
            query_params=query or [],
            header_params=headers,
            body=body,
            auth_settings=["BearerToken"],
        )
        response = self.api.call_api(
            method, url, header_params=headers, body=body, _request_timeout=30
        )
        data = response.read()
        text = data.decode() if isinstance(data, bytes) else str(data or "")
        if not 200 <= response.status < 300:
            raise ApiError(response.status, text)
        return json.loads(text) if text else {}

    @staticmethod
    def path(kind: str, namespace: str, name: str | None = None, sub: str | None = None) -> str:
        prefix, plural = RESOURCES[kind]
        path = f"{prefix}/namespaces/{namespace}/{plural}"
        if name:
            path += f"/{quote(name)}"
        if sub:
            path += f"/{sub}"
        return path

    def apply(
        self, obj: dict[str, Any], *, force: bool = True, manager: str = FIELD_MANAGER
    ) -> dict[str, Any]:
        """Server-side apply, by default under the operator's single field manager."""
        meta = obj["metadata"]
        query = [("fieldManager", manager)]
        if force:
            query.append(("force", "true"))
        return self.request(
            "PATCH",
            self.path(obj["kind"], meta["namespace"], meta["name"]),
            query=query,
            body=apply_body(obj),
            content_type="application/apply-patch+yaml",
        )

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self.request("GET", self.path(kind, namespace, name))
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    def list(self, kind: str, namespace: str, selector: str) -> list[dict[str, Any]]:
        data = self.request("GET", self.path(kind, namespace), query=[("labelSelector", selector)])
        items = data.get("items", [])
        for item in items:  # list items carry no kind
            item.setdefault("kind", kind)
        return items

    def create(self, obj: dict[str, Any]) -> bool:
        """Create `obj` unless it exists (True: created now). Never updates: for objects
        whose content must stay as first written (a generated token)."""
        meta = obj["metadata"]
        try:
            self.request("POST", self.path(obj["kind"], meta["namespace"]), body=obj)
        except ApiError as exc:
            if exc.status == 409:
                return False
            raise
        return True

    def delete(self, kind: str, namespace: str, name: str) -> None:
        """Delete with background propagation (children of Deployments/Jobs go too)."""
        try:
            self.request(
                "DELETE",
                self.path(kind, namespace, name),
                body={
                    "kind": "DeleteOptions",
                    "apiVersion": "v1",
                    "propagationPolicy": "Background",
                },
            )
        except ApiError as exc:
            if exc.status != 404:
                raise

    def post_event(
        self, involved: dict[str, Any], event_type: str, reason: str, message: str
    ) -> None:
        """A core/v1 Event about `involved` (apiVersion, kind, name, namespace, uid)."""
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {
                "generateName": f"{involved['name']}.",
                "namespace": involved["namespace"],
            },
            "involvedObject": involved,
            "type": event_type,
            "reason": reason[:128],
            "message": message[:1024],
            "source": {"component": FIELD_MANAGER},
            "reportingComponent": FIELD_MANAGER,
            "reportingInstance": os.environ.get("HOSTNAME", FIELD_MANAGER)[:128],
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        self.request("POST", self.path("Event", involved["namespace"]), body=body)

    def patch_status(self, kind: str, namespace: str, name: str, status: dict[str, Any]) -> None:
        """Merge-patch the status subresource. A status that names its `observedGeneration` is
        never written over a stored one of a newer generation (StaleStatus): the write reads
        the stored status first and carries its resourceVersion as a precondition, so nothing
        can land between that read and this write (409: read and try again)."""
        generation = status.get("observedGeneration")
        body: dict[str, Any] = {"status": status}
        path = self.path(kind, namespace, name, "status")
        for attempt in range(STATUS_ATTEMPTS):
            if isinstance(generation, int):
                stored = self.get(kind, namespace, name)
                if stored is None:
                    raise ApiError(404, f"{kind} {namespace}/{name} not found")
                seen = (stored.get("status") or {}).get("observedGeneration")
                if isinstance(seen, int) and seen > generation:
                    raise StaleStatus(
                        409,
                        f"status of generation {seen} is stored; generation {generation}'s "
                        "would move observedGeneration backwards",
                    )
                body["metadata"] = {"resourceVersion": stored["metadata"]["resourceVersion"]}
            try:
                self.request("PATCH", path, body=body, content_type="application/merge-patch+json")
                return
            except ApiError as exc:
                if exc.status != 409 or "metadata" not in body or attempt == STATUS_ATTEMPTS - 1:
                    raise
