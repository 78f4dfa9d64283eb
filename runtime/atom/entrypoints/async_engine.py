"""The engine core's client, under the name the server and its tests have always used.

`AsyncEngine(build)` runs the engine core in a thread of this process (tests with scripted
engines, tools); `atom-runtime serve` runs it in its own process (core.client.ProcessCore).
Both speak the same messages (atom.entrypoints.core.messages).
"""

from __future__ import annotations

from atom.entrypoints.core.client import (
    CoreClient,
    EngineDead,
    RequestRefused,
    RequestStream,
    ThreadCore,
)

AsyncEngine = ThreadCore

__all__ = ["AsyncEngine", "CoreClient", "EngineDead", "RequestRefused", "RequestStream"]
