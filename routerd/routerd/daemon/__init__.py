"""routerd: the routing daemon (OpenAI-compatible HTTP proxy and gRPC router API).

Modules, each owning one thing:

- :mod:`.config`: settings (YAML file, ``PHASEWISE_*`` environment, flags);
- :mod:`.discovery`: the contract between endpoint sources and the daemon;
- :mod:`.endpointslices`: the Kubernetes EndpointSlice endpoint source;
- :mod:`.state`: per-instance bookkeeping merged with sidecar state (the policies' view);
- :mod:`.router`: the router queue and the decision loop (no HTTP);
- :mod:`.upstream`: the HTTP/1.1 client that relays streams from the instances;
- :mod:`.proxy`: the OpenAI-compatible HTTP front;
- :mod:`.grpc_api`: ``phasewise.v1.RouterService`` and gRPC health;
- :mod:`.metrics`: the ``phasewise_*`` Prometheus metrics;
- :mod:`.app`: the process (start, reload, drain, signals); :mod:`.cli`: ``phasewise serve``.
"""
