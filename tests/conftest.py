"""Shared fixtures: small hand-checkable profiles."""

from __future__ import annotations

import pytest

from routerd.profiles import HardwareProfile


def toy_profile(**overrides) -> HardwareProfile:
    """A profile with round numbers so latencies can be computed by hand."""
    base = dict(
        name="toy",
        overhead_s=0.01,
        prefill_per_token_s=0.001,
        prefill_attn_s=0.0,
        decode_per_seq_s=0.002,
        decode_per_ctx_token_s=0.0001,
        kv_capacity_tokens=1024,
        block_size=16,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        chunked_prefill=False,
        max_model_len=64,
        grad1=3.2e-4,
        grad2=3.3e-5,
        decode_token_time_s=0.02,
    )
    base.update(overrides)
    return HardwareProfile(**base)


@pytest.fixture
def toy():
    return toy_profile
