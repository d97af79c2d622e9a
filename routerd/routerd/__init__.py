"""Phasewise routerd: workload-aware routing for LLM inference (simulator, policies, daemon)."""

__version__ = "0.1.0"
