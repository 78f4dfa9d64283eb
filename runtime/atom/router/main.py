"""`atom-router --prefill URL ... --decode URL ... [--port 8000]`."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Sequence

from aiohttp import web

from atom.router.proxy import create_router_app


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="atom-router", description="route requests to prefill and decode instances"
    )
    parser.add_argument(
        "--prefill", nargs="+", required=True, metavar="URL", help="prefill instance base URLs"
    )
    parser.add_argument(
        "--decode", nargs="+", required=True, metavar="URL", help="decode instance base URLs"
    )
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--grace", type=float, default=30.0, help="seconds in-flight requests get at SIGTERM"
    )
    parser.add_argument("--log-level", default="info")
    return parser


async def run(args: argparse.Namespace) -> int:
    app = create_router_app(args.prefill, args.decode)
    runner = web.AppRunner(
        app, handler_cancellation=True, shutdown_timeout=args.grace, access_log=None
    )
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
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
