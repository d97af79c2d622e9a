"""A vLLM emulator: vLLM's OpenAI-compatible API and ``/metrics``, timed by the instance simulator.

``phasewise emulate`` (:mod:`routerd.emulator.cli`) runs it. Layout:
:mod:`~routerd.emulator.engine` (real-time engines, pure of HTTP),
:mod:`~routerd.emulator.openai_api` (aiohttp handlers),
:mod:`~routerd.emulator.metrics` (vLLM-named Prometheus metrics),
:mod:`~routerd.emulator.kv_events` (vLLM's KV-cache events over ZMQ),
:mod:`~routerd.emulator.server` (settings; start and stop).

What matches vLLM 0.32 is what ``tests/conformance`` checks against both servers: ``/v1/models``
(with LoRA adapters), the metric names and labels routerd reads (``vllm:cache_config_info``
included), the KV-event schema (``block_size``, ``medium``, ``lora_name``, ``extra_keys``,
``group_idx``, ...), SSE framing (several tokens per event when behind, the usage chunk,
``[DONE]``, ``return_token_ids``), error bodies and codes, and
``usage.prompt_tokens_details.cached_tokens`` (``cache_salt`` and adapters keyed apart).

Out of scope (``docs/emulator.md`` has the full list): a real tokenizer unless ``--tokenizer`` is
given (4 UTF-8 bytes per token, chat as ``role: content`` lines), generated text (filler words,
always ``max_tokens`` of them), logprobs, ``n`` > 1, several prompts per request, multimodal
input, caching of generated tokens' blocks, vLLM's exact block-hash bytes, LoRA timing and
loading, and vLLM's metrics no router reads.
"""
