"""How fast the simulator runs as the cluster grows: wall seconds per simulated request at
each replica count, the trace's arrival rate scaled with the replicas so that every
replica sees the same load (issue 25, section 4).

    flock /tmp/blockserve-heavy.lock python -m blockserve.bench.sim_speed \
        --trace ../shared/data/traces/azure_llm_2023_code.csv --replicas 8 64 256 \
        --requests 2000 --rate-scale-per-replica 0.5 --out docs/results/sim_speed

One process, one run at a time (the wall time is this machine's, measured alone). Each
run also reports the wall seconds spent inside vLLM's own `Scheduler.schedule` and
`update_from_output` (`vllm_scheduler_s`): the floor of a simulated step, which no change
to blockserve's code can remove, since every replica runs vLLM's real scheduler.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from contextlib import contextmanager
from pathlib import Path
from time import perf_counter
from types import SimpleNamespace

from blockserve.bench.provenance import announce
from blockserve.bench.simulator import SIM_CONFIGS, preset_shape, simulate_variant
from blockserve.bench.step_time import PRESETS
from blockserve.bench.trace_files import Scaling, read_trace
from blockserve.bench.variants import variants

SHOWN = ("wall_s", "steps", "ok", "shed", "preemptions", "ttft_p50_s",
         "ttft_p99_s", "token_itl_p50_s", "output_tokens_per_s", "max_rss_mb")


@contextmanager
def vllm_scheduler_time():
    """Times vLLM's `Scheduler.schedule` and `update_from_output` while open (the
    block-aware subclass reaches them through `super()`); yields a one-item list of
    seconds. vLLM's schedule calls the KV cache manager, whose thin blockserve wrapper
    (replica/block_adapter.py) is counted with it."""
    from vllm.v1.core.sched.scheduler import Scheduler

    seconds = [0.0]
    originals = {name: getattr(Scheduler, name) for name in ("schedule", "update_from_output")}

    def timed(method):
        def wrapper(*args, **kwargs):
            started = perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                seconds[0] += perf_counter() - started
        return wrapper

    for name, method in originals.items():
        setattr(Scheduler, name, timed(method))
    try:
        yield seconds
    finally:
        for name, method in originals.items():
            setattr(Scheduler, name, method)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", required=True)
    parser.add_argument("--replicas", type=int, nargs="+", default=[8, 64, 256])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--rate-scale-per-replica", type=float, default=0.5,
                        help="the trace's rate times this times the replica count (a "
                             "trace without timestamps: this many requests per second per "
                             "replica, Poisson)")
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
        rate = args.rate_scale_per_replica * replicas  # Scaling: rate_scale or, untimed, rate
        replay = read_trace(args.trace, Scaling(rate_scale=rate, rate=rate,
                                                max_requests=args.requests),
                            shape.max_model_len, shape.block_size)
        for variant in variants(args.configs, SIM_CONFIGS):
            with vllm_scheduler_time() as vllm_s:
                run = simulate_variant(variant, replicas, replay.specs, settings, shape)
            wall_s = run["summary"]["wall_s"]
            figures = {"wall_s_per_request": wall_s / len(replay.specs),
                       "vllm_scheduler_s": vllm_s[0], "vllm_scheduler_share": vllm_s[0] / wall_s,
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
