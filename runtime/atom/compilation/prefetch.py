"""Start Inductor's per-process set-up while the model is being built.

Whether the pieces are compiled (cold) or loaded (warm), the first compiled call of a fresh
process imports Inductor's compiler modules and hashes Triton's and torch's installed files
for its cache keys (`triton_key`, `torch_key`: about a second on an H200 host, measured by
bench/profile_warm_start.py). None of that depends on the model, so a thread does it while the
main thread builds the model, loads the weights and sizes the KV cache; the compile phase
waits for whatever is left. Everything here is cached by torch and Triton themselves, so the
main thread redoing a step the thread has not reached is correct, only slower.

The imports themselves run on the caller's thread before the thread starts: torch's Inductor
and Dynamo modules import each other, and a second thread importing them at the same time can
see a partially initialised module (`cannot import name ... from partially initialized module
torch._inductor.utils`, seen under load). Only the file hashing runs in the background.
"""

from __future__ import annotations

import logging
import threading
import time

logger = logging.getLogger(__name__)


def _import_compiler() -> None:
    import torch._dynamo  # noqa: F401 - the import is the work
    import torch._inductor.codecache  # noqa: F401
    import torch._inductor.compile_fx  # noqa: F401
    import torch._inductor.standalone_compile  # noqa: F401


def _prefetch(device_type: str) -> None:
    from torch._inductor.codecache import torch_key

    torch_key()
    if device_type == "cuda":
        from torch.utils._triton import has_triton

        if has_triton():
            from torch._inductor.runtime.triton_compat import triton_key

            triton_key()


class CompilePrefetch:
    """One background thread; `wait()` joins it (at once if it was never started)."""

    def __init__(self, device_type: str, enabled: bool) -> None:
        self.seconds = 0.0
        self._thread: threading.Thread | None = None
        if enabled:
            _import_compiler()
            self._thread = threading.Thread(target=self._run, args=(device_type,),
                                            name="atom-compile-prefetch", daemon=True)
            self._thread.start()

    def _run(self, device_type: str) -> None:
        t0 = time.perf_counter()
        try:
            _prefetch(device_type)
        except Exception as exc:  # noqa: BLE001 - an optimisation: the compile path redoes it
            logger.debug("compile prefetch failed (the first compiled call will do it): %s", exc)
        self.seconds = time.perf_counter() - t0

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
