"""A deliberately naive vLLM V1 instance simulator: one loop turn per iteration.

It shares no code with ``routerd.sim``: it keeps every request's token counts and
blocks explicitly and advances token by token. Property tests compare the fast,
event-skipping simulator against it.

Arrival rule, the same at every iteration boundary (there are no segments here): a
request whose arrival is ``<=`` the time ``t`` a step starts joins that step, so one
arriving exactly when an iteration ends is scheduled in the very next iteration. It
agrees with the independent per-iteration reference of issue 13 on this.
"""

from __future__ import annotations

import math
from collections import deque


class Ref:
    def __init__(self, i, arrival, prompt, output):
        self.i, self.arrival, self.prompt, self.output = i, arrival, prompt, output
        self.computed = 0
        self.target = prompt
        self.generated = 0
        self.blocks = 0
        self.state = "waiting"
        self.first = None
        self.finish = None
        self.preemptions = 0


def reference_run(p, reqs, gate="full", boundaries=None):
    """Simulate ``reqs`` = [(arrival s, prompt tokens, output tokens)] on one instance of profile ``p``.

    Returns ``(requests, preemptions, free blocks at the end)``. If ``boundaries`` is a
    list, ``(end time s, decode_only)`` of every iteration is appended to it, in order
    (``decode_only``: the iteration had no prefill chunk), so tests can place arrivals
    exactly on iteration boundaries.
    """
    rs = [Ref(i, a, pr, o) for i, (a, pr, o) in enumerate(reqs)]
    pending = deque(sorted(rs, key=lambda r: (r.arrival, r.i)))
    waiting, running = deque(), []
    bs = p.block_size
    free = p.kv_capacity_tokens // bs
    t = 0.0
    done = 0
    preemptions = 0
    while done < len(rs):
        if not running and not waiting:
            t = max(t, pending[0].arrival)
        while pending and pending[0].arrival <= t:
            waiting.append(pending.popleft())
        budget = p.max_num_batched_tokens
        sched = []
        preempted = False
        i = 0
        while i < len(running):
            r = running[i]
            n = 1 if r.state == "decode" else min(r.target - r.computed, budget)
            if n <= 0:
                i += 1
                continue
            need = math.ceil((r.computed + n) / bs) - r.blocks
            self_preempted = False
            while need > free:
                v = running.pop()
                free += v.blocks
                v.blocks = 0
                v.computed = 0
                v.target = v.prompt + v.generated
                v.state = "waiting"
                v.preemptions += 1
                preemptions += 1
                waiting.appendleft(v)
                preempted = True
                if v is r:
                    self_preempted = True
                    break
            if self_preempted:
                break
            free -= need
            r.blocks += need
            budget -= n
            sched.append((r, n))
            i += 1
        if not preempted:
            while waiting and budget > 0 and len(running) < p.max_num_seqs:
                r = waiting[0]
                n = r.target
                if n > budget:
                    if not p.chunked_prefill:
                        break
                    n = budget
                gate_tokens = r.target if gate == "full" else n
                if math.ceil(gate_tokens / bs) > free:
                    break
                waiting.popleft()
                need = math.ceil(n / bs)
                free -= need
                r.blocks = need
                r.state = "prefill"
                running.append(r)
                budget -= n
                sched.append((r, n))
        if not sched:
            continue  # everything was preempted: schedule again at once
        pf = sum(n for r, n in sched if r.state == "prefill")
        attn = sum(n * (r.computed + n) for r, n in sched if r.state == "prefill")
        dec = [r for r, n in sched if r.state == "decode"]
        ctx = sum(r.computed + 1 for r in dec)
        t += (p.overhead_s + p.prefill_per_token_s * pf + p.prefill_attn_s * attn
              + p.decode_per_seq_s * len(dec) + p.decode_per_ctx_token_s * ctx)
        if boundaries is not None:
            boundaries.append((t, len(dec) == len(sched)))
        for r, n in sched:
            r.computed += n
            if r.state == "prefill" and r.computed < r.target:
                continue
            r.generated += 1
            if r.first is None:
                r.first = t
            r.state = "decode"
            if r.generated >= r.output:
                r.finish = t
                r.state = "done"
                free += r.blocks
                r.blocks = 0
                running.remove(r)
                done += 1
    return rs, preemptions, free
