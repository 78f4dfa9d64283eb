"""`atom-operator`: Kopf standalone over atom_operator.handlers, liveness on /healthz."""

from __future__ import annotations

import logging

import kopf

from atom_operator.settings import Settings


def main() -> None:
    settings = Settings.from_env()
    logging.basicConfig(
        level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    import atom_operator.handlers  # noqa: F401  (registers the handlers)

    kopf.run(
        standalone=True,  # one replica; no peering objects needed
        clusterwide=not settings.namespaces,
        namespaces=settings.namespaces,
        liveness_endpoint=f"http://0.0.0.0:{settings.health_port}/healthz",
    )


if __name__ == "__main__":
    main()
