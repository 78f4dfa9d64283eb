"""Images without Docker or a registry (`hack/images`): buildah builds the project's Dockerfile.

- `localhost/atom-python-base`: Debian (mmdebstrap, minbase) with python3, pip and venv: the
  Dockerfile's PYTHON_BASE.
- `localhost/atom-cpu-base`: that base plus the venv's torch and its dependency closure copied
  in (no CUDA base can be pulled here; GPU images keep building from the CUDA bases elsewhere).
- `localhost/atom-cpu-cc-base`: that plus Debian's C++ compiler and Python headers, one layer
  on top (Inductor compiles C++ on the CPU): the Dockerfile's RUNTIME_BASE for a CPU runtime.
- `localhost/atom-operator:<hash>` and `localhost/atom-runtime:cpu-<hash>`: the Dockerfile's
  `operator` and `runtime` targets, exported as OCI image layouts into the cache.
- `localhost/atom-model-smollm2:<version>`: the packaged SmolLM2 GGUF alone (model_image), what
  examples/atomdeployment-cpu.yaml mounts as spec.model.image.

Every image is tagged with a hash of its inputs (the build context's files, the Dockerfile,
the base's hash), so a second build with unchanged inputs does nothing. The real node imports
the layouts into its containerd (whose image store persists in the cache).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata as md
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from atom_devtools.devcluster import cache, versions
from atom_devtools.devcluster.errors import ProvisionError, tail
from atom_devtools.model_image import build_model_image

ROOT = Path(__file__).resolve().parents[2]
# The build context (what .dockerignore lets in) and the build's own files.
CONTEXT = ("pyproject.toml", "README.md", "runtime", "operator")
BUILD_FILES = ("Dockerfile", ".dockerignore")
SKIP = ("__pycache__", ".pyc", ".egg-info")
BASE_PACKAGES = (
    "python3",
    "python3-venv",
    "python3-pip",
    "python-is-python3",
    "ca-certificates",
    "passwd",
)
# Inductor on the CPU (levels 2-3, use_inductor) builds its kernels with a C++ compiler against
# Python.h: without them a CPU pod cannot run Inductor, so its compile cache gives nothing.
# Only the CPU runtime base gets them (the CUDA images compile with Triton's bundled ptxas).
CPU_COMPILER_PACKAGES = ("g++", "python3-dev")
HOST_CA = Path("/etc/ssl/certs/ca-certificates.crt")
REF_NAME = "org.opencontainers.image.ref.name"
SITE = "/usr/local/lib/python3.11/dist-packages"


@dataclass(frozen=True)
class Image:
    """One built image: its reference and the OCI image layout (a directory) the node imports."""

    ref: str
    layout: Path


def images_dir() -> Path:
    return cache.cache_dir() / "images"


def _log() -> Path:
    return images_dir() / "build.log"


def _run(cmd: list[str], what: str, capture: bool = False) -> str:
    """Run one step with its output in the build log (stdout returned when `capture`)."""
    log = _log()
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    with log.open("a") as fh:
        fh.write(f"\n$ {' '.join(cmd)}\n")
        fh.flush()
        out = subprocess.PIPE if capture else fh
        proc = subprocess.run(cmd, stdout=out, stderr=fh, text=True)
        if capture:
            fh.write(proc.stdout)
    if proc.returncode != 0:
        raise ProvisionError(f"{what} failed (exit {proc.returncode}); log {log}:\n{tail(log)}")
    print(f"  {what}: {time.monotonic() - start:.0f}s", file=sys.stderr, flush=True)
    return proc.stdout if capture else ""


def _digest(parts: Iterable[bytes]) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(hashlib.sha256(part).digest())
    return h.hexdigest()[:16]


def _files(paths: Iterable[str]) -> Iterator[Path]:
    for name in paths:
        path = ROOT / name
        if path.is_file():
            yield path
            continue
        for sub in sorted(path.rglob("*")):
            if sub.is_file() and not any(s in part for part in sub.parts for s in SKIP):
                yield sub


def context_hash() -> str:
    """Hash of everything the Dockerfile build sees (names and contents)."""
    parts: list[bytes] = []
    for path in _files(CONTEXT + BUILD_FILES):
        parts += [str(path.relative_to(ROOT)).encode(), path.read_bytes()]
    return _digest(parts)


class Buildah:
    """buildah with its own storage in the cache (runc: crun fails on hybrid cgroups here)."""

    def __init__(self) -> None:
        found = shutil.which("buildah")
        if not found:
            raise ProvisionError("buildah not found: `hack/controlplane install debian`")
        self.bin = found
        root = cache.cache_dir() / "buildah"
        self.flags = [
            "--root",
            str(root / "storage"),
            "--runroot",
            str(root / "run"),
            "--storage-driver",
            "overlay",
        ]

    def __call__(self, *args: str, what: str, capture: bool = False) -> str:
        return _run([self.bin, *self.flags, *args], what, capture)

    def exists(self, ref: str) -> bool:
        proc = subprocess.run(
            [self.bin, *self.flags, "inspect", "--type", "image", ref], capture_output=True
        )
        return proc.returncode == 0

    def export(self, ref: str, layout: Path) -> Image:
        """Into an OCI layout directory: blobs already there are not written again, so a new
        tag of a 4 GB image costs only its new layers."""
        if _layout_ref(layout) != ref:
            self("push", "--disable-compression", "--quiet", ref, f"oci:{layout}:{ref}",
                 what=f"export of {ref}")  # fmt: skip
            _keep_only(layout, ref)
        return Image(ref, layout)


def _layout_ref(layout: Path) -> str | None:
    try:
        index = json.loads((layout / "index.json").read_text())
    except (OSError, ValueError):
        return None
    names = [m.get("annotations", {}).get(REF_NAME) for m in index.get("manifests", [])]
    return names[0] if len(names) == 1 else None


def _keep_only(layout: Path, ref: str) -> None:
    """Index only `ref` and drop the blobs no longer reachable from it (older tags)."""
    index = json.loads((layout / "index.json").read_text())
    index["manifests"] = [m for m in index["manifests"]
                          if m.get("annotations", {}).get(REF_NAME) == ref]  # fmt: skip
    (layout / "index.json").write_text(json.dumps(index))
    blobs = layout / "blobs" / "sha256"
    keep: set[str] = set()
    manifests = [m["digest"] for m in index["manifests"]]
    while manifests:  # indexes and manifests are JSON; configs and layers are only kept
        digest = manifests.pop().split(":", 1)[1]
        keep.add(digest)
        doc = json.loads((blobs / digest).read_bytes())
        manifests += [m["digest"] for m in doc.get("manifests", [])]
        keep.update(d["digest"].split(":", 1)[1] for d in doc.get("layers", []))
        if "config" in doc:
            keep.add(doc["config"]["digest"].split(":", 1)[1])
    for blob in blobs.iterdir():
        if blob.name not in keep:
            blob.unlink()


def python_base(b: Buildah) -> str:
    """Debian minbase with Python, made by mmdebstrap (no image pulled)."""
    mmdebstrap = shutil.which("mmdebstrap")
    if not mmdebstrap:
        raise ProvisionError("mmdebstrap not found: `hack/controlplane install debian`")
    hooks = [
        # pip installs system-wide in the image: drop Debian's externally-managed marker
        'rm -f "$1"/usr/lib/python3*/EXTERNALLY-MANAGED',
        'rm -rf "$1"/var/cache/apt/archives/*.deb "$1"/var/lib/apt/lists/*',
    ]
    argv = [
        mmdebstrap,
        "--variant=minbase",
        f"--include={','.join(BASE_PACKAGES)}",
        *[f"--customize-hook={h}" for h in hooks],
        versions.DEBIAN_SUITE,
    ]
    ref = f"localhost/atom-python-base:{_digest(a.encode() for a in argv)}"
    if b.exists(ref):
        return ref
    tarball = images_dir() / "python-base.tar"
    _run([*argv, str(tarball)], f"mmdebstrap of {versions.DEBIAN_SUITE} (python base)")
    ctr = b("from", "scratch", what="buildah from scratch", capture=True).strip()
    try:
        b("add", ctr, str(tarball), "/", what="rootfs into the python base")
        b(
            "config",
            "--env",
            "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "--env",
            "PIP_CERT=/etc/ssl/certs/ca-certificates.crt",
            "--env",
            "LANG=C.UTF-8",
            "--cmd",
            "python3",
            "--os",
            "linux",
            "--arch",
            "amd64",
            ctr,
            what="base config",
        )
        b("commit", "--quiet", ctr, ref, what=f"commit of {ref}")
    finally:
        b("rm", ctr, what="buildah rm")
        tarball.unlink(missing_ok=True)
    return ref


def _torch_closure() -> list[md.Distribution]:
    """torch and every distribution it requires, extras followed (markers evaluated here)."""
    from packaging.requirements import Requirement

    seen: dict[str, md.Distribution] = {}
    extras_seen: dict[str, set[str]] = {}
    todo: list[tuple[str, frozenset[str]]] = [("torch", frozenset())]
    while todo:
        raw, extras = todo.pop()
        name = raw.lower().replace("_", "-")
        if name in seen and extras <= extras_seen[name]:
            continue
        dist = seen.get(name) or md.distribution(name)
        seen[name] = dist
        extras_seen[name] = extras_seen.get(name, set()) | extras
        for spec in dist.requires or []:
            req = Requirement(spec)
            wanted = [""] + sorted(extras)
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in wanted):
                todo.append((req.name, frozenset(req.extras)))
    return sorted(seen.values(), key=lambda d: d.metadata["Name"].lower())


def cpu_base(b: Buildah, python: str) -> str:
    """The python base plus the venv's torch (the version pyproject pins) and its closure."""
    dists = _torch_closure()
    pins = [f"{d.metadata['Name']}=={d.version}" for d in dists]
    ref = f"localhost/atom-cpu-base:{_digest([python.encode(), *(p.encode() for p in pins)])}"
    if b.exists(ref):
        return ref
    ctr = b(
        "from", "--pull=false", python, what="buildah from the python base", capture=True
    ).strip()
    try:
        mount = Path(b("mount", ctr, what="buildah mount", capture=True).strip())
        site = mount / SITE.lstrip("/")
        site.mkdir(parents=True, exist_ok=True)
        for dist in dists:
            base = Path(str(dist.locate_file("")))  # a SimplePath to the type checker
            for rel in dist.files or []:
                src = base / rel
                if ".." in rel.parts or not src.is_file():
                    continue  # console scripts live outside site-packages
                dst = site / rel
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dst)
        print(
            f"  copied {len(dists)} distributions ({', '.join(pins[:3])}, ...)",
            file=sys.stderr,
            flush=True,
        )
        b("umount", ctr, what="buildah umount")
        b("commit", "--quiet", ctr, ref, what=f"commit of {ref}")
    finally:
        b("rm", ctr, what="buildah rm")
    return ref


def cpu_compiler_base(b: Buildah, cpu: str) -> str:
    """The CPU base plus CPU_COMPILER_PACKAGES from Debian, a layer above torch's (whose 2.8 GiB
    layer stays as it was: the export and the node's import reuse it)."""
    ref = f"localhost/atom-cpu-cc-base:{_digest([cpu.encode(), *map(str.encode, CPU_COMPILER_PACKAGES)])}"
    if b.exists(ref):
        return ref
    ctr = b("from", "--pull=false", cpu, what="buildah from the CPU base", capture=True).strip()
    script = (
        "set -e; export DEBIAN_FRONTEND=noninteractive; apt-get update -q; "
        f"apt-get install -y -q --no-install-recommends {' '.join(CPU_COMPILER_PACKAGES)}; "
        "rm -rf /var/lib/apt/lists/* /var/cache/apt/archives/*.deb; "
        # what Inductor's C++ builder uses: g++ with OpenMP, and sysconfig's include dir
        "echo 'int main() { return 0; }' | g++ -fopenmp -x c++ -o /tmp/cc-check - && /tmp/cc-check; "
        'rm -f /tmp/cc-check; python3 -c "import os, sysconfig; '
        "assert os.path.isfile(os.path.join(sysconfig.get_paths()['include'], 'Python.h'))\""
    )
    try:
        b("run", "--runtime", "/usr/sbin/runc", "--network", "host", ctr, "--", "sh", "-c",
          script, what=f"apt-get install {' '.join(CPU_COMPILER_PACKAGES)} (CPU base)")  # fmt: skip
        b("commit", "--quiet", ctr, ref, what=f"commit of {ref}")
    finally:
        b("rm", ctr, what="buildah rm")
    return ref


def _bud(b: Buildah, target: str, ref: str, build_args: dict[str, str]) -> None:
    if b.exists(ref):
        return
    args = [
        "bud",
        "--layers",
        "--pull=false",
        "--runtime",
        "/usr/sbin/runc",
        "--network",
        "host",
        "--target",
        target,
        "-f",
        str(ROOT / "Dockerfile"),
        "-t",
        ref,
    ]
    if HOST_CA.is_file():  # pip in the build trusts what the host trusts (proxies included)
        args += ["--volume", f"{HOST_CA}:{HOST_CA}:ro"]
    for key, value in build_args.items():
        args += ["--build-arg", f"{key}={value}"]
    b(*args, str(ROOT), what=f"buildah bud --target {target} ({ref})")


TARGETS = ("operator", "runtime", "model")


def build(targets: Iterable[str] = TARGETS) -> dict[str, Image]:
    """Build (or find) each image and its OCI layout; returns {target: Image}."""
    b = Buildah()
    out = images_dir()
    out.mkdir(parents=True, exist_ok=True)
    targets = tuple(targets)
    ctx = context_hash()
    # The model image is FROM scratch: building it alone needs no Python base.
    python = python_base(b) if {"operator", "runtime"} & set(targets) else ""
    result: dict[str, Image] = {}
    for target in targets:
        if target == "operator":
            ref = f"localhost/atom-operator:{_digest([ctx.encode(), python.encode()])}"
            _bud(b, "operator", ref, {"PYTHON_BASE": python})
        elif target == "runtime":
            base = cpu_compiler_base(b, cpu_base(b, python))
            ref = f"localhost/atom-runtime:cpu-{_digest([ctx.encode(), base.encode()])}"
            _bud(b, "runtime", ref,
                 {"PYTHON_BASE": python, "RUNTIME_BASE": base, "SOURCE_HASH": ctx})  # fmt: skip
        elif target == "model":
            ref = build_model_image(b)
        else:
            raise ProvisionError(f"unknown image target {target!r} ({', '.join(TARGETS)})")
        name = ref.split("/", 1)[1].split(":", 1)[0]
        result[target] = b.export(ref, out / name)
    latest = {**current(), **result}  # building some targets keeps the others' entries
    data = {t: {"ref": i.ref, "layout": str(i.layout)} for t, i in latest.items()}
    (out / "current.json").write_text(json.dumps(data, indent=2))
    return result


def current() -> dict[str, Image]:
    """The images the last build made."""
    try:
        data = json.loads((images_dir() / "current.json").read_text())
    except (OSError, ValueError):
        return {}
    return {
        t: Image(v["ref"], Path(v["layout"]))
        for t, v in data.items()
        if _layout_ref(Path(v["layout"])) == v["ref"]
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hack/images", description=__doc__.splitlines()[0])
    parser.add_argument(
        "targets",
        nargs="*",
        default=list(TARGETS),
        help=f"any of {', '.join(TARGETS)} (default: all)",
    )
    args = parser.parse_args(argv)
    start = time.monotonic()
    try:
        images = build(args.targets)
    except ProvisionError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for target, image in images.items():
        size = sum(f.stat().st_size for f in image.layout.rglob("*") if f.is_file()) / 2**20
        print(f"{target:<9} {image.ref}  {image.layout} ({size:.0f} MiB)")
    print(f"images ready in {time.monotonic() - start:.1f}s")
    return 0


if __name__ == "__main__":
    os.umask(0o022)
    sys.exit(main())
