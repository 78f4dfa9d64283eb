"""DraftGraph: a drafter's decode pass recorded whole, keyed (running_bs, 0), in the shared pool.

Drafters are not @token_graph units of the target (the guide): in either graph mode the draft
model's one-row passes are recorded as request-bucket graphs into `graph_pool()` like every
other recording; replays count in `draft_graph_replays` (and `graph_replays`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from atom.cudagraph.region_graph import ReqGraph
from atom.utils.counters import counters


class DraftGraph(ReqGraph):
    def replay(self, key: tuple[int, int], inputs: Sequence[Any] = ()) -> Any:
        out = super().replay(key, inputs)
        counters.inc("draft_graph_replays")
        return out
