"""One /metrics for several API server processes (`--api-server-count N`).

The port is shared (SO_REUSEPORT), so each scrape lands on any one process. Each process sends
the engine core a snapshot of its own series (every PUSH_S, and with each Scrape); the core
keeps the latest snapshot of each and hands the scraping process the others'. That process
answers with the sum over every process: counters and histograms are added (so a counter
never goes down from one scrape to the next, whichever process answers), gauges (each
process' own memory, fds, start time) keep one series per process, labelled
`api_server="<index>"`. A process' snapshot is at most PUSH_S old, except the scraping one's,
which is fresh and is stored before the answer: the next scrape, on any process, sees it.

Series the engine core derives (its gauges and counters, atom_* and vllm:*, from its own
stats) are rendered by the core itself, at the scrape, so they come from one source: never
summed, never doubled. The API servers' vllm:* request series (token and request counters,
latency histograms; atom.entrypoints.metrics_vllm) are counters and histograms like their
atom_* twins, so each request counts once, in the process that served it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import msgspec
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

PUSH_S = 1.0
SUMMED = ("counter", "histogram", "summary")


class Family(msgspec.Struct, array_like=True):
    name: str
    type: str
    doc: str
    samples: list[tuple[str, dict[str, str], float]]


class Snapshot(msgspec.Struct, array_like=True):
    api_server: int
    families: list[Family]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Snapshot)


def snapshot(registry: CollectorRegistry, api_server: int) -> bytes:
    """This process' series, encoded for the core (`_created` timestamps left out: a sum of
    them means nothing)."""
    families = [
        Family(
            m.name,
            m.type,
            m.documentation,
            [(s.name, dict(s.labels), float(s.value)) for s in m.samples
             if not s.name.endswith("_created")],  # fmt: skip
        )
        for m in registry.collect()
    ]
    return _encoder.encode(Snapshot(api_server, families))


def merge(snapshots: Iterable[bytes]) -> list[Metric]:
    """Counters and histograms summed over the processes; gauges labelled by process."""
    out: dict[str, Metric] = {}
    sums: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    for raw in snapshots:
        snap = _decoder.decode(raw)
        for fam in snap.families:
            metric = out.get(fam.name)
            if metric is None:
                metric = out[fam.name] = Metric(fam.name, fam.doc, fam.type)
                sums[fam.name] = {}
            if fam.type in SUMMED:
                acc = sums[fam.name]
                for name, labels, value in fam.samples:
                    key = (name, tuple(sorted(labels.items())))
                    acc[key] = acc.get(key, 0.0) + value
            else:
                for name, labels, value in fam.samples:
                    metric.add_sample(name, {**labels, "api_server": str(snap.api_server)}, value)
    for fam_name, acc in sums.items():
        for (name, pairs), value in acc.items():
            out[fam_name].add_sample(name, dict(pairs), value)
    return list(out.values())


class _Families(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


def render(snapshots: Iterable[bytes]) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(merge(snapshots)))
    return generate_latest(registry)
