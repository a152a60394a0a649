"""How far can a queue order cut mean TTFT at the contest's load? A bound, then two tries.

    python -m blockserve.bench.ttft_floor --capacity-from docs/results/contest/contest_nohold.json
        [--replicas 16 64] [--workloads ...] [--out docs/results/contest/ttft_floor]

No order makes a request's first token come sooner than its own prefill on an idle
replica. So the same requests, sent at 1% of the rate (`IDLE_LOAD`: none waits for
another), give a floor under the mean TTFT that any order could reach at 1.0x:
`floor / fcfs` is the best ratio that the contest's length-rank target (<= 0.6x) could
show. Beside it, per workload and size, at 1.0x of the capacity that the named contest run
measured (bench/contest.py, the same requests and settings):

- `fcfs`: deploy.yaml's policies with both queues first come, first served (the
  contest's "blockserve FCFS");
- `length rank`: the contest's length-rank configuration (both queues by shortest demand);
- `length rank, central queue`: the same, with `cache_aware(max_queued_prefill_tokens=0)`,
  so that a replica with a prompt still queued takes no more and the requests wait at the
  router, where the order chooses among all of them.

Every figure is *simulated* (the contest's preset, a100-llama3-8b by default).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

from blockserve.bench.contest import CONFIGS, FCFS, LENGTH_RANK, OURS, run_one, run_settings
from blockserve.bench.provenance import announce

IDLE_LOAD = 0.01
CENTRAL_QUEUE = (CONFIGS[LENGTH_RANK]
                 + ", router.placement=cache_aware(max_queued_prefill_tokens=0)")
# run name -> (bench/variants.py entry, load as a multiple of the capacity)
RUNS = {"fcfs": (CONFIGS[FCFS], 1.0), "idle floor": (CONFIGS[OURS], IDLE_LOAD),
        "length rank": (CONFIGS[LENGTH_RANK], 1.0),
        "length rank, central queue": (CENTRAL_QUEUE, 1.0)}
KEPT = ("ttft_mean_s", "ttft_p90_s", "ttft_p99_s", "goodput_rps", "output_tokens_per_s",
        "admission_wait_mean_s", "preemptions", "shed")


def measure(workload: str, replicas: int, n: int, per_replica_rps: float, settings) -> dict:
    figures = {}
    for name, (entry, load) in RUNS.items():
        summary = run_one(workload, replicas, n, load * per_replica_rps * replicas, name,
                          settings, entry)["summary"]
        figures[name] = {key: summary[key] for key in KEPT}
    fcfs = figures["fcfs"]["ttft_mean_s"]
    ratios = {f"{name} / fcfs": figures[name]["ttft_mean_s"] / fcfs
              for name in RUNS if name != "fcfs"}
    ratios["length rank, central queue p99 / fcfs p99"] = (
        figures["length rank, central queue"]["ttft_p99_s"] / figures["fcfs"]["ttft_p99_s"])
    return {"runs": figures, "mean_ttft_ratios": ratios}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--capacity-from", required=True,
                        help="a contest JSON: its measured capacities, requests per replica "
                             "and preset are used")
    parser.add_argument("--replicas", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--workloads", nargs="+", default=None,
                        help="default: every workload of that contest run")
    parser.add_argument("--out", default="docs/results/contest/ttft_floor")
    args = parser.parse_args()
    contest = json.loads(Path(args.capacity_from).read_text())
    if contest["args"].get("duration_s") is not None:  # its idle floor would be other requests
        parser.error("--capacity-from needs a contest sized by --requests-per-replica")
    per_replica = contest["args"]["requests_per_replica"]
    settings = run_settings(contest["preset"], contest["args"]["seed"])
    provenance = announce("ttft_floor")
    started = time.time()
    results: dict = {}
    for workload in args.workloads or list(contest["capacity"]):
        rate = contest["capacity"][workload]["per_replica_rps"]
        for replicas in args.replicas:
            cell = measure(workload, replicas, per_replica * replicas, rate, settings)
            results.setdefault(workload, {})[str(replicas)] = cell
            print(f"{workload} x{replicas}: " + ", ".join(
                f"{k} {v:.2f}" for k, v in cell["mean_ttft_ratios"].items()), file=sys.stderr)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(f"{args.out}.json").write_text(json.dumps({
        "command": "python -m blockserve.bench.ttft_floor " + shlex.join(sys.argv[1:]),
        **provenance, "simulated": True, "preset": contest["preset"],
        "capacity_from": args.capacity_from, "requests_per_replica": per_replica,
        "idle_load": IDLE_LOAD, "configs": {name: entry for name, (entry, _) in RUNS.items()},
        "results": results, "wall_s": time.time() - started}, indent=1))
    print(f"wrote {args.out}.json ({time.time() - started:.0f} s)")


if __name__ == "__main__":
    main()
