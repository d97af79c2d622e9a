"""Profile files are read on every load (routerd's reload after a profile job relies on it)."""

import yaml

from routerd.profiles import get_profile


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
