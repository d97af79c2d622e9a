"""Profile files are read on every load (routerd's reload after a profile job relies on it)."""

import pytest
import yaml

from routerd.predictor.base import PredictorError, parse_edges
from routerd.profiles import ProfileError, get_profile


def test_a_profile_file_rewritten_in_place_is_read_again(tmp_path):
    shipped = get_profile("llama2-7b-a100")
    data = shipped.model_dump(mode="json")
    path = tmp_path / "profile.yaml"
    path.write_text(yaml.safe_dump(data))
    assert get_profile(str(path)).prefill_per_token_s == shipped.prefill_per_token_s
    data["prefill_per_token_s"] = 2 * shipped.prefill_per_token_s
    path.write_text(yaml.safe_dump(data))
    assert get_profile(str(path)).prefill_per_token_s == 2 * shipped.prefill_per_token_s


def test_shipped_profiles_are_shared_objects():
    assert get_profile("llama2-7b-v100") is get_profile("llama2-7b-v100")


@pytest.mark.parametrize("change, field", [
    ({"decode_throughput_tokens_per_s": 1.0}, "decode_throughput_tokens_per_s"),
    ({"decode_throughput_tokens_per_s": 0.1}, "decode_throughput_tokens_per_s"),
    ({"decode_throughput_tokens_per_s": None, "decode_token_time_s": 100.0}, "decode_token_time_s"),
])
def test_derived_edges_too_small_name_the_file_and_field(tmp_path, change, field):
    # A throughput too low for 0.5 s to be >= 1 token gives edges like [0, 2, 8]: the
    # error must say which file and which field, not only the edges.
    data = get_profile("llama2-7b-v100").model_dump(mode="json")
    data.update(change)
    path = tmp_path / "slow.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ProfileError) as e:
        get_profile(str(path)).derived_bucket_edges()
    assert "'llama2-7b-v100'" in str(e.value) and field in str(e.value)
    with pytest.raises(PredictorError) as e:
        parse_edges(f"profile:{path}")
    assert str(path) in str(e.value) and field in str(e.value)


@pytest.mark.parametrize("value", [0, -5, "abc", float("nan"), float("inf")])
def test_bad_decode_throughput_names_the_file_and_field(tmp_path, value):
    data = get_profile("llama2-7b-v100").model_dump(mode="json")
    data["decode_throughput_tokens_per_s"] = value
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ProfileError) as e:
        get_profile(str(path))
    assert str(path) in str(e.value) and "decode_throughput_tokens_per_s" in str(e.value)


def test_absent_decode_throughput_is_derived_and_the_shipped_edges_hold(tmp_path):
    assert get_profile("llama2-7b-v100").derived_bucket_edges() == (250, 1000, 4000)
    data = get_profile("llama2-7b-v100").model_dump(mode="json")
    data.pop("decode_throughput_tokens_per_s")
    path = tmp_path / "derived.yaml"
    path.write_text(yaml.safe_dump(data))
    edges = parse_edges(f"profile:{path}")
    assert edges[0] >= 1 and list(edges) == sorted(set(edges))
