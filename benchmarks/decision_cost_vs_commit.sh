#!/usr/bin/env bash
# Decision cost of a policy now against the same policy at another commit, in one run:
# benchmarks/prefix_decision_cost.py alternated A B A B A B between a worktree of COMMIT and this
# tree (each run the median of --repeat 3), so both see the same machine state. Prints each run's
# rows; compare the thread-CPU p50 / p99 columns (us per pick).
# Usage: benchmarks/decision_cost_vs_commit.sh COMMIT [POLICY] [INSTANCES]
# e.g.   benchmarks/decision_cost_vs_commit.sh 6b89277 phasewise 16   (issue 32's check)
set -euo pipefail
commit=${1:?usage: $0 COMMIT [POLICY] [INSTANCES]}
policy=${2:-phasewise}
instances=${3:-16}
here=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-$here/.venv/bin/python}
wt=$(mktemp -d /tmp/pw-decision-cost.XXXXXX)
trap 'git -C "$here" worktree remove --force "$wt" >/dev/null 2>&1 || true' EXIT
git -C "$here" worktree add --detach -f "$wt" "$commit" >/dev/null
args=(--n 3000 --repeat 3 --instances "$instances" --tokens 4096 --chunk-blocks 4 --memory-bound 0 --policies "$policy")
for i in 1 2 3; do
  for tree in "$wt" "$here"; do
    label=$([ "$tree" = "$here" ] && echo "this tree" || echo "$commit")
    echo "### run $i: $label"
    (cd "$tree" && PYTHONPATH="$tree/routerd" "$py" benchmarks/prefix_decision_cost.py "${args[@]}" 2>&1 \
      | grep -E "^ +$policy |^pick with")
  done
done
