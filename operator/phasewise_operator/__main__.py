"""``python -m phasewise_operator``: run the operator (kopf) with the settings from the environment.

Liveness: kopf answers ``GET /healthz`` on port 8080 (``PHASEWISE_HEALTH_PORT``) while
its event loop runs. Exit status 2 with a one-line message for an invalid setting.
"""

from __future__ import annotations

import logging
import os
import sys


def main() -> int:
    """Run until SIGTERM/SIGINT."""
    from phasewise_operator.settings import SettingsError, from_env

    try:
        ops = from_env()
    except SettingsError as e:
        print(f"phasewise-operator: error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=os.environ.get("PHASEWISE_LOG_LEVEL", "INFO").upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import kopf

    import phasewise_operator.handlers  # noqa: F401  (registers the handlers)

    port = int(os.environ.get("PHASEWISE_HEALTH_PORT", "8080"))
    # auto: peer when the peering object exists (its name is set in handlers.configure).
    peering: dict = {"priority": ops.peering_priority}
    if ops.peering_mode == "standalone":
        peering["standalone"] = True
    elif ops.peering_mode == "mandatory":
        peering["peering_name"] = ops.peering
    kopf.run(clusterwide=ops.clusterwide, namespaces=list(ops.namespaces),
             liveness_endpoint=f"http://0.0.0.0:{port}/healthz", **peering)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
