"""The operator with a write journal and one fault point, for the fault harness (fault_harness.py).

Run as a script in place of `python -m atom_operator.main`; the operator itself is unchanged.

- ATOM_FAULT_JOURNAL: each write request this process makes is appended as one JSON line
  {"t": unix time, "method", "path", "status"}; a write its fence refused has "refused": true
  and never left the process. Reads are not journaled.
- ATOM_FAULT_FREEZE_ARM: while this file exists, the next apply of a Deployment whose instance
  label is the file's content stops the whole process with SIGSTOP (a GC pause, CPU
  throttling or a paused VM would freeze it the same way) before that apply is sent. The file
  is removed first, so it fires once; a journal line {"frozen": name} says which apply waits.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

from atom_operator import naming
from atom_operator.kube import ApiError, Kube, NotLeading
from atom_operator.main import main

_JOURNAL = os.environ.get("ATOM_FAULT_JOURNAL")
_ARM = os.environ.get("ATOM_FAULT_FREEZE_ARM")
_lock = threading.Lock()
_request = Kube.request
_apply = Kube.apply


def journal(entry: dict[str, Any]) -> None:
    if _JOURNAL:
        with _lock, open(_JOURNAL, "a") as out:
            out.write(json.dumps({"t": time.time(), **entry}) + "\n")


def request(self: Kube, method: str, path: str, **kw: Any) -> dict[str, Any]:
    if method == "GET":
        return _request(self, method, path, **kw)
    entry = {"method": method, "path": path}
    try:
        result = _request(self, method, path, **kw)
    except NotLeading:
        journal({**entry, "refused": True})
        raise
    except ApiError as exc:
        journal({**entry, "status": exc.status})
        raise
    except Exception:
        journal({**entry, "status": 0})  # sent, or maybe not: counted as a write
        raise
    journal({**entry, "status": 200})
    return result


def _take_arm(obj: dict[str, Any]) -> bool:
    if not _ARM or obj["kind"] != "Deployment":
        return False
    with _lock:
        arm = Path(_ARM)
        if not arm.exists():
            return False
        instance = (obj["metadata"].get("labels") or {}).get(naming.LABEL_INSTANCE)
        if instance != arm.read_text().strip():
            return False
        arm.unlink()
        return True


def apply(self: Kube, obj: dict[str, Any], **kw: Any) -> dict[str, Any]:
    if _take_arm(obj):
        journal({"frozen": obj["metadata"]["name"]})
        # To this thread: it stops on its way out of the call, before anything below runs
        # (a process-directed SIGSTOP lets the caller run on until the group stop reaches it).
        signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)
        journal({"resumed": obj["metadata"]["name"]})
    return _apply(self, obj, **kw)


Kube.request = request  # type: ignore[method-assign]
Kube.apply = apply  # type: ignore[method-assign]

if __name__ == "__main__":
    main()
