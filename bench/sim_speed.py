"""How fast the simulator runs as the cluster grows: wall seconds per simulated request at
each replica count, the trace's arrival rate scaled with the replicas so that every
replica sees the same load (issue 25, section 4).

    flock /tmp/blockserve-heavy.lock python -m blockserve.bench.sim_speed \
        --trace ../shared/data/traces/azure_llm_2023_code.csv --replicas 8 64 256 \
        --requests 2000 --rate-scale-per-replica 0.5 --out docs/results/sim_speed

One process, one run at a time (the wall time is this machine's, measured alone).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from types import SimpleNamespace

from blockserve.bench.provenance import announce
from blockserve.bench.simulator import SIM_CONFIGS, preset_shape, simulate_variant
from blockserve.bench.step_time import PRESETS
from blockserve.bench.trace_files import Scaling, read_trace
from blockserve.bench.variants import variants

SHOWN = ("wall_s", "steps", "ok", "shed", "preemptions", "ttft_p50_s",
         "ttft_p99_s", "token_itl_p50_s", "output_tokens_per_s", "max_rss_mb")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", required=True)
    parser.add_argument("--replicas", type=int, nargs="+", default=[8, 64, 256])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--rate-scale-per-replica", type=float, default=0.5,
                        help="the trace's rate times this times the replica count")
    parser.add_argument("--configs", nargs="+", default=["blockserve"])
    parser.add_argument("--preset", default="a100-llama3-8b", choices=list(PRESETS))
    parser.add_argument("--out", default="docs/results/sim_speed")
    args = parser.parse_args()
    provenance = announce("sim_speed")
    shape = preset_shape(args.preset)
    settings = SimpleNamespace(preset=args.preset, length_mode="unknown", slo_ttft=2.0,
                               slo_itl=0.1)
    results = {}
    for replicas in args.replicas:
        replay = read_trace(args.trace, Scaling(rate_scale=args.rate_scale_per_replica * replicas,
                                                max_requests=args.requests),
                            shape.max_model_len, shape.block_size)
        for variant in variants(args.configs, SIM_CONFIGS):
            run = simulate_variant(variant, replicas, replay.specs, settings, shape)
            figures = {"wall_s_per_request": run["summary"]["wall_s"] / len(replay.specs),
                       **{key: run["summary"][key] for key in SHOWN}}
            results[f"{variant.label} x{replicas}"] = {"workload": replay.scaling, **figures}
            print(f"{variant.label} x{replicas}: "
                  + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                              for k, v in figures.items()), flush=True)
            # after every run: what is measured survives a run cut short
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(f"{args.out}.json").write_text(json.dumps({
                "command": "python -m blockserve.bench.sim_speed " + shlex.join(sys.argv[1:]),
                **provenance, "preset": args.preset, "results": results}, indent=1))
    print(f"wrote {args.out}.json")


if __name__ == "__main__":
    main()
