"""Output-length buckets (arXiv 2408.13510 §5.1): the edges and token counts per bucket.

Kept free of pydantic and numpy so that the length predictor, which needs only these,
imports in well under 0.3 s on a core install (:mod:`routerd.model` re-exports them).
"""

from __future__ import annotations

#: Output-length bucket edges in tokens used by the paper's predictor
#: (arXiv 2408.13510 §5.1): 0-250, 250-1000, 1000-4000, >= 4000.
PREDICTOR_BUCKET_EDGES: tuple[int, ...] = (250, 1000, 4000)


def bucket_of(tokens: int, edges: tuple[int, ...] = PREDICTOR_BUCKET_EDGES) -> int:
    """Bucket index of a token count: the number of edges that are <= ``tokens``.

    With the default edges (250, 1000, 4000): 0-249 -> 0, 250-999 -> 1,
    1000-3999 -> 2, >= 4000 -> 3.
    """
    b = 0
    for e in edges:
        if tokens >= e:
            b += 1
        else:
            break
    return b


def bucket_upper_tokens(bucket: int, edges: tuple[int, ...] = PREDICTOR_BUCKET_EDGES) -> int:
    """Upper edge (tokens) of a bucket; the open last bucket uses twice its lower edge.

    Used by ``min_min`` (paper §A.2: completion time = prompt + upper edge of the
    predicted bucket) and by estimators that need one number per bucket.
    """
    if bucket < len(edges):
        return edges[bucket]
    return 2 * edges[-1]


def bucket_mid_tokens(bucket: int, edges: tuple[int, ...] = PREDICTOR_BUCKET_EDGES) -> float:
    """Representative length of a bucket (tokens): the midpoint of its edges.

    The first bucket spans [0, edges[0]); the open last bucket uses 1.5x its lower edge.
    """
    lo = 0 if bucket == 0 else edges[bucket - 1]
    if bucket < len(edges):
        return (lo + edges[bucket]) / 2.0
    return 1.5 * lo
