"""atom-router's prefix-aware routing (atom.router.policy): keys of leading prompt chunks, the
instance that served a prefix most recently, bounded load; and on loopback, through the router,
repeated prefixes landing on one prefill instance while distinct ones spread."""

from __future__ import annotations

import httpx
from test_router import FAST, Backend, Env, samples, with_router

from atom.router.main import build_parser, settings_from_args
from atom.router.policy import CHUNK_CHARS, Picker, RoutingPolicy, prefix_keys
from atom.router.pool import Pool

SYSTEM = "You are a careful assistant. " * 40  # 1160 characters: four full chunks


def test_keys_chain_over_full_leading_chunks() -> None:
    a = prefix_keys({"model": "m", "prompt": SYSTEM + "first question"})
    b = prefix_keys({"model": "m", "prompt": SYSTEM + "another question, longer"})
    assert len(a) == len(SYSTEM + "first question") // CHUNK_CHARS == 4
    assert a == b[: len(a)]  # the shared system prompt: the same leading keys
    assert prefix_keys({"model": "other", "prompt": SYSTEM}) != prefix_keys(
        {"model": "m", "prompt": SYSTEM}
    )  # salted by the model
    changed = prefix_keys({"model": "m", "prompt": "X" + SYSTEM[1:]})
    assert all(x != y for x, y in zip(changed, a, strict=False))  # chained: one edit moves all
    assert prefix_keys({"model": "m", "prompt": "short"}) == []  # no full chunk, nothing cached
    ids = prefix_keys({"model": "m", "prompt": list(range(200))})
    assert len(ids) == 3 and ids[:2] == prefix_keys({"model": "m", "prompt": list(range(130))})
    chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}]
    turn2 = [*chat, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "x"}]
    k1 = prefix_keys({"model": "m", "messages": chat})
    assert k1 and prefix_keys({"model": "m", "messages": turn2})[: len(k1)] == k1
    parts = [{"role": "system", "content": [{"type": "text", "text": SYSTEM}]}]
    assert prefix_keys({"model": "m", "messages": parts}) == prefix_keys(
        {"model": "m", "messages": [{"role": "system", "content": SYSTEM}]}
    )


def _pool(n: int) -> Pool:
    return Pool("prefill", [f"http://10.0.0.{i}:8000" for i in range(n)])


def test_repeated_prefix_sticks_and_distinct_prefixes_spread() -> None:
    pool, picker = _pool(3), Picker(RoutingPolicy.PREFIX)
    keys = [prefix_keys({"model": "m", "prompt": SYSTEM + f"q{i}"}) for i in range(6)]
    first = picker.pick(pool, keys=keys[0])
    assert first is not None
    assert all(picker.pick(pool, keys=k) is first for k in keys[1:])
    assert picker.stats["prefill"].hits == 5
    distinct = [prefix_keys({"model": "m", "prompt": f"{i} " + SYSTEM}) for i in range(3)]
    picked = {picker.pick(pool, keys=k).url for k in distinct}  # type: ignore[union-attr]
    assert len(picked) == 3  # no owner yet: least outstanding, least recently picked
    # the longest match wins: a prompt extending one of them goes to that one's instance
    longer = prefix_keys({"model": "m", "prompt": "1 " + SYSTEM + "more " * 60})
    owner = picker.pick(pool, keys=distinct[1])
    assert picker.pick(pool, keys=longer) is owner


def test_bounded_load_moves_a_hot_prefix_off_an_overloaded_instance() -> None:
    pool, picker = _pool(2), Picker(RoutingPolicy.PREFIX)
    keys = prefix_keys({"model": "m", "prompt": SYSTEM})
    hot = picker.pick(pool, keys=keys)
    other = next(i for i in pool.instances.values() if i is not hot)
    hot.outstanding = 3  # mean 1.5: bound 1.5 * 1.5 + 2 = 4.25: still the owner
    assert picker.pick(pool, keys=keys) is hot
    hot.outstanding = 6  # mean 3: bound 6.5: still allowed
    assert picker.pick(pool, keys=keys) is hot
    hot.outstanding, other.outstanding = 9, 0  # mean 4.5: bound 8.75: passed over
    assert picker.pick(pool, keys=keys) is other
    # the other instance served the prefix last: it now owns it while the hot one is loaded
    hot.outstanding = 0
    assert picker.pick(pool, keys=keys) is other


def test_least_outstanding_policy_ignores_prefixes() -> None:
    pool, picker = _pool(2), Picker(RoutingPolicy.LEAST_OUTSTANDING)
    keys = prefix_keys({"model": "m", "prompt": SYSTEM})
    a, b = picker.pick(pool, keys=keys), picker.pick(pool, keys=keys)
    assert a is not b  # plain balancing: least recently picked on a tie
    assert not picker.tables


def test_flag_reaches_the_settings() -> None:
    args = build_parser().parse_args(["--prefill", "http://a:1", "--decode", "http://b:1"])
    assert settings_from_args(args).routing_policy == "prefix"
    args = build_parser().parse_args(
        [
            "--prefill",
            "http://a:1",
            "--decode",
            "http://b:1",
            "--routing-policy",
            "least-outstanding",
        ]
    )
    assert settings_from_args(args).routing_policy == "least-outstanding"


def test_router_sends_a_repeated_prefix_to_one_prefill_instance() -> None:
    p1, p2, p3, d = Backend("p1"), Backend("p2"), Backend("p3"), Backend("d")

    async def check(router: str, env: Env) -> None:
        async with httpx.AsyncClient(timeout=30) as c:
            for i in range(6):  # one system prompt, growing per-user turns
                body = {"model": "m", "prompt": SYSTEM + f"user {i} asks " * (i + 1)}
                assert (await c.post(router + "/v1/completions", json=body)).status_code == 200
            for i in range(3):  # distinct prompts
                body = {"model": "m", "prompt": f"topic {i}: " + SYSTEM}
                assert (await c.post(router + "/v1/completions", json=body)).status_code == 200
            chat = {"model": "m", "messages": [{"role": "system", "content": SYSTEM}]}
            for q in ("a", "b"):
                msgs = [*chat["messages"], {"role": "user", "content": q}]
                r = await c.post(router + "/v1/chat/completions", json={**chat, "messages": msgs})
                assert r.status_code == 200
            routed = samples(
                (await c.get(router + "/metrics")).text, "atom_router_prefix_routed_total"
            )
            assert routed[(("outcome", "hit"), ("role", "prefill"))] >= 6

    with_router([p1, p2, p3], [d], check, FAST)
    prompts = {b.name: [x.get("prompt") for x in b.bodies] for b in (p1, p2, p3)}
    shared = [b for b in (p1, p2, p3) if any(str(x).startswith(SYSTEM) for x in prompts[b.name])]
    assert len(shared) == 1  # every system-prompt request on one instance
    assert sum(1 for x in prompts[shared[0].name] if str(x).startswith(SYSTEM)) == 6
    topic = {b.name for b in (p1, p2, p3) for x in prompts[b.name] if str(x).startswith("topic")}
    assert len(topic) >= 2  # distinct prefixes spread over the instances
    chats = [b for b in (p1, p2, p3) if any("messages" in x for x in b.bodies)]
    assert len(chats) == 1 and sum("messages" in x for x in chats[0].bodies) == 2
