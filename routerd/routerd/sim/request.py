"""Mutable per-request simulation state (one object per request, slots for speed)."""

from __future__ import annotations

WAITING = 0
PREFILL = 1
DECODE = 2
DONE = 3


class SimRequest:
    """A request inside the simulator: identity, prediction and lifecycle timestamps.

    Times are seconds of simulated time; token counts are tokens. While the request
    decodes, ``generated`` is *not* updated every iteration: the instance derives it as
    ``gen_base + D - dec_base`` from its decode-iteration counter ``D`` (that is what
    keeps the simulation's cost proportional to events, not tokens).
    """

    __slots__ = (
        "id", "arrival_s", "prompt", "output", "bucket", "pred_tokens", "task",
        "features",
        "dispatch_s", "scheduled_s", "first_token_s", "finish_s", "preemptions", "instance",
        "state", "generated", "computed", "target", "blocks", "dec_base", "gen_base",
        "finish_D", "epoch", "phase", "hist_bin", "inv_T", "w",
        "prefix", "response_id", "seq_ext", "seq_share", "pst", "cached_tokens",
    )

    def __init__(
        self,
        id: int,
        arrival_s: float,
        prompt: int,
        output: int,
        bucket: int | None,
        pred_tokens: float,
        task: str | None = None,
    ) -> None:
        self.id = id
        self.arrival_s = arrival_s
        self.prompt = prompt
        self.output = output
        self.bucket = bucket
        self.pred_tokens = pred_tokens
        self.task = task
        self.features = None
        self.dispatch_s = -1.0
        self.scheduled_s = -1.0
        self.first_token_s = -1.0
        self.finish_s = -1.0
        self.preemptions = 0
        self.instance = -1
        self.state = WAITING
        self.generated = 0
        self.computed = 0
        self.target = prompt  # tokens to compute before the next output token
        self.blocks = 0
        self.dec_base = 0
        self.gen_base = 0
        self.finish_D = 0
        self.epoch = 0
        self.phase = 0
        #: Bin of the predicted output in the load summary (0: < 256, 1: < 2048, 2: more).
        self.hist_bin = 0 if pred_tokens < 256 else (1 if pred_tokens < 2048 else 2)
        #: RL reward weights (set by routerd.rl): 1 / estimated processing time (1/s) and
        #: that divided by the predicted output length (1/(s*token)).
        self.inv_T = 0.0
        self.w = 0.0
        #: The prompt's KV blocks as extents (routerd.prefix.chain), None without prefix identity.
        self.prefix = None
        #: Content id of the response (a later prompt may resend it); None: unique to this request.
        self.response_id: int | None = None
        #: Extents of its whole sequence (prompt, then response), set with ``prefix``.
        self.seq_ext = None
        #: Leading blocks of ``seq_ext`` that other requests of the workload share.
        self.seq_share = 1 << 62
        #: Its place in the instance's prefix cache (routerd.prefix.cache.PrefixState), or None.
        self.pst = None
        #: Prompt tokens served from the prefix cache at its first admission (-1: not admitted yet).
        self.cached_tokens = -1
