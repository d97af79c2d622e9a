"""A vLLM emulator: vLLM's OpenAI-compatible API and ``/metrics``, timed by the instance simulator.

``phasewise emulate`` (:mod:`routerd.emulator.cli`) runs it. Layout:
:mod:`~routerd.emulator.engine` (real-time engines, pure of HTTP),
:mod:`~routerd.emulator.openai_api` (aiohttp handlers),
:mod:`~routerd.emulator.metrics` (vLLM-named Prometheus metrics),
:mod:`~routerd.emulator.server` (settings; start and stop).
"""
