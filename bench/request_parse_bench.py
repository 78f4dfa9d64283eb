"""The API server's parse and validation of a /v1/completions body whose prompt is a list of
token ids (issue 29): atom.wire.body.loads_object (JSON, depth and Unicode checks), then
atom.entrypoints.protocol.completion_request (pydantic, ranges, sizes), as the server runs them
for each request. CPU only; the minimum over --repeat runs of --number calls each, per stage.

    PYTHONPATH=runtime OMP_NUM_THREADS=1 python bench/request_parse_bench.py [--ids 4096]
"""

from __future__ import annotations

import argparse
import json
import random
import timeit

from atom.entrypoints.protocol import completion_request
from atom.wire.body import loads_object

VOCAB = 128256  # Llama-3's


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ids", type=int, default=4096, help="prompt length in token ids")
    ap.add_argument("--number", type=int, default=200)
    ap.add_argument("--repeat", type=int, default=15)
    args = ap.parse_args()
    rng = random.Random(0)
    body = {
        "model": "m",
        "prompt": [rng.randrange(VOCAB) for _ in range(args.ids)],
        "max_tokens": 1,
        "stream": True,
        "logprobs": 1,
        "temperature": 0.0,
    }
    raw = json.dumps(body).encode()
    parsed = loads_object(raw)
    stages = {
        "json.loads": lambda: json.loads(raw),
        "loads_object": lambda: loads_object(raw),
        "completion_request": lambda: completion_request(parsed, None, "m", 8192, VOCAB),
        "both": lambda: completion_request(loads_object(raw), None, "m", 8192, VOCAB),
    }
    best = dict.fromkeys(stages, float("inf"))
    for _ in range(args.repeat):  # interleaved: a busy machine slows every stage alike
        for name, fn in stages.items():
            us = timeit.timeit(fn, number=args.number) / args.number * 1e6
            best[name] = min(best[name], us)
    print(json.dumps({"ids": args.ids, "body_bytes": len(raw)}))
    for name, us in best.items():
        print(f"{name:20s} {us:8.1f} us")


if __name__ == "__main__":
    main()
