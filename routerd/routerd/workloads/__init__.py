"""Workloads: request traces, workload generators and a name registry.

Public API:

- :class:`WorkloadError` - every bad-input error (one line: file, row, field).
- :func:`load_azure_csv`, :func:`load_mooncake_jsonl` - trace loaders (Mooncake
  ``hash_ids`` become ``Request.prefix``, :func:`mooncake_units`).
- :func:`mean_rate`, :func:`rescale_to_rate`, :func:`poisson_arrivals` - arrival timing.
- :func:`public_mix` (real public prompt/response lengths), :func:`paper_mix`
  (synthetic stand-in for arXiv 2408.13510's mix), :func:`shared_prefix` (llm-d
  capacity-benchmark shape with prefix identity; :class:`SharedPrefixParams`,
  :data:`SHARED_PREFIX_PRESETS`), :func:`conversations` (multi-turn chat sessions with growing
  history and bursty arrivals; :class:`ConversationParams`, :data:`CONVERSATION_PRESETS`).
- :func:`load_workload`, :class:`Workload`, :data:`WORKLOAD_NAMES`,
  :func:`resolve_data_dir` - workloads by name.
"""

from .conversations import (
    CONVERSATION_PRESETS,
    ConversationParams,
    conversations,
    parse_conversations_spec,
)
from .errors import WorkloadError
from .paper_mix import PAPER_LONG_SHARE, PAPER_TASKS, PaperTask, expected_stats, paper_mix
from .public_mix import DEFAULT_ALPACA_MODEL, PromptGroup, public_mix, public_mix_groups
from .registry import (
    DATA_DIR_ENV,
    DEFAULT_N,
    DEFAULT_RATE,
    DEFAULT_WORKLOAD,
    GENERATOR_NAMES,
    WORKLOAD_NAMES,
    Workload,
    load_workload,
    resolve_data_dir,
)
from .shared_prefix import (
    SHARED_PREFIX_PRESETS,
    SharedPrefixParams,
    parse_shared_prefix_spec,
    shared_prefix,
)
from .traces import (
    AZURE_COLUMNS,
    MOONCAKE_BLOCK_TOKENS,
    MOONCAKE_FIELDS,
    MOONCAKE_HASH_FIELD,
    load_azure_csv,
    load_mooncake_jsonl,
    mean_rate,
    mooncake_units,
    poisson_arrivals,
    rescale_to_rate,
)

__all__ = [
    "AZURE_COLUMNS",
    "CONVERSATION_PRESETS",
    "ConversationParams",
    "DATA_DIR_ENV",
    "DEFAULT_ALPACA_MODEL",
    "DEFAULT_N",
    "DEFAULT_RATE",
    "DEFAULT_WORKLOAD",
    "GENERATOR_NAMES",
    "MOONCAKE_BLOCK_TOKENS",
    "MOONCAKE_FIELDS",
    "MOONCAKE_HASH_FIELD",
    "PAPER_LONG_SHARE",
    "PAPER_TASKS",
    "PaperTask",
    "PromptGroup",
    "SHARED_PREFIX_PRESETS",
    "SharedPrefixParams",
    "WORKLOAD_NAMES",
    "Workload",
    "WorkloadError",
    "conversations",
    "expected_stats",
    "load_azure_csv",
    "load_mooncake_jsonl",
    "load_workload",
    "mean_rate",
    "mooncake_units",
    "paper_mix",
    "parse_conversations_spec",
    "parse_shared_prefix_spec",
    "poisson_arrivals",
    "public_mix",
    "public_mix_groups",
    "rescale_to_rate",
    "resolve_data_dir",
    "shared_prefix",
]
