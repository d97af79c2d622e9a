"""``phasewise sidecar``: reports one vLLM instance's state to routerd over gRPC.

- :mod:`~routerd.sidecar.metrics`: vLLM ``/metrics`` text → :class:`VllmMetrics`;
- :mod:`~routerd.sidecar.scraper`: the fixed-rate scrape loop;
- :mod:`~routerd.sidecar.server`: ``phasewise.v1.InstanceStateService`` + ``grpc.health.v1``;
- :mod:`~routerd.sidecar.client`: :class:`InstanceStateWatcher`, what routerd uses to follow a sidecar;
- :mod:`~routerd.sidecar.cli`: the ``phasewise sidecar`` command.

Importing this package loads no network library; import the submodules for that.
"""
