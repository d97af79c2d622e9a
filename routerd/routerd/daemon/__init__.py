"""routerd: the routing daemon (OpenAI-compatible HTTP proxy and gRPC router API)."""
