"""Names of the Endpoint Picker protocol and of Phasewise's Envoy configuration (no imports: the
operator renders :mod:`routerd.epp.envoy_config` without gRPC).

Protocol names: ``kubernetes-sigs/gateway-api-inference-extension``
``docs/proposals/004-endpoint-picker-protocol/README.md``.
"""

#: The destination header and its dynamic metadata key (``ip:port[,ip:port...]``).
DEST_HEADER = "x-gateway-destination-endpoint"
#: Dynamic metadata namespace of the destination, and of the served endpoint the proxy reports.
LB_NAMESPACE = "envoy.lb"
#: Response-phase metadata key naming the endpoint that served (``ip:port``).
SERVED_KEY = "x-gateway-destination-endpoint-served"
#: Metadata namespace and key of the gateway's subset hint (a list of ``ip:port``).
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
#: Request header the picker sets: efficient mode matches access-log entries by it.
REQUEST_ID_HEADER = "x-phasewise-request-id"
#: Dynamic metadata namespace the shipped Lua filter writes (efficient mode).
LUA_NAMESPACE = "phasewise"
#: Response headers on every routed answer (routerd's proxy and the picker): the endpoint that
#: served, and routerd's estimate of the prompt tokens it had cached (absent with prefix scoring off).
ENDPOINT_HEADER = "x-phasewise-endpoint"
CACHED_TOKENS_HEADER = "x-phasewise-cached-tokens"
