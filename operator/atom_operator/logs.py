"""The logger type the operator's parts take: Kopf hands each handler a per-object
`LoggerAdapter` (its messages name the object), the startup handler a plain `Logger`."""

from __future__ import annotations

import logging
from typing import Any, TypeAlias

Logger: TypeAlias = logging.Logger | logging.LoggerAdapter[Any]
