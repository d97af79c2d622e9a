"""Generated gRPC stubs of proto/phasewise/v1 (see routerd.api.codegen)."""
