"""spec.prefixCaching and spec.disaggregation.router.routingPolicy: typed, defaulted, rendered
into the runtime and router command lines (parsed by their own parsers), documented in the CRD,
and kept out of the compile-cache key (they change no compiled code or captured graph)."""

from __future__ import annotations

import yaml
from atomd_helpers import IMAGE, OWNER, SPECS, spec

from atom.cli.args import build_parser as runtime_parser
from atom.cli.config import config_from_args
from atom.router.main import build_parser as router_parser
from atom.router.main import settings_from_args
from atom_operator import builders, crdgen, runtime_args
from atom_operator.snapshot import Snapshot


def _runtime(s, role: str = "unified"):
    return runtime_parser().parse_args(runtime_args.render_args(s, role, cache_dir=None))


def test_prefix_caching_defaults_on_and_renders_off() -> None:
    on = spec("unified")
    assert on.prefix_caching is True
    assert "--no-enable-prefix-caching" not in runtime_args.render_args(
        on, "unified", cache_dir=None
    )
    assert config_from_args(_runtime(on)).enable_prefix_caching is True
    off = spec("unified", prefixCaching=False)
    assert config_from_args(_runtime(off)).enable_prefix_caching is False
    dis = spec("disaggregated", prefixCaching=False)
    for role in runtime_args.roles(dis):
        assert _runtime(dis, role).enable_prefix_caching is False


def test_prefix_caching_is_not_in_the_compile_cache_key() -> None:
    for name in SPECS:
        for role in runtime_args.roles(spec(name)):
            assert runtime_args.cache_key(spec(name), role, IMAGE) == runtime_args.cache_key(
                spec(name, prefixCaching=False), role, IMAGE
            )


def _router_args(s) -> list[str]:
    p = builders.plan(OWNER, s, IMAGE, Snapshot())
    router = next(o for o in p.apply if o["metadata"]["name"] == "demo-router")
    return router["spec"]["template"]["spec"]["containers"][0]["args"]


def test_routing_policy_reaches_the_router() -> None:
    default = spec("disaggregated")
    assert default.disaggregation.router.routing_policy == "prefix"
    args = _router_args(default)
    assert "--routing-policy" not in args  # the router's own default
    assert settings_from_args(router_parser().parse_args(args)).routing_policy == "prefix"
    body = {**SPECS["disaggregated"]}
    body["disaggregation"] = {
        **body["disaggregation"],
        "router": {"replicas": 1, "routingPolicy": "least-outstanding"},
    }
    lo = spec(body)
    args = _router_args(lo)
    assert settings_from_args(router_parser().parse_args(args)).routing_policy == (
        "least-outstanding"
    )
    key = runtime_args.cache_key
    assert all(key(lo, r, IMAGE) == key(default, r, IMAGE) for r in runtime_args.roles(lo))


def test_crd_types_and_documents_both_fields() -> None:
    crd = yaml.safe_load(crdgen.render())
    props = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"][
        "properties"
    ]
    pc = props["prefixCaching"]
    assert pc["type"] == "boolean" and pc["default"] is True
    assert "compile-cache key" in pc["description"]
    rp = props["disaggregation"]["properties"]["router"]["properties"]["routingPolicy"]
    assert rp["enum"] == ["prefix", "least-outstanding"] and rp["default"] == "prefix"
    assert "--routing-policy" in rp["description"]
