"""The newcomer demo (`hack/demo`): the whole loop on one machine, from nothing.

By default every pod really runs on a real node (demo_real.py). With --kwok, the older loop on
kwok fake nodes, with the operator and the runtime as local processes (demo_kwok.py). Ctrl-C or
the end tears everything down, and the demo checks that no process it started is left.

This module is only the command line; the pieces the tests share with it are in kubectl.py
(Kubectl, install_crd, is_ready, wait_ready), localprocs.py (LocalOperator, RuntimeProcess,
free_port) and printer.py.
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Sequence

from atom_devtools.localprocs import leftovers
from atom_devtools.printer import Printer


def _raise_keyboard_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hack/demo", description=__doc__.splitlines()[0])
    parser.add_argument("--example", default=None, help="AtomDeployment manifest to apply "
                        "(default: examples/atomdeployment-cpu.yaml, with --kwok "
                        "examples/atomdeployment.yaml)")
    parser.add_argument("--kwok", action="store_true", help="kwok nodes only: the operator as a "
                        "local process and the runtime as a local process (no images, no root)")
    parser.add_argument("--gitops", action="store_true", help="kwok nodes and Flux: a graph-mode "
                        "change pushed to a local Git repository rolls out, then is reverted")
    parser.add_argument("--namespace", default="atom-demo")
    parser.add_argument(
        "--model", default="tiny-llama", help="built-in shape the CPU runtime serves"
    )
    parser.add_argument("--prompt", default="The capital of France is")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per wait")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)  # `kill` tears down like Ctrl-C
    # Python leaves SIGINT ignored when it starts with it ignored (a job put in the background
    # by a non-interactive shell, some CI runners): Ctrl-C must tear down all the same.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    printer = Printer()
    pids: list[int] = []
    try:
        if args.gitops:
            from atom_devtools.demo_gitops import run as run_gitops

            run_gitops(args, printer, pids)
        elif args.kwok:
            from atom_devtools.demo_kwok import run

            run(args, printer, pids)
        else:
            from atom_devtools.demo_real import run_real

            run_real(args, printer, pids)
        status, outcome = 0, ""
    except KeyboardInterrupt:
        status, outcome = 130, "interrupted"
    except Exception as error:  # a newcomer needs the reason, not a traceback
        status, outcome = 1, f"demo failed: {error}"
    if outcome:
        print(f"\n{outcome}", file=sys.stderr, flush=True)
    alive = leftovers(pids)
    if alive:
        printer.detail(f"still running after teardown: process groups {alive}")
        return status or 1
    printer.detail(f"nothing left running ({len(pids)} processes started, all stopped)")
    return status


if __name__ == "__main__":
    sys.exit(main())
