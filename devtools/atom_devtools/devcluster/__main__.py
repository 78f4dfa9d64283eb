"""`python -m atom_devtools.devcluster` (hack/controlplane): install [--addons] | up [--check]
[--flux] | env."""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import signal
import sys
import time
from types import FrameType

from . import addons, cache, versions
from .errors import ClusterError, ProvisionError
from .gitserver import GitServer
from .provision import component_names, install


def _interrupt(signum: int, _frame: FrameType | None) -> None:
    # SIGTERM / SIGHUP unwind like Ctrl-C, so the `with LocalCluster()` block tears down.
    raise KeyboardInterrupt(f"signal {signum}")


def cmd_install(args: argparse.Namespace) -> int:
    start = time.monotonic()
    if args.addons:
        result = addons.install(args.components or None, force=args.force)
    else:
        result = install(args.components or None, force=args.force)
    for name, state in result.items():
        comp = cache.ALL_COMPONENTS.get(name) or (addons.ADDONS[name].component
                                                  if name in addons.ADDONS else None)
        version, where = (comp.version, comp.bin_dir) if comp else ("apt", "system packages")
        print(f"{name:<11} {version:<8} {state:<9} {where}")
    print(f"control-plane binaries ready in {time.monotonic() - start:.1f}s")
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    from .cluster import LocalCluster
    from .provision import INSTALLERS

    # The control plane; with --real-node the node's pieces too; with --flux that addon.
    install(None if args.real_node else list(INSTALLERS))
    if args.flux:
        addons.install(["flux"])
    # SIGINT too: a shell starts background jobs with it ignored, and `kill -INT` must still work.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)
    try:
        with (LocalCluster(nodes=args.nodes, keep=args.keep, real_node=args.real_node,
                           flux=args.flux) as cluster,
              contextlib.ExitStack() as stack):
            print(f"kubeconfig: {cluster.kubeconfig}")
            if args.flux:
                git = stack.enter_context(GitServer())
                print(f"flux: source-controller and kustomize-controller running; a Git "
                      f"repository to point a GitRepository at: {git.create('platform')}")
            print(f"export KUBECONFIG={shlex.quote(cluster.kubeconfig)}")
            print(cluster.kubectl("get", "nodes", "-o", "wide").stdout, end="", flush=True)
            if args.check:
                print("control plane OK; stopping")
                return 0
            print("cluster running; Ctrl-C stops it", flush=True)
            while True:  # a component that dies ends the session with its log
                time.sleep(1)
                dead = [p for p in cluster.procs if not p.alive]
                if dead:
                    print(dead[0].describe_exit(), file=sys.stderr)
                    return 1
    except KeyboardInterrupt:
        print("\nstopped", file=sys.stderr)
        return 130


def cmd_env(_args: argparse.Namespace) -> int:
    # kubeconform too; checkov stays off PATH (its venv's bin/ would shadow python and pip).
    dirs = [*cache.bin_path(), cache.KUBECONFORM.bin_dir]
    path = os.pathsep.join([str(p) for p in dirs] + ["$PATH"])
    print(f"export ATOM_CACHE_DIR={shlex.quote(str(cache.cache_dir()))}")
    print(f'export PATH="{path}"')
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="hack/controlplane",
        description=f"Local Kubernetes {versions.KUBERNETES} control plane (cache: "
                    f"{cache.cache_dir()}, override with ATOM_CACHE_DIR)")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("install", help="build or fetch the pinned binaries into the cache")
    p.add_argument("components", nargs="*", metavar="COMPONENT",
                   help=f"any of {', '.join(component_names())} (default: all)")
    p.add_argument("--force", action="store_true", help="rebuild even when cached")
    p.add_argument("--addons", action="store_true",
                   help=f"build the optional components instead ({', '.join(addons.ADDONS)}; "
                        "COMPONENT names them, default all)")
    p.set_defaults(func=cmd_install)
    p = sub.add_parser("up", help="start a local cluster in the foreground (Ctrl-C stops it)")
    p.add_argument("--check", action="store_true", help="start, show the nodes, stop")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory (logs)")
    p.add_argument("--nodes", type=int, default=2, help="number of fake GPU nodes")
    p.add_argument("--real-node", action="store_true",
                   help="also one real node (containerd, kubelet, CNI, kube-proxy, CoreDNS), "
                        "tainted atom.dev/real-node=true:NoSchedule; needs root")
    p.add_argument("--flux", action="store_true",
                   help="also Flux (source-controller, kustomize-controller; the flux addon) "
                        "and a Git server on 127.0.0.1 over smart HTTP")
    p.set_defaults(func=cmd_up)
    p = sub.add_parser("env", help="print shell exports putting the cached binaries on PATH")
    p.set_defaults(func=cmd_env)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ProvisionError, ClusterError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
