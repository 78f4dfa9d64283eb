"""Building and publishing one component: the pieces both the control plane's installers
(provision.py) and the real node's (nodeprovision.py) use.

Kubernetes needs a wrapper module: k8s.io/kubernetes's go.mod replaces every staging module with
a local path, so `go install` refuses it and a plain dependency on it fails; the wrapper replaces
each staging module with its published k8s.io/<name> v0.Y.Z instead.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterable
from pathlib import Path

from . import gotool, versions
from .cache import Component
from .errors import ProvisionError


def module_info(go: str, module: str, version: str, wd: Path, log: Path) -> dict:
    out = gotool.run([go, "mod", "download", "-json", f"{module}@{version}"],
                     what=f"download of {module}@{version}", log=log, cwd=wd)
    return json.loads(out)


def write_wrapper(wd: Path, module: str, requires: dict[str, str], replaces: dict[str, str],
                  imports: Iterable[str]) -> None:
    lines = [f"module {module}", "", "go 1.26", "", "require ("]
    lines += [f"\t{m} {v}" for m, v in requires.items()] + [")", ""]
    if replaces:
        lines += ["replace ("] + [f"\t{m} => {m} {v}" for m, v in replaces.items()] + [")", ""]
    (wd / "go.mod").write_text("\n".join(lines))
    body = "\n".join(f'\t_ "{pkg}"' for pkg in imports)
    (wd / "tools.go").write_text(f"//go:build tools\n\npackage tools\n\nimport (\n{body}\n)\n")


def check_version(path: Path, args: list[str], expect: str) -> str:
    try:
        proc = subprocess.run([str(path), *args], capture_output=True, text=True, timeout=60)
    except OSError as exc:
        raise ProvisionError(f"{path.name} does not run: {exc}") from exc
    out = (proc.stdout + proc.stderr).strip()
    if expect not in out:
        raise ProvisionError(
            f"{path.name} reports the wrong version: expected {expect!r} in `{path.name} "
            f"{' '.join(args)}`, got {out[-400:]!r}"
        )
    return out.splitlines()[0] if out else ""


def publish(comp: Component, out: Path, reported: dict[str, str],
            extra: dict[str, Path] | None = None) -> None:
    """Move the built binaries (and extra dirs) into the component's bin dir, then stamp it."""
    staging = comp.bin_dir.with_name(comp.bin_dir.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for name in comp.binaries:
        shutil.copy2(out / name, staging / name)
    for name, src in (extra or {}).items():
        shutil.copytree(src, staging / name)
    shutil.rmtree(comp.bin_dir, ignore_errors=True)
    staging.rename(comp.bin_dir)
    comp.write_stamp(reported)
    shutil.rmtree(out, ignore_errors=True)  # the copies in bin/ are the ones kept


def build_kubernetes(go: str, comp: Component, commands: tuple[str, ...]) -> None:
    """Build `commands` (cmd/<name> of k8s.io/kubernetes) through the wrapper module."""
    version = versions.KUBERNETES
    wd, log = comp.build_dir, comp.build_dir / "build.log"
    wd.mkdir(parents=True, exist_ok=True)
    info = module_info(go, "k8s.io/kubernetes", version, wd, log)
    staging = re.findall(r"^\s*(k8s\.io/[\w.-]+)\s+=>\s+\./staging/", Path(info["GoMod"]).read_text(),
                         re.M)
    if not staging:
        raise ProvisionError(f"no staging replaces found in {info['GoMod']}: cannot build the wrapper")
    write_wrapper(wd, "atom.dev/k8sbuild", {"k8s.io/kubernetes": version},
                  {m: versions.staging_version(version) for m in staging},
                  [f"k8s.io/kubernetes/cmd/{c}" for c in commands])
    gotool.run([go, "mod", "tidy"], what="go mod tidy of the Kubernetes wrapper", log=log, cwd=wd)
    major, minor = versions.kube_minor(version)
    stamp = {"gitVersion": version, "gitMajor": major, "gitMinor": minor,
             "gitTreeState": "clean", "buildDate": info.get("Time", "")}
    flags = {f"{pkg}.{k}": v for pkg in ("k8s.io/component-base/version",
                                        "k8s.io/client-go/pkg/version") for k, v in stamp.items()}
    out = wd / "out"
    gotool.run([go, "build", "-tags", "selinux,notest,grpcnotrace", "-ldflags",
                gotool.ldflags_x(flags), "-o", f"{out}/"]
               + [f"k8s.io/kubernetes/cmd/{c}" for c in commands],
               what=f"build of {', '.join(commands)}", log=log, cwd=wd)
    reported = {c: check_version(out / c, ["--version"], f"Kubernetes {version}")
                for c in commands}
    publish(comp, out, reported)
