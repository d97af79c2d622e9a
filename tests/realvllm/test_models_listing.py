"""``/v1/models`` through routerd keeps real vLLM's cards (issue 31): routerd in front of the shared
pair (the tiny model and its LoRA adapters ``a1``, ``a2``) answers, for every id, the ``root``,
``parent``, ``max_model_len``, ``owned_by`` and ``permission`` fields the engines themselves answer,
and the official ``openai`` client's ``models.list()`` reads them."""

from __future__ import annotations

import json

import openai

from real_vllm.engine import ADAPTERS, MODEL_NAME
from stack_processes import Stack, http_get

#: Card fields that are the same at every read of one engine (``created`` is the read's time and
#: each permission's ``id`` is drawn per read: ``vllm/entrypoints/openai/models/serving.py``).
_STABLE = ("id", "object", "owned_by", "root", "parent", "max_model_len")


def _cards(url: str) -> dict[str, dict]:
    status, body = http_get(url + "/v1/models")
    assert status == 200, body
    return {c["id"]: c for c in json.loads(body)["data"]}


def test_v1_models_through_routerd_has_the_engines_cards(vllm_pair, tmp_path, request):
    # No --model: routerd reads each engine's /v1/models (what it serves, and the cards).
    s = Stack(tmp_path, n=0, sidecars=False, startup_timeout_s=120,
              extra_endpoints=[f"vllm{i}={e.url}" for i, e in enumerate(vllm_pair)],
              routerd_flags=("--predictor", "none")).start_for(request)
    engine = [_cards(e.url) for e in vllm_pair]
    assert set(engine[0]) == set(engine[1]) == {MODEL_NAME, *ADAPTERS}
    got = _cards(s.url)
    assert set(got) == set(engine[0])
    for mid, card in got.items():
        for field in _STABLE:  # what engine 0 (the first ready endpoint) says, and engine 1 agrees
            assert card[field] == engine[0][mid][field] == engine[1][mid][field], (mid, field)
        assert [sorted(p) for p in card["permission"]] == [sorted(p) for p in engine[0][mid]["permission"]]
        assert card["permission"][0]["object"] == "model_permission"
    # The fields the issue names, by hand: the adapters' parent is the base model, whose length is
    # the engines' --max-model-len (2048); an adapter's is vLLM's null.
    assert got[MODEL_NAME]["max_model_len"] == vllm_pair[0].max_model_len == 2048
    assert got[MODEL_NAME]["parent"] is None and got[MODEL_NAME]["root"] == str(vllm_pair[0].model.model)
    for a in ADAPTERS:
        assert got[a]["parent"] == MODEL_NAME and got[a]["root"] == str(vllm_pair[0].model.adapters[a])
        assert got[a]["max_model_len"] is None
    with openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=30) as client:
        listed = {m.id: m for m in client.models.list()}
    assert set(listed) == set(engine[0])
    for a in ADAPTERS:
        assert listed[a].owned_by == "vllm" and listed[a].model_extra["parent"] == MODEL_NAME
    assert listed[MODEL_NAME].model_extra["max_model_len"] == 2048
