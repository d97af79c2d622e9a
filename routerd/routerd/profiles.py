"""Hardware profiles: the per-iteration latency model and the scheduler limits of one instance.

One iteration (a vLLM engine step) that computes ``P`` prefill tokens in chunks
``c_k`` (each with ``kv_k`` tokens already cached for that request) and ``B`` decodes
whose KV contexts sum to ``S`` tokens takes::

    t = overhead_s
        + prefill_per_token_s * P
        + prefill_attn_s * sum_k c_k * (kv_k + c_k)     # prefill attention, quadratic
        + decode_per_seq_s * B
        + decode_per_ctx_token_s * S                   # decode attention reads the KV cache

This is the closed form of ``vllm-and-simulators.md`` §6.1 (Vidur-style: a fixed
overhead, linear token terms, attention terms) without the flat small-batch floor.
Each shipped profile lives in ``routerd/data/profiles/<name>.yaml`` with the source
of every number beside it.
"""

from __future__ import annotations

import math
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Sequence

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


THROUGHPUT_CONTEXT_TOKENS = 1024
"""Resident tokens per request assumed when a profile's decode throughput is derived from
its latency model (the Vidur A100 decode point the shipped A100 profile uses, B = 32 at 1K)."""


class ProfileError(ValueError):
    """A profile name is unknown or a profile file is invalid."""


class HardwareProfile(BaseModel):
    """Latency model and scheduler limits of one serving instance (one model on one GPU)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    name: str
    """Profile name, e.g. ``llama2-7b-a100``."""
    model: str | None = None
    """The model it serves (any stable name, e.g. ``llama2-7b``), which decides which profiles may
    share a pool (:func:`check_pool`); None: taken from ``name`` as ``<model>-<gpu>``."""
    description: str = ""
    """What hardware and model the profile describes, and how it was calibrated."""
    overhead_s: float = Field(ge=0)
    """Fixed cost of every iteration (s): scheduler, sampler, kernel launches."""
    prefill_per_token_s: float = Field(ge=0)
    """Cost per prefill token in the batch (s/token), linear layers."""
    prefill_attn_s: float = Field(default=0.0, ge=0)
    """Prefill attention cost per chunk token times attended tokens (s/token^2)."""
    decode_per_seq_s: float = Field(ge=0)
    """Cost per decoding request in the batch (s/request)."""
    decode_per_ctx_token_s: float = Field(ge=0)
    """Cost per resident context token of the decoding requests (s/token)."""
    kv_capacity_tokens: int = Field(gt=0)
    """KV-cache capacity in tokens (a multiple of ``block_size``)."""
    block_size: int = Field(default=16, gt=0)
    """KV-cache block size in tokens (vLLM default 16)."""
    max_num_seqs: int = Field(gt=0)
    """Most requests running at once (vLLM ``max_num_seqs``)."""
    max_num_batched_tokens: int = Field(gt=0)
    """Token budget of one iteration (vLLM ``max_num_batched_tokens``)."""
    chunked_prefill: bool
    """Whether a prefill may be split across iterations to fit the token budget."""
    max_model_len: int = Field(gt=0)
    """Longest prompt + output a request may have (tokens)."""
    prefix_caching: bool = True
    """Automatic prefix caching (vLLM V1's default, ``enable_prefix_caching``): full blocks of
    earlier prompts are reused instead of recomputed (:mod:`routerd.prefix.cache`). Only requests
    with prefix identity (``Request.prefix``) take part."""
    grad1: float = Field(gt=0)
    """Mixing estimator: prefill time per prompt token (s/token), paper §5.2."""
    grad2: float = Field(gt=0)
    """Mixing estimator: decode-side gradient (paper §5.2; units unclear, see estimator)."""
    decode_token_time_s: float = Field(gt=0)
    """Average decode iteration time under load (s); converts decode tokens to seconds."""
    decode_throughput_tokens_per_s: float | None = Field(default=None, gt=0)
    """Decode tokens per second of one instance under load (tokens/s, all its requests
    together): turns the predictor's bucket times into token edges (paper §5.1: about 500
    on the paper's V100). None derives it from the latency model, see
    :meth:`decode_throughput`."""
    heavy_prefill_s: float = Field(default=0.5, gt=0)
    """Prefill time at or above which a prompt is heavy (paper §4.2: 0.5 s)."""
    heavy_decode_s: float = Field(default=5.0, gt=0)
    """Decode time at or above which a response is heavy (paper §4.2: 5 s)."""
    sources: dict[str, str] = Field(default_factory=dict)
    """Where each number comes from (field name -> source)."""

    @model_validator(mode="after")
    def _check_limits(self) -> "HardwareProfile":
        if self.kv_capacity_tokens % self.block_size:
            raise ValueError(
                f"kv_capacity_tokens={self.kv_capacity_tokens} is not a multiple of block_size={self.block_size}"
            )
        if self.num_blocks < -(-self.max_model_len // self.block_size):
            # vLLM refuses to start when one full-length request cannot fit the cache.
            raise ValueError(
                f"kv_capacity_tokens={self.kv_capacity_tokens} cannot hold one request of "
                f"max_model_len={self.max_model_len} tokens"
            )
        if self.max_num_batched_tokens < self.max_num_seqs:
            # vLLM refuses this too: every running decode must fit one step's budget.
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} < max_num_seqs={self.max_num_seqs}"
            )
        if not self.chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                "without chunked prefill max_num_batched_tokens must be >= max_model_len "
                f"({self.max_num_batched_tokens} < {self.max_model_len}), as in vLLM"
            )
        return self

    @property
    def num_blocks(self) -> int:
        """KV-cache blocks per instance."""
        return self.kv_capacity_tokens // self.block_size

    def prefill_time(self, tokens: int, cached: int = 0) -> float:
        """Time (s) of an iteration that only prefills ``tokens`` tokens of one request."""
        return (
            self.overhead_s
            + self.prefill_per_token_s * tokens
            + self.prefill_attn_s * tokens * (cached + tokens)
        )

    def decode_time(self, batch: int, context_tokens: int) -> float:
        """Time (s) of a decode-only iteration of ``batch`` requests with ``context_tokens`` resident."""
        return self.overhead_s + self.decode_per_seq_s * batch + self.decode_per_ctx_token_s * context_tokens

    def lone_request_time(self, prompt: int, output: int) -> float:
        """E2E latency (s) of one request alone on the instance (chunking ignored)."""
        t = self.prefill_time(prompt)
        n = output - 1  # decode iterations after the prefill produced the first token
        # contexts prompt+1 .. prompt+n: arithmetic series
        ctx_sum = n * prompt + n * (n + 1) // 2
        return t + n * (self.overhead_s + self.decode_per_seq_s) + self.decode_per_ctx_token_s * ctx_sum

    def blocks_for(self, tokens: int) -> int:
        """KV blocks needed to hold ``tokens`` tokens."""
        return -(-tokens // self.block_size)

    def heavy_prefill(self, prompt_tokens: int) -> bool:
        """Paper §4.2 class: prefill time >= ``heavy_prefill_s``."""
        return self.grad1 * prompt_tokens >= self.heavy_prefill_s

    def heavy_decode(self, output_tokens: float) -> bool:
        """Paper §4.2 class: decode time >= ``heavy_decode_s``."""
        return output_tokens * self.decode_token_time_s >= self.heavy_decode_s

    def decode_tokens_per_second(self) -> float:
        """Decode tokens per second at the average decode iteration time, for one request."""
        return 1.0 / self.decode_token_time_s

    def decode_throughput(self, context_tokens_per_request: int = THROUGHPUT_CONTEXT_TOKENS) -> float:
        """Decode tokens per second of the whole instance under load (tokens/s).

        ``decode_throughput_tokens_per_s`` when set. Otherwise the batch ``B`` whose
        decode iteration, with ``context_tokens_per_request`` resident tokens per
        request, lasts ``decode_token_time_s`` (the profile's "iteration under load"):
        ``B = (decode_token_time_s - overhead_s) / (decode_per_seq_s + context *
        decode_per_ctx_token_s)``, capped at ``max_num_seqs`` and at least 1, gives
        ``B / decode_token_time_s``. For ``llama2-7b-a100`` that is the Vidur point the
        profile's iteration time comes from (B = 32 at 1K context): about 1,600 tokens/s.
        """
        if self.decode_throughput_tokens_per_s is not None:
            return self.decode_throughput_tokens_per_s
        per_request = self.decode_per_seq_s + context_tokens_per_request * self.decode_per_ctx_token_s
        spare = self.decode_token_time_s - self.overhead_s
        batch = spare / per_request if per_request > 0 and spare > 0 else 1.0
        return min(max(batch, 1.0), float(self.max_num_seqs)) / self.decode_token_time_s

    def derived_bucket_edges(self, base_s: float = 0.5, factor: float = 4.0, n: int = 3) -> tuple[int, ...]:
        """Bucket edges (tokens) from the instance's decode throughput: the tokens it decodes in
        ``base_s * factor**k`` seconds, ``k < n`` (paper §5.1: 0.5 / 2 / 8 s at about 500
        tokens/s give 250 / 1000 / 4000 tokens).

        The paper's rate is the instance's throughput under load, not one request's speed
        (one request decodes at about 28 tokens/s on the V100, which would give 14 / 57 / 228)."""
        rate = self.decode_throughput()
        edges = tuple(int(math.floor(base_s * factor**k * rate)) for k in range(n))
        if not edges or edges[0] < 1 or any(b <= a for a, b in zip(edges, edges[1:])):
            field = ("decode_throughput_tokens_per_s" if self.decode_throughput_tokens_per_s is not None
                     else "decode_token_time_s (decode_throughput_tokens_per_s absent)")
            raise ProfileError(
                f"profile {self.name!r}: field {field}: a decode throughput of {rate:g} "
                f"tokens/s gives bucket edges {list(edges)}, which are not positive and strictly increasing "
                f"(needs >= {1 / base_s:g} tokens/s)")
        return edges


def _profiles_dir() -> Path:
    return Path(str(resources.files("routerd") / "data" / "profiles"))


def profile_names() -> list[str]:
    """Names of the shipped profiles, sorted."""
    return sorted(p.stem for p in _profiles_dir().glob("*.yaml"))


def read_yaml_mapping(path: Path, what: str, error: type[Exception]) -> dict:
    """The mapping in YAML file ``path`` (a ``what``: "profile", "GPU spec").

    Raises:
        error: the file is missing or unreadable, not UTF-8, not YAML (with the line and
            column) or not a mapping; one line naming the file.
    """
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise error(f"{path}: cannot read {what}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise error(f"{path}: not UTF-8 text") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or "syntax error"
        raise error(f"{path}: not valid YAML{where}: {problem}") from None
    if not isinstance(data, dict):
        raise error(f"{path}: a {what} must be a mapping of fields")
    return data


def load_profile_file(path: str | Path) -> HardwareProfile:
    """Load a profile from a YAML file.

    Raises:
        ProfileError: the file is missing, not YAML, or a field is invalid (named in the message).
    """
    path = Path(path)
    data = read_yaml_mapping(path, "profile", ProfileError)
    try:
        return HardwareProfile.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"]) or "profile"
        raise ProfileError(f"{path}: field {loc}: {err['msg']}") from None


def get_profile(name_or_path: str) -> HardwareProfile:
    """A shipped profile by name, or a profile YAML file by path.

    Shipped profiles are read once and cached; a path is read on every call, so a
    profile file rewritten in place (a routerd reload after a profile job) is seen.

    Raises:
        ProfileError: unknown name (the message lists the valid ones) or invalid file.
    """
    if name_or_path.endswith((".yaml", ".yml")) or "/" in name_or_path:
        return load_profile_file(name_or_path)
    return _shipped_profile(name_or_path)


@cache
def _shipped_profile(name: str) -> HardwareProfile:
    path = _profiles_dir() / f"{name}.yaml"
    if not path.exists():
        raise ProfileError(f"unknown profile {name!r}; valid: {', '.join(profile_names())}")
    return load_profile_file(path)


# ---------------------------------------------------------------------------------------------
# Pools: one profile per instance (mixed GPU generations serving one model)


class PoolError(ProfileError):
    """A pool specification is malformed, or its profiles cannot serve one model together."""


def profile_model(profile: HardwareProfile) -> str:
    """The model a profile serves: its ``model`` field when set, else from its name, everything
    before the last ``-`` (the shipped naming ``<model>-<gpu>``: ``llama3.1-8b-h100`` serves
    ``llama3.1-8b``; a name without ``-`` is its own model). A profile named otherwise (e.g. one
    ``phasewise profile --derive`` named ``llama-2-7b-a100-80gb-sxm``) joins a pool of shipped
    ones by a ``model:`` line equal to theirs (``llama2-7b``)."""
    if profile.model:
        return profile.model
    head, sep, _ = profile.name.rpartition("-")
    return head if sep and head else profile.name


def terms_key(profile: HardwareProfile) -> str:
    """The profile's terms as one comparable string: equal for two profiles that model the same
    hardware whatever their name, description, sources or ``model`` line (an inline copy of a
    shipped profile, or the same YAML under another name). What makes a pool mixed for the
    defaults (``phasewise bench``'s policies, the operator's ``routing.policy``)."""
    return repr(sorted(profile.model_dump(exclude={"name", "description", "sources", "model"}).items()))


def check_pool(profiles: Sequence[HardwareProfile]) -> None:
    """Check that ``profiles`` (one per instance) can serve one model as one pool.

    Raises:
        PoolError: no profiles; two profiles of different models (:func:`profile_model`),
            naming both; or two block sizes (the router keys prompts in one block size).
    """
    if not profiles:
        raise PoolError("a pool needs at least one instance")
    first = profiles[0]
    for p in profiles[1:]:
        if profile_model(p) != profile_model(first):
            raise PoolError(
                f"pool mixes profiles of different models: {first.name!r} serves {profile_model(first)!r}, "
                f"{p.name!r} serves {profile_model(p)!r}; a pool serves one model (a profile's model is its "
                "'model:' field, else its name as <model>-<gpu>: if both serve one model, give their YAML the "
                "same 'model:')")
        if p.block_size != first.block_size:
            raise PoolError(f"pool mixes KV block sizes: {first.name!r} has {first.block_size}, {p.name!r} "
                            f"has {p.block_size}; every instance of a pool must use one block size")


def parse_pool(text: str) -> tuple[HardwareProfile, ...]:
    """``"2xllama3.1-8b-a100,2xllama3.1-8b-h100"`` -> one profile per instance, in order.

    Items are ``COUNT x PROFILE`` separated by ``,`` (spaces allowed around ``x`` and ``,``;
    ``PROFILE`` a shipped name or a YAML path, as :func:`get_profile`).

    Raises:
        PoolError: an item that is not ``COUNT x PROFILE`` with ``COUNT >= 1`` (named), an
            empty item (a stray ``,``), an empty list, or profiles that cannot share a pool
            (:func:`check_pool`).
        ProfileError: an unknown profile name (the message lists the valid ones) or an
            invalid profile file.
    """
    out: list[HardwareProfile] = []
    items = text.split(",") if text.strip() else []  # an empty list is said below
    for k, raw in enumerate(items):
        item = raw.strip()
        if not item:
            # A stray ',' is a typo for an item, not a smaller pool (e.g. "2xA,,2xB" or "2xA,").
            raise PoolError(f"pool {text!r}: item {k + 1} of {len(items)} is empty; expected COUNT x PROFILE "
                            "items separated by ','")
        count, sep, name = item.partition("x")
        count, name = count.strip(), name.strip()
        if not sep or not count.isdigit() or not name:
            raise PoolError(f"pool item {item!r}: expected COUNT x PROFILE, e.g. 2xllama3.1-8b-h100")
        n = int(count)
        if n < 1:
            raise PoolError(f"pool item {item!r}: COUNT must be >= 1")
        out.extend([get_profile(name)] * n)
    if not out:
        raise PoolError(f"pool {text!r} is empty; expected COUNT x PROFILE items separated by ','")
    check_pool(out)
    return tuple(out)


def pool_label(profiles: Sequence[HardwareProfile]) -> str:
    """A pool's name for tables: the profile's name when every instance has it, else
    ``COUNTxNAME`` for each run of equal consecutive profiles, joined by ``,`` (what
    :func:`parse_pool` reads back)."""
    names = [p.name for p in profiles]
    if len(set(names)) == 1:
        return names[0]
    runs: list[list] = []
    for n in names:
        if runs and runs[-1][1] == n:
            runs[-1][0] += 1
        else:
            runs.append([1, n])
    return ",".join(f"{c}x{n}" for c, n in runs)


def as_pool(profile: "HardwareProfile | Sequence[HardwareProfile]", instances: int) -> tuple[HardwareProfile, ...]:
    """One profile per instance: ``profile`` repeated ``instances`` times, or the sequence as given.

    Raises:
        ValueError: a sequence whose length is not ``instances``.
        PoolError: profiles that cannot share a pool (:func:`check_pool`).
    """
    if isinstance(profile, HardwareProfile):
        return (profile,) * instances
    pool = tuple(profile)
    if len(pool) != instances:
        raise ValueError(f"{len(pool)} profiles for {instances} instances; give one profile per instance")
    check_pool(pool)
    return pool


def pool_admission_profile(profiles: Sequence[HardwareProfile]) -> HardwareProfile:
    """The profile a pool's requests are prepared against (rejection and clipping at
    ``max_model_len``): the first with the smallest ``max_model_len``, so every request kept
    fits every instance (a router cannot know in advance which instance will serve it)."""
    return min(profiles, key=lambda p: p.max_model_len)
