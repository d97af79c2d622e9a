"""A plain :class:`~routerd.policies.base.InstanceView` built from explicit values.

Tests use it to hand-make cluster states; the live daemon fills it from scraped
engine metrics (``vllm:num_requests_running``, ``..._waiting``, KV usage) plus its
own record of the requests it dispatched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from routerd.policies.base import LoadSummary, ResidentRequest, summarize_residents


@dataclass(slots=True)
class StaticInstanceView:
    """One instance's state given as values (satisfies ``InstanceView``).

    ``requests`` holds the resident requests, running first then waiting, as
    ``residents()`` promises; it may be empty when only the counts are known (a
    daemon without per-request detail), so the counts are not checked against it.
    """

    index: int
    num_running: int = 0
    num_waiting: int = 0
    kv_used_blocks: int = 0
    """KV-cache blocks in use (blocks)."""
    kv_total_blocks: int = 1
    """KV-cache blocks on the instance (blocks, > 0)."""
    block_size: int = 16
    """Tokens per KV block."""
    requests: Sequence[ResidentRequest] = ()

    def __post_init__(self) -> None:
        if self.kv_total_blocks <= 0 or self.block_size <= 0:
            raise ValueError(f"instance {self.index}: kv_total_blocks and block_size must be > 0")
        if min(self.num_running, self.num_waiting, self.kv_used_blocks) < 0:
            raise ValueError(f"instance {self.index}: counts must be >= 0")
        if self.kv_used_blocks > self.kv_total_blocks:
            raise ValueError(
                f"instance {self.index}: kv_used_blocks={self.kv_used_blocks} > kv_total_blocks={self.kv_total_blocks}"
            )

    @property
    def kv_usage(self) -> float:
        """Used / total KV blocks, 0..1."""
        return self.kv_used_blocks / self.kv_total_blocks

    def residents(self) -> Sequence[ResidentRequest]:
        """The resident requests, running first then waiting."""
        return self.requests

    def load_summary(self) -> LoadSummary:
        """Aggregates of ``requests`` (O(residents))."""
        return summarize_residents(self.requests)

    @classmethod
    def from_residents(
        cls,
        index: int,
        residents: Iterable[ResidentRequest],
        *,
        kv_total_blocks: int,
        block_size: int = 16,
        kv_used_blocks: int | None = None,
    ) -> "StaticInstanceView":
        """Derive the counts from ``residents`` (reordered: running first, then waiting).

        Unless given, ``kv_used_blocks`` is what the running requests hold: the
        blocks for ``prompt_tokens + generated_tokens`` of each (waiting ones hold none).
        """
        res = list(residents)
        running = [r for r in res if not r.waiting]
        waiting = [r for r in res if r.waiting]
        if kv_used_blocks is None:
            kv_used_blocks = sum(-(-(r.prompt_tokens + r.generated_tokens) // block_size) for r in running)
        return cls(
            index=index,
            num_running=len(running),
            num_waiting=len(waiting),
            kv_used_blocks=kv_used_blocks,
            kv_total_blocks=kv_total_blocks,
            block_size=block_size,
            requests=tuple(running + waiting),
        )
