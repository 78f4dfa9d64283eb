"""How the router picks an instance of a role: fewest outstanding requests, or prefix affinity.

`prefix` (the default) sends a request to the instance that most recently served the longest
prefix it shares with earlier requests, so that instance's prefix cache (the engine's
automatic prefix caching) already holds those blocks, unless that instance is overloaded:
an instance whose outstanding requests exceed 1.5 x the role's mean + 2 is passed over, so one
hot prefix cannot pile every request onto one instance. A request that matches nothing (or only
overloaded instances) goes to the least-outstanding instance, which then owns its prefix.
`least-outstanding` is the pool's plain balancing. With one instance in rotation both agree.

Keys: the router does not tokenize (it is torch-free and its pod has no model files or
tokenizer), so it hashes what the engine's tokens come from: fixed-size chunks of the prompt
text (or of the chat messages, each as its role and content, in order, which is how chat
templates render them), or, for a prompt given as token ids, chunks of the ids. Chunks are
chained like the engine's block keys (each key covers its chunk and every chunk before it),
salted with the model name, and only full chunks count, as only full blocks are cached.
Equal leading text tokenizes to equal leading tokens (up to the token at the cut), so a chunk
match predicts the engine's block hits without the router knowing the tokenizer.

Only the prefill role uses the policy: it is where prompts are computed. A decode instance
pulls every block of the prompt from the prefill instance whatever its own cache holds, so
affinity there would only concentrate load; it is balanced by outstanding requests.
"""

from __future__ import annotations

import enum
import hashlib
import json
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from atom.router.pool import Instance, Pool

CHUNK_CHARS = 256  # about 64 tokens of English text: four engine blocks of 16
CHUNK_TOKENS = 64  # a prompt given as token ids
MAX_CHUNKS = 128  # leading chunks hashed per request (32k characters)
MAX_KEYS = 200_000  # keys remembered (LRU), whatever the number of instances
LOAD_FACTOR = 1.5  # an instance above LOAD_FACTOR x mean outstanding + LOAD_SLACK is passed over
LOAD_SLACK = 2


class RoutingPolicy(enum.StrEnum):
    LEAST_OUTSTANDING = "least-outstanding"
    PREFIX = "prefix"


def _messages_text(messages: Sequence[Any]) -> str:
    """Chat messages as one string, in order: role and content of each (content parts other
    than text, e.g. images, as their canonical JSON)."""
    parts: list[str] = []
    for m in messages:
        if not isinstance(m, dict):
            parts.append(json.dumps(m, sort_keys=True, default=str))
            continue
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(
                c["text"]
                if isinstance(c, dict) and isinstance(c.get("text"), str)
                else json.dumps(c, sort_keys=True, default=str)
                for c in content
            )
        parts.append(f"\x1e{m.get('role', '')}\x1f{content if content is not None else ''}")
    return "".join(parts)


def prefix_keys(
    body: dict[str, Any],
    chunk_chars: int = CHUNK_CHARS,
    chunk_tokens: int = CHUNK_TOKENS,
    max_chunks: int = MAX_CHUNKS,
) -> list[bytes]:
    """Chained keys of the request's full leading chunks (shortest prefix first); [] when the
    body has no prompt the router understands or it is shorter than one chunk."""
    root = hashlib.sha256(b"atom-router-prefix-v1|" + str(body.get("model", "")).encode()).digest()
    messages, prompt = body.get("messages"), body.get("prompt")
    chunks: list[bytes] = []
    if isinstance(messages, list):
        prompt = _messages_text(messages)
    elif isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch: its first prompt
    if isinstance(prompt, str):
        n = min(len(prompt) // chunk_chars, max_chunks)
        chunks = [
            prompt[i * chunk_chars : (i + 1) * chunk_chars].encode("utf-8", "surrogatepass")
            for i in range(n)
        ]
    elif isinstance(prompt, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    ):
        n = min(len(prompt) // chunk_tokens, max_chunks)
        try:
            chunks = [
                array("q", prompt[i * chunk_tokens : (i + 1) * chunk_tokens]).tobytes()
                for i in range(n)
            ]
        except OverflowError:
            return []
    keys: list[bytes] = []
    parent = root
    for chunk in chunks:
        parent = hashlib.sha256(parent + chunk).digest()
        keys.append(parent)
    return keys


@dataclass
class PickStats:
    hits: int = 0  # routed to the owner of a matching prefix
    misses: int = 0  # no (eligible) owner: least outstanding


class PrefixTable:
    """Key -> {instance url: tick of its last request with that prefix}, LRU-bounded."""

    def __init__(self, max_keys: int = MAX_KEYS) -> None:
        self.max_keys = max_keys
        self._owners: OrderedDict[bytes, dict[str, int]] = OrderedDict()
        self._tick = 0

    def __len__(self) -> int:
        return len(self._owners)

    def owners(self, key: bytes) -> dict[str, int]:
        return self._owners.get(key) or {}

    def record(self, keys: list[bytes], url: str) -> None:
        self._tick += 1
        for key in keys:
            owners = self._owners.get(key)
            if owners is None:
                owners = self._owners[key] = {}
            else:
                self._owners.move_to_end(key)
            owners[url] = self._tick
        while len(self._owners) > self.max_keys:
            self._owners.popitem(last=False)


class Picker:
    """Chooses an instance of a pool for a request under the routing policy."""

    def __init__(
        self,
        policy: RoutingPolicy | str = RoutingPolicy.PREFIX,
        registry: CollectorRegistry | None = None,
        max_keys: int = MAX_KEYS,
    ) -> None:
        self.policy = RoutingPolicy(policy)
        self.tables: dict[str, PrefixTable] = {}
        self.max_keys = max_keys
        self.stats: dict[str, PickStats] = {}
        self._routed = (
            Counter(
                "atom_router_prefix_routed",
                "Requests routed by the prefix policy: to the owner of a matching prefix (hit) or "
                "by outstanding requests (miss)",
                ["role", "outcome"],
                registry=registry,
            )
            if registry is not None
            else None
        )

    def pick(
        self,
        pool: Pool,
        exclude: set[Instance] | frozenset = frozenset(),
        keys: list[bytes] | None = None,
    ) -> Instance | None:
        ready = [i for i in pool.instances.values() if i.in_rotation and i not in exclude]
        if self.policy is RoutingPolicy.LEAST_OUTSTANDING or not keys or len(ready) < 2:
            inst = pool.pick(exclude)
            if inst is not None and keys and self.policy is RoutingPolicy.PREFIX:
                self._table(pool).record(keys, inst.url)
            return inst
        table = self._table(pool)
        mean = sum(i.outstanding for i in ready) / len(ready)
        bound = LOAD_FACTOR * mean + LOAD_SLACK
        eligible = {i.url: i for i in ready if i.outstanding <= bound}
        chosen: Instance | None = None
        for key in reversed(keys):  # the longest matching prefix first
            owners = [(tick, url) for url, tick in table.owners(key).items() if url in eligible]
            if owners:
                chosen = eligible[max(owners)[1]]  # the one that served it most recently
                break
        stats = self.stats.setdefault(pool.role, PickStats())
        if chosen is not None:
            # pool.pick with every other instance excluded: it marks the pick as its own
            others = {i for i in ready if i is not chosen}
            inst = pool.pick(set(exclude) | others) or pool.pick(exclude)
            outcome = "hit"
            stats.hits += 1
        else:
            overloaded = {i for i in ready if i.url not in eligible}
            inst = pool.pick(set(exclude) | overloaded) or pool.pick(exclude)
            outcome = "miss"
            stats.misses += 1
        if self._routed is not None:
            self._routed.labels(pool.role, outcome).inc()
        if inst is not None:
            table.record(keys, inst.url)
        return inst

    def _table(self, pool: Pool) -> PrefixTable:
        table = self.tables.get(pool.role)
        if table is None:
            table = self.tables[pool.role] = PrefixTable(self.max_keys)
        return table
