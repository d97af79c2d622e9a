"""DQN checkpoints: a folder with ``model.safetensors`` and ``metadata.json``.

``metadata.json`` records: ``format`` (``phasewise-dqn/1``), ``variant``,
``num_instances``, ``obs_version``, ``obs_dim``, ``hidden``, ``profile``, ``workload``,
``hyperparameters``, ``evaluation`` and ``created``. A checkpoint for another
instance count or observation layout is refused with :class:`CheckpointError`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from routerd.policies.base import PolicySetupError
from routerd.policies.dqn.features import OBS_VERSION, obs_dim
from routerd.policies.dqn.network import check_shapes

FORMAT = "phasewise-dqn/1"
DEFAULT_CHECKPOINT = "default"


class CheckpointError(PolicySetupError):
    """A checkpoint is missing, corrupt, or made for another cluster or observation layout."""


@dataclass
class Checkpoint:
    """Loaded weights (numpy, float32) and metadata."""

    path: Path
    weights: dict[str, np.ndarray]
    metadata: dict[str, Any]

    @property
    def num_instances(self) -> int:
        return int(self.metadata["num_instances"])

    def profile_mismatch(self, profile: str) -> str | None:
        """One line saying the checkpoint was trained on another hardware profile than
        ``profile`` (a name), or None when it was trained on that one."""
        trained_on = self.metadata.get("profile")
        if trained_on == profile:
            return None
        return f"checkpoint {self.path}: trained on profile {trained_on}, the benchmark uses {profile}"


def default_checkpoint_path() -> Path:
    """The checkpoint shipped with the package (default profile and instance count)."""
    return Path(str(resources.files("routerd") / "data" / "checkpoints" / "dqn-default"))


def resolve(spec: str | Path) -> Path:
    """``default`` -> the shipped checkpoint; anything else is a folder path."""
    return default_checkpoint_path() if str(spec) == DEFAULT_CHECKPOINT else Path(spec)


def save_checkpoint(path: str | Path, weights: dict[str, np.ndarray], metadata: dict[str, Any]) -> Path:
    """Write ``model.safetensors`` and ``metadata.json`` into folder ``path`` (created)."""
    from safetensors.numpy import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: np.ascontiguousarray(v, dtype=np.float32) for k, v in weights.items()},
              str(path / "model.safetensors"))
    meta = {"format": FORMAT, "obs_version": OBS_VERSION, **metadata}
    (path / "metadata.json").write_text(json.dumps(meta, indent=2, sort_keys=True))
    return path


def load_checkpoint(spec: str | Path, *, num_instances: int | None = None) -> Checkpoint:
    """Load and validate a checkpoint.

    Raises:
        CheckpointError: missing files, unreadable or corrupt weights or metadata, an
            unknown format, another observation version, or (when ``num_instances`` is
            given) another instance count. The message names the folder and the mismatch.
    """
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    path = resolve(spec)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path}: not a folder (expected model.safetensors + metadata.json)")
    meta_path, model_path = path / "metadata.json", path / "model.safetensors"
    for p in (meta_path, model_path):
        if not p.is_file():
            raise CheckpointError(f"checkpoint {path}: missing {p.name}")
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise CheckpointError(f"checkpoint {path}: metadata.json is not valid JSON "
                              f"({'nested too deeply' if isinstance(e, RecursionError) else e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path}: metadata format is {meta.get('format') if isinstance(meta, dict) else None!r}, expected {FORMAT!r}")
    if meta.get("obs_version") != OBS_VERSION:
        raise CheckpointError(
            f"checkpoint {path}: observation layout {meta.get('obs_version')!r} does not match this "
            f"version's {OBS_VERSION!r}; retrain it with `phasewise train`")
    m = meta.get("num_instances")
    if type(m) is not int or m < 1:
        raise CheckpointError(f"checkpoint {path}: metadata num_instances={m!r} is not a positive integer")
    if num_instances is not None and m != num_instances:
        raise CheckpointError(
            f"checkpoint {path}: trained for {m} instances, but the cluster has {num_instances}; "
            f"train one with `phasewise train --instances {num_instances}`")
    try:
        weights = load_file(str(model_path))
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path}: model.safetensors is corrupt ({e})") from None
    except (TypeError, AttributeError) as e:
        # numpy has no bfloat16 or float8 types: safetensors fails before any check here.
        raise CheckpointError(f"checkpoint {path}: model.safetensors holds a tensor type numpy cannot read "
                              f"({e}); save the weights as float32") from None
    try:
        check_shapes(weights, obs_dim(m), m + 1)
    except ValueError as e:
        raise CheckpointError(f"checkpoint {path}: {e}") from None
    return Checkpoint(path, {k: v.astype(np.float32) for k, v in weights.items()}, meta)
