"""Registers the conformance fixtures (defined in :mod:`conformance.backends`)."""

from conformance.backends import backend, emulator_backend, kv_sub, small_backend  # noqa: F401
