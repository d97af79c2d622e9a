"""Real vLLM engines for tests and benchmarks: the venv (``build.sh``), the tiny model (``make_model.py``),
and :mod:`real_vllm.engine`, which starts, restarts and stops ``vllm.entrypoints.openai.api_server``
processes on loopback. Test tooling: nothing in the ``phasewise`` package imports it."""
