"""`atom-router --prefill URL ... --decode URL ... [--port 8000]`.

Each instance is a URL (`http://10.0.0.5:8000`) or a DNS name with a port whose addresses are
the instances (`demo-prefill-abc.ns.svc:8000`, a headless Service), re-resolved periodically.
ATOM_INTERNAL_TOKEN must be set (the instances honour KV transfers only with it).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Sequence
from dataclasses import fields

from aiohttp import web

from atom.router.policy import RoutingPolicy
from atom.router.proxy import RouterSettings, create_router_app
from atom.wire.body import RUNNER_KWARGS


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="atom-router", description="route requests to prefill and decode instances"
    )
    parser.add_argument(
        "--prefill",
        nargs="+",
        required=True,
        metavar="URL",
        help="prefill instances: base URLs, or DNS names with a port (name:port) whose "
        "addresses are the instances",
    )
    parser.add_argument(
        "--decode", nargs="+", required=True, metavar="URL", help="decode instances (as --prefill)"
    )
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--grace", type=float, default=30.0, help="seconds in-flight requests get at SIGTERM"
    )
    parser.add_argument("--log-level", default="info")
    parser.add_argument(
        "--api-key",
        default=None,
        help="require `Authorization: Bearer KEY` on /v1/* (default $ATOM_API_KEY; unset: open)",
    )
    parser.add_argument(
        "--routing-policy",
        choices=[p.value for p in RoutingPolicy],
        default=RoutingPolicy.PREFIX.value,
        help="how a prefill instance is picked: prefix (the one that most recently served the "
        "longest matching prompt prefix, bounded by outstanding requests) or least-outstanding",
    )
    d = RouterSettings()
    for flag, default, text in (
        ("--health-interval", d.health_interval, "seconds between /health probes of each instance"),
        ("--health-timeout", d.health_timeout, "timeout of one probe"),
        ("--dns-interval", d.dns_interval, "seconds between re-resolving DNS names"),
        ("--queue-timeout", d.queue_timeout, "how long a request waits for an instance (then 503)"),
        ("--prefill-timeout", d.prefill_timeout, "bound on one prefill call"),
        ("--read-timeout", d.read_timeout, "silence allowed from a decode instance"),
    ):
        parser.add_argument(flag, type=float, default=default, help=f"{text} (default {default})")
    return parser


def settings_from_args(args: argparse.Namespace) -> RouterSettings:
    """The RouterSettings fields that have a flag (--health-interval -> health_interval)."""
    given = {f.name: getattr(args, f.name) for f in fields(RouterSettings) if hasattr(args, f.name)}
    return RouterSettings(**given)


async def run(args: argparse.Namespace) -> int:
    try:
        app = create_router_app(args.prefill, args.decode, settings_from_args(args))
    except ValueError as exc:
        print(f"atom-router: error: {exc}", file=sys.stderr)
        return 2
    runner = web.AppRunner(
        app,
        handler_cancellation=True,
        shutdown_timeout=args.grace,
        access_log=None,
        **RUNNER_KWARGS,
    )
    await runner.setup()
    # A burst of clients connects at once; aiohttp's default backlog (128) resets the excess.
    site = web.TCPSite(runner, args.host, args.port, backlog=2048)
    await site.start()
    port = runner.addresses[0][1] if runner.addresses else args.port
    print(f"ATOM router listening on http://{args.host}:{port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()  # stop accepting, let in-flight streams finish up to --grace
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
