"""Where routerd's endpoints come from: the contract between endpoint sources and the daemon.

Sources (the static list of the config file, the Kubernetes EndpointSlice watcher)
report the *complete* current set of endpoints each time it changes; the daemon diffs
it against what it routes to. An endpoint that is present but not ready (a pod that
is terminating or failing its readiness probe) receives no new requests while its
in-flight requests finish; an endpoint that disappears is removed once drained.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence


@dataclass(frozen=True, slots=True)
class DiscoveredEndpoint:
    """One serving instance as an endpoint source sees it."""

    name: str
    """Stable instance name: the pod name (EndpointSlice ``targetRef.name``) or the configured name."""
    url: str
    """OpenAI-compatible base URL, e.g. ``http://10.0.0.7:8000`` (no trailing slash)."""
    state_address: str | None = None
    """``host:port`` of the instance's state sidecar (gRPC ``InstanceStateService``), or None."""
    ready: bool = True
    """False while the pod is terminating or not ready: no new requests, in-flight ones finish."""
    models: tuple[str, ...] = ()
    """Models it serves as its source says (configured); empty: learned from its own
    ``/v1/models`` (which for vLLM lists the base model and its loaded LoRA adapters)."""
    kv_events: str | None = None
    """ZMQ address of its vLLM KV-event publisher (``tcp://host:port``). None: not given by the
    source (the daemon uses the URL's host and ``prefix.kv_events.port``); ``""``: it publishes none."""
    profile: str | None = None
    """Its hardware profile (a name or YAML path, ``endpoints[].profile``); None: routerd's ``profile``."""


#: Called with the complete current endpoint set each time it changes. Sources running
#: in a thread (the Kubernetes watcher) call it from that thread; the daemon hops to its
#: event loop itself.
EndpointsCallback = Callable[[Sequence[DiscoveredEndpoint]], None]
