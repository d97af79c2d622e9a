"""Robustness grid (issue 32): one command, resumable, cells in parallel processes.

Every policy on every workload x pool x load (``routerd.robustness``: the defaults are the full
grid, 7 workloads x 7 pools x 3 loads = 147 cells, 3 seeds, 10 policies with the shipped
predictor's buckets plus the 4 prediction readers again with true buckets). One JSON per cell in
``OUT/cells/`` (an interrupted grid resumes without redoing finished cells), then ``OUT/summary.md``
(also printed), ``OUT/summary.json`` and ``OUT/summary.png``.

Usage:
    python benchmarks/robustness.py --out robustness-out                 # the full grid
    python benchmarks/robustness.py --out o --workloads conversations mooncake --pools 8xllama3.1-8b-h100 \\
        --loads 1.5 --seeds 3 -n 500 --jobs 2
    python benchmarks/robustness.py --out o --policy-spec phasewise:interference_weight=0.2   # a candidate
    python benchmarks/robustness.py --out o --summary-only               # re-summarize the files present

Bad input (an unknown workload, pool or policy, an unwritable --out): one line on stderr, exit 2,
before anything runs.

A cell is exactly ``phasewise bench --workload W --instances POOL --load X --seeds 3 --limit N
--prediction predictor:default --policies ...`` (``tests/test_robustness.py`` checks it number for
number), so any cell can be re-run alone.

Size and time (measured on a 2-core machine shared with a CI run; CPU seconds from
``time.process_time`` in each cell file, ``cpu_s``):

- 42 cells (all 7 workloads x 4xllama3.1-8b-a100, 16xllama3.1-8b-h100, the mixed 4+4 pool x loads
  0.8 and 2), 1 seed, 1,000 requests, both columns (14 runs per seed): 264 CPU-s, i.e. 6.3 CPU-s per
  cell and seed (from 1.5 to 29.5; the costliest: shared-prefix:llmd-capacity, conversations and
  mooncake on 4 A100s at 2x). ``predicted_latency`` takes 56% of it (both columns), late_binding 14%,
  phasewise 11%, join_shortest_queue 10%, the six prediction-blind policies 7% together::

      python benchmarks/robustness.py --out /tmp/rg3 --pools 4xllama3.1-8b-a100 16xllama3.1-8b-h100 \
          4xllama3.1-8b-a100,4xllama3.1-8b-h100 --loads 0.8 2 --seeds 1 -n 1000 --jobs 1 --no-plot

- 1,500 requests cost 1.9x the CPU of 1,000 (12 of the heaviest cells: 389 vs 203 CPU-s; queues grow
  with the sample above capacity).
- 3 seeds, 4 cells (conversations, mooncake x 8xllama3.1-8b-a100 and the mixed pool x 1.5), ``--jobs 2``:
  92 CPU-s, 93 s wall.

So the default ``-n 1000`` (3 seeds, 147 cells) is ~147 x 3 x 6.3 = 2,780 CPU-s = 46 CPU-min, ~23 min
on 2 processes; ``-n 1500`` would be ~44 min, too close to the 60-minute target. The run prints its
own estimate and then progress with an ETA.
"""

from __future__ import annotations

import sys

from routerd.robustness import main

if __name__ == "__main__":
    sys.exit(main())
