#!/bin/bash
# routerd end to end under a burst of non-streaming requests (issue #3: `dqn` in routerd).
#
# Starts 4 `phasewise emulate` instances (llama2-7b-a100) with a sidecar each and routerd
# with POLICY in front, all on loopback (ports 8200-8203, 51200-51203, 8300, 50351), then
# sends 2 bursts of 40 concurrent non-streaming completions with the official `openai`
# client (prompt 50 + 20 i words, max_tokens 64 + 8 i) and prints each burst's wall time and
# routerd's router-wait sum and hold count. Everything it starts is stopped at the end.
#
# Usage: PYTHON=/path/to/python benchmarks/routerd_burst.sh POLICY [REPO_DIR]
# Measured (docs/rl.md, "dqn in routerd"): dqn 4.9-5.3 s per burst, late_binding 5.3 s,
# round_robin 4.8 s; dqn before non-streaming requests counted as decoding: 15.1-15.2 s.
set -u
POL=${1:?usage: routerd_burst.sh POLICY [REPO_DIR]}
CODE=${2:-$(cd "$(dirname "$0")/.." && pwd)}
PY=${PYTHON:-python}
export PYTHONPATH=$CODE/routerd
LOGS=$(mktemp -d)
pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null; wait 2>/dev/null; }
trap cleanup EXIT
for i in 0 1 2 3; do
  $PY -m routerd emulate --host 127.0.0.1 --port 820$i --profile llama2-7b-a100 >$LOGS/emu$i.log 2>&1 & pids+=($!)
  $PY -m routerd sidecar --metrics-url http://127.0.0.1:820$i/metrics --listen 127.0.0.1:5120$i --instance emu$i --endpoint http://127.0.0.1:820$i >$LOGS/sc$i.log 2>&1 & pids+=($!)
done
$PY -m routerd serve --host 127.0.0.1 --port 8300 --grpc-host 127.0.0.1 --grpc-port 50351 --policy $POL --profile llama2-7b-a100 \
  --endpoint emu0=http://127.0.0.1:8200,127.0.0.1:51200 --endpoint emu1=http://127.0.0.1:8201,127.0.0.1:51201 \
  --endpoint emu2=http://127.0.0.1:8202,127.0.0.1:51202 --endpoint emu3=http://127.0.0.1:8203,127.0.0.1:51203 >$LOGS/serve.log 2>&1 & pids+=($!)
for k in $(seq 60); do curl -sf http://127.0.0.1:8300/readyz >/dev/null && break; sleep 0.5; done
sleep 2
$PY - <<'PY'
import asyncio, time
from openai import AsyncOpenAI
async def main():
    c = AsyncOpenAI(base_url="http://127.0.0.1:8300/v1", api_key="x", max_retries=0)
    async def one(i):
        return await c.completions.create(model="llama-2-7b", prompt="word " * (50 + 20 * i), max_tokens=64 + 8 * i)
    for rep in range(2):
        t = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(40)))
        print(f"burst {rep}: {time.perf_counter() - t:.2f} s")
asyncio.run(main())
PY
curl -s http://127.0.0.1:8300/metrics | grep -E "^phasewise_router_wait_seconds_(sum|count)|^phasewise_fallbacks_total|^phasewise_holds_total"

