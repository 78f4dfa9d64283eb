"""`--max-waiting`: a bound on the requests an API server has admitted that have no token yet.

A slot is taken synchronously when a request is admitted (no await between the check and the
count, so a burst cannot slip past it) and given back once, at the request's first token, or
when it finishes, fails or is aborted before that. Beyond the bound a request is answered 429
with Retry-After. The bound is per API server process (`--api-server-count` multiplies it).
"""

from __future__ import annotations

from atom.wire import errors as codes
from atom.wire.api_error import APIError


class Slot:
    """One admitted request's place under the bound; release() is idempotent."""

    __slots__ = ("_admission", "held")

    def __init__(self, admission: Admission) -> None:
        self._admission = admission
        self.held = True

    def release(self) -> None:
        if self.held:
            self.held = False
            self._admission.waiting -= 1


class Admission:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.waiting = 0  # slots held now

    def admit(self) -> Slot:
        """A slot, or APIError 429 (with Retry-After) when every slot is taken."""
        if self.waiting >= self.limit:
            raise APIError(
                429,
                f"too many waiting requests ({self.waiting} >= --max-waiting {self.limit}); "
                "retry later",
                code=codes.RATE_LIMIT_EXCEEDED,
            )
        self.waiting += 1
        return Slot(self)
