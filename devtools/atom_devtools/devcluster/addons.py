"""Addons: optional components too slow to build before every test run (Flux's controllers).

`hack/controlplane install --addons` builds them; hack/test starts that in the background right
after the base install, so the builds overlap the tests that need none of them. A test that
needs one calls `wait_installed(name)`: it returns once the addon is in the cache, starts the
build itself when nobody is building it, and fails with the build's error (its log's tail) when
the build failed. Each addon builds under its own lock, never the base install's.

To add one: a line in ADDONS (its cache Component and installer).
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from . import cache, flux, gie, gotool, keda
from .errors import ProvisionError, tail


@dataclass(frozen=True)
class Addon:
    name: str
    component: cache.Component
    install: Callable[[str], None]  # given the go client


ADDONS: dict[str, Addon] = {a.name: a for a in (
    Addon("flux", flux.FLUX, flux.install_flux),
    Addon("keda", keda.KEDA, keda.install_keda),
    Addon("gie", gie.GIE, gie.install_gie),  # the InferencePool CRD (no build)
)}


class AddonError(ProvisionError):
    """An addon failed to build, or did not finish building in time."""


def _state_dir() -> Path:
    path = cache.cache_dir() / "addons"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _failed_marker(name: str) -> Path:
    return _state_dir() / f"{name}.failed"


def _lock(name: str) -> Path:
    return _state_dir() / f"{name}.lock"


def log_path(name: str) -> Path:
    """Where a build that wait_installed starts writes its output."""
    return _state_dir() / f"{name}.log"


def _addon(name: str) -> Addon:
    if name not in ADDONS:
        raise ProvisionError(f"unknown addon {name!r}; known: {', '.join(ADDONS)}")
    return ADDONS[name]


def install(names: Iterable[str] | None = None, *, force: bool = False) -> dict[str, str]:
    """Build each addon not yet cached, one at a time; {name: cached | installed | failed}.

    A failure is recorded (the marker wait_installed reads) and the next addon still builds;
    raises at the end when any failed."""
    result: dict[str, str] = {}
    failures = []
    for name in list(names or ADDONS):
        addon = _addon(name)
        with _lock(name).open("w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if addon.component.is_installed() and not force:
                result[name] = "cached"
                continue
            _failed_marker(name).unlink(missing_ok=True)
            print(f"installing addon {name} {addon.component.version} into "
                  f"{addon.component.bin_dir}", file=sys.stderr, flush=True)
            start = time.monotonic()
            try:
                addon.install(gotool.find_go())
                if not addon.component.is_installed():
                    raise AddonError(f"{name} was installed but does not verify")
            except Exception as exc:  # recorded for the tests waiting on it, then re-raised
                _failed_marker(name).write_text(f"{type(exc).__name__}: {exc}\n")
                result[name] = "failed"
                failures.append(f"{name}: {exc}")
                continue
            result[name] = "installed"
            print(f"  addon {name} done in {time.monotonic() - start:.0f}s", file=sys.stderr,
                  flush=True)
    if failures:
        raise AddonError("addon builds failed:\n" + "\n".join(failures))
    return result


def _building(name: str) -> bool:
    """Whether some process holds the addon's build lock."""
    with _lock(name).open("w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(lock, fcntl.LOCK_UN)
        return False


def _start_build(name: str) -> None:
    devtools = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(devtools), *filter(None, [os.environ.get("PYTHONPATH")])]))
    with log_path(name).open("w") as log:
        subprocess.Popen([sys.executable, "-m", "atom_devtools.devcluster", "install", "--addons",
                          name], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                         env=env, start_new_session=True)


def wait_installed(name: str, timeout: float = 2400) -> cache.Component:
    """The addon's component once it is in the cache (see the module docstring)."""
    addon = _addon(name)
    deadline = time.monotonic() + timeout
    started_at: float | None = None
    while not addon.component.is_installed():
        if not _building(name):
            marker = _failed_marker(name)
            if marker.exists():
                raise AddonError(f"the {name} addon did not build (rebuild: hack/controlplane "
                                 f"install --addons {name}):\n{marker.read_text()}")
            if started_at is None:
                _start_build(name)
                started_at = time.monotonic()
            elif time.monotonic() - started_at > 30:  # it had the lock, and let go uninstalled
                raise AddonError(f"the {name} build ended without installing it:\n"
                                 f"{tail(log_path(name))}")
        if time.monotonic() > deadline:
            raise AddonError(f"the {name} addon was still building after {timeout:.0f}s; "
                             f"build log {addon.component.build_dir / 'build.log'}:\n"
                             f"{tail(addon.component.build_dir / 'build.log')}")
        time.sleep(2)
    return addon.component
