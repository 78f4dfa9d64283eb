"""Helpers of the real-node fault tests: streaming through the router (SSE events), the router's
per-backend request counts, and killing a container through the node's containerd."""

from __future__ import annotations

import http.client
import json
import re
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from atom_devtools.kubectl import Kubectl

# atom_router_requests_total{role="decode",backend="http://10.245.0.7:8000",status="200"} 3.0
_REQUESTS = re.compile(r'^atom_router_requests_total\{(?P<labels>[^}]*)\}\s+(?P<value>\S+)$')
_LABEL = re.compile(r'(\w+)="([^"]*)"')


@dataclass
class StreamResult:
    """What one streamed completion gave its client."""

    chunks: int = 0  # data events with text
    errors: list[dict[str, Any]] = field(default_factory=list)  # in-band error events
    done: bool = False  # `data: [DONE]` arrived
    broken: str = ""  # the connection failed instead of ending (no clean end)
    status: int = 0


def completion_body(model: str, max_tokens: int, stream: bool) -> dict[str, Any]:
    # ignore_eos: random weights would end the answer at any token; the length is ours
    return {"model": model, "prompt": "hello", "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": stream}  # fmt: skip


class Streamer:
    """One streamed completion, read event by event (the caller decides when to stop)."""

    def __init__(self, host: str, body: dict[str, Any], timeout: float = 120) -> None:
        self.conn = http.client.HTTPConnection(host, 8000, timeout=timeout)
        self.conn.request("POST", "/v1/completions", json.dumps(body),
                          {"Content-Type": "application/json"})  # fmt: skip
        self.resp = self.conn.getresponse()
        self.result = StreamResult(status=self.resp.status)

    def events(self) -> Iterator[dict[str, Any] | str]:
        """Each SSE data payload (a dict, or "[DONE]"); the end or a failure stops it."""
        try:
            while True:
                line = self.resp.readline()
                if not line:
                    return
                line = line.strip()
                if not line.startswith(b"data: "):
                    continue
                payload = line[len(b"data: "):]
                if payload == b"[DONE]":
                    self.result.done = True
                    yield "[DONE]"
                    continue
                event = json.loads(payload)
                if "error" in event:
                    self.result.errors.append(event["error"])
                else:
                    self.result.chunks += 1
                yield event
        except (OSError, http.client.HTTPException, ValueError) as exc:
            self.result.broken = repr(exc)

    def finish(self) -> StreamResult:
        for _ in self.events():
            pass
        self.conn.close()
        return self.result


def stream_once(host: str, model: str, max_tokens: int) -> StreamResult:
    try:
        streamer = Streamer(host, completion_body(model, max_tokens, stream=True))
    except (OSError, http.client.HTTPException) as exc:  # refused before any answer
        return StreamResult(broken=repr(exc))
    return streamer.finish()


def decode_requests(router_ip: str) -> dict[str, float]:
    """The router's decode requests answered 200, per backend URL."""
    with urllib.request.urlopen(f"http://{router_ip}:8000/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _REQUESTS.match(line)
        if not m:
            continue
        labels = dict(_LABEL.findall(m["labels"]))
        if labels.get("role") == "decode" and labels.get("status") == "200":
            out[labels["backend"]] = float(m["value"])
    return out


def pod_url(pod: dict[str, Any]) -> str:
    return f"http://{pod['status']['podIP']}:8000"


def container_id(pod: dict[str, Any], name: str) -> str:
    """The containerd ID of the pod's running container `name`."""
    status = next(s for s in pod["status"]["containerStatuses"] if s["name"] == name)
    return str(status["containerID"]).removeprefix("containerd://")


def restarts(pod: dict[str, Any]) -> int:
    return sum(s["restartCount"] for s in pod["status"].get("containerStatuses", []))


def pod_by_name(kubectl: Kubectl, namespace: str, name: str) -> dict[str, Any]:
    return kubectl.json("pod", name, "-n", namespace)
