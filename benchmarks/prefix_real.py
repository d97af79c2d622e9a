"""Precise prefix routing in front of real vLLM engines: issue 31's two precise-mode targets, measured.

routerd (``phasewise serve``, ``prefix.mode: precise``, the tiny model's folder as tokenizer and
chat template, KV events from every engine, no block size configured) in front of two real vLLM
0.32 CPU engines at their default block size (128), serving the tiny model and two LoRA adapters.
A mix of prefix groups (``tests/realvllm/prefix_workload.py``: completions and chat, streamed and
not, some with ``cache_salt``, the base model and each adapter), each sent ``--repeats`` times
after its first request, groups interleaved, one request at a time, through the official
``openai`` client. Ground truth is vLLM's own ``usage.prompt_tokens_details.cached_tokens``.

Printed (and written with ``--json``):

* repeats that found their prefix cached on the engine routerd chose (target >= 95%);
* requests whose ``x-phasewise-cached-tokens`` is within one block (128 tokens) of vLLM's count
  (target >= 95%);
* the same per group kind, the LoRA groups among them;
* isolation: each group's shared text sent again under every other adapter and salt: requests
  that cannot share KV must find 0 cached tokens in vLLM and 0 estimated by routerd.

Usage: python benchmarks/prefix_real.py [--groups-seeds 3] [--repeats 4] [--policy phasewise] [--json FILE]
Needs the vLLM venv (``tools/real_vllm/build.sh``); about 3-4 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups-seeds", type=int, default=3, help="sets of the 9 prefix groups (default 3: 27 groups)")
    ap.add_argument("--repeats", type=int, default=4, help="requests per group after its first (default 4)")
    ap.add_argument("--policy", default="phasewise", help="routerd's policy (a cache-aware one; default phasewise)")
    ap.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = ap.parse_args(argv)
    if args.groups_seeds < 1 or args.repeats < 1:
        ap.error("--groups-seeds and --repeats must be >= 1")
    for p in (ROOT / "tools", ROOT / "tests", ROOT / "routerd"):
        sys.path.insert(0, str(p))
    import openai
    import yaml

    from real_vllm.engine import ADAPTERS, MODEL_NAME, VLLMEngine, missing_reason, start_engines, tiny_model, \
        venv_python
    from realvllm.prefix_workload import BLOCK, Group, groups, send, summary
    from stack_processes import Stack, http_get, wait_until

    py = venv_python()
    if py is None:
        print(missing_reason(), file=sys.stderr)
        return 2
    model = tiny_model(py)
    work = Path(tempfile.mkdtemp(prefix="prefix-real-"))
    engines = [VLLMEngine(f"vllm{i}", py, model, work) for i in range(2)]
    t0 = time.monotonic()
    start_engines(engines)
    print(f"2 engines ready in {time.monotonic() - t0:.0f} s (logs in {work})", flush=True)
    cfg = {"policy": {"name": args.policy}, "predictor": "none",
           "prefix": {"mode": "precise", "tokenizer": str(model.model)},
           "endpoints": [{"name": f"vllm{i}", "url": e.url, "kv_events": e.kv_events_address}
                         for i, e in enumerate(engines)]}
    (work / "routerd.yaml").write_text(yaml.safe_dump(cfg))
    stack = Stack(work, n=0, sidecars=False, startup_timeout_s=120,
                  routerd_flags=("--config", str(work / "routerd.yaml")))
    try:
        stack.start()
        wait_until(lambda: http_get(stack.url + "/v1/models"),
                   lambda r: r[0] == 200 and all(f'"{a}"'.encode() in r[1] for a in ADAPTERS), 60, "model lists")
        gs = [g for k in range(args.groups_seeds) for g in groups(seed=100 + k, model=MODEL_NAME, adapters=ADAPTERS)]
        rng = random.Random(0)
        results = []
        t1 = time.monotonic()
        with openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
            for _ in range(1 + args.repeats):
                for g in gs:
                    results.append(send(client, g, rng))
            iso = []
            for g in gs:
                for m, salt in [(MODEL_NAME, None), *[(a, None) for a in ADAPTERS], (MODEL_NAME, "iso"),
                                (ADAPTERS[0], "iso")]:
                    if (m, salt) == (g.model, g.salt):
                        continue
                    probe = Group(g.name + "-iso", g.prefix, g.kind, False, m, salt, sent=99)
                    iso.append((g.name, m, salt, send(client, probe, rng)))
        took = time.monotonic() - t1
        sm = summary(results)
        kinds: dict[str, list] = {}
        for r in results:
            kinds.setdefault(r.group.rsplit("-", 1)[0], []).append(r)
        per_kind = {k: summary(v) for k, v in sorted(kinds.items())}
        leaks = [(g, m, s, r.cached, r.estimate) for g, m, s, r in iso if r.cached or r.estimate]
        out = {"policy": args.policy, "groups": len(gs), "requests": len(results), "seconds": round(took, 1),
               "summary": sm, "per_kind": per_kind, "isolation_probes": len(iso), "isolation_leaks": leaks}
        print(f"\npolicy {args.policy}: {len(gs)} prefix groups x {1 + args.repeats} requests = {len(results)} "
              f"requests in {took:.0f} s, endpoints {sm['endpoints']}")
        print(f"repeats that found their prefix cached on the chosen engine: {sm['repeat_hits']}/{sm['repeats']} "
              f"= {100 * sm['repeat_hit_share']:.1f}% (target >= 95%)")
        print(f"x-phasewise-cached-tokens within one block ({BLOCK}) of vLLM's cached_tokens: "
              f"{sm['estimate_within_block']}/{sm['requests']} = {100 * sm['estimate_share']:.1f}% (target >= 95%)")
        print(f"\n{'kind':<22}{'repeat hits':>14}{'estimate ok':>14}")
        for k, v in per_kind.items():
            print(f"{k:<22}{v['repeat_hits']:>8}/{v['repeats']:<5}{v['estimate_within_block']:>8}/{v['requests']:<5}")
        print(f"\nisolation: {len(iso)} probes of a group's text under another adapter or salt; "
              f"{len(leaks)} found or estimated cached tokens" + (f": {leaks[:5]}" if leaks else ""))
        if args.json:
            args.json.write_text(json.dumps(out, indent=2, default=str))
    finally:
        stack.close()
        for e in engines:
            e.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
