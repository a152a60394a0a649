"""Which of a contest run's targets any router could meet at all: a floor under TTFT and
a ceiling over goodput and throughput in each cell, from the cell's own requests (issue 26).

    flock /tmp/blockserve-heavy.lock python -m blockserve.bench.contest_bounds \
        docs/results/contest/steady_window64.json --out docs/results/contest/steady_window64_bounds

No router or scheduler gives a request its first token sooner than its own prefill on an
idle replica, nor ends it sooner than that plus one decode step alone per further token:
a step that carries other work too costs at least as much (every term of the step-time
model is non-negative). So each cell's requests, exactly as the contest made them, are
sent one at a time (`IDLE_GAP_S` apart, one output token each) under power of two
(vLLM's own steps) and under blockserve (the prefix-aware placement, which finds the
replica that caches a prompt's prefix); a request's floor is the smaller of its two first
tokens, and its decode floor is summed from the step-time model. Then, per cell:

- **TTFT floor**: the p90 (and mean) of the floors. A router that answers every request
  has a TTFT p90 at least this (each request's TTFT is at least its floor). If it is above
  0.8x the best peer's TTFT p90, the TTFT p90 target is out of reach there.
- **Goodput ceiling**: a request can count only if its floors keep within both SLOs, and a
  run lasts at least from the first arrival to the last arrival and to the end of its
  latest request. For a router that answers every request that is the latest floor end of
  all; if the ceiling is below 1.15x the best peer's goodput, that target is out of reach.
  A router that sheds the requests that would end last could shorten the run: the best
  ratio over every choice of which requests to answer is `goodput_ceiling_shedding_rps`,
  reported beside it.
- **Throughput ceiling**: every output token of the run over the shortest run possible
  for a router that answers every request (from the first arrival to the latest floor end,
  or the last arrival if later). A run's requests and arrivals are fixed, so its makespan
  alone sets its throughput: the cell names the request whose floor ends last.
- **Length rank** (where the run has FCFS): the floor's mean TTFT over FCFS's, the best
  the length-rank target (<= 0.6x) could show.

One assumption: a request's prefix hit on an idle replica is at least what it could get
under load. An idle replica keeps what it cached until its pool fills, a prompt's prefix
is cached there before the next request arrives, and the prefix-aware placement sends it
where its prefix is; under load a prefix may still be in prefill, or evicted sooner. Every
figure is *simulated*, on the contest run's preset.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

from blockserve.bench import contest_workloads
from blockserve.bench.contest import (CONFIGS, FCFS, LENGTH_RANK_TARGET, OURS, POWER_OF_TWO,
                                      cell_rate, run_requests, run_settings)
from blockserve.bench.provenance import announce
from blockserve.bench.report import percentile
from blockserve.bench.simulator import SIM_CONFIGS, preset_shape, simulate_variant
from blockserve.bench.step_time import PRESETS, StepBatch
from blockserve.bench.variants import parse_entry

# Seconds between two requests of the idle run: longer than any one request's prefill
# (checked), so that none waits for another.
IDLE_GAP_S = 60.0
FLOOR_CONFIGS = (POWER_OF_TWO, OURS)


def first_token_floors(workload: str, replicas: int, n: int, rate: float, settings) -> dict:
    """Each request's first token on an idle replica under each of FLOOR_CONFIGS, and
    the requests' arrivals, prompts and outputs as the contest sent them."""
    shape = preset_shape(settings.preset)
    specs = contest_workloads.requests(workload, n, rate, settings.seed, shape)
    idle = [replace(spec, arrival_s=i * IDLE_GAP_S, output_tokens=1)
            for i, spec in enumerate(specs)]
    ttfts = {}
    for label in FLOOR_CONFIGS:
        variant = parse_entry(CONFIGS[label], SIM_CONFIGS)
        variant.label = f"{label}, idle"
        records = simulate_variant(variant, replicas, idle, settings, shape)["records"]
        ttfts[label] = [r["ttft_s"] if r["status"] == 200 else None for r in records]
        longest = max((t for t in ttfts[label] if t is not None), default=0.0)
        if longest >= IDLE_GAP_S:
            raise RuntimeError(f"a prefill took {longest:.1f} s: raise IDLE_GAP_S")
    return {"arrivals": [s.arrival_s for s in specs],
            "prompt_tokens": [s.prompt_tokens for s in specs],
            "output_tokens": [s.output_tokens for s in specs], "ttft_s": ttfts}


def decode_floor_s(model, prompt_tokens: int, output_tokens: int) -> float:
    """The tokens after the first, each in a step of its own decode alone."""
    return sum(model(StepBatch(decode_contexts=(prompt_tokens + j,)))
               for j in range(1, output_tokens))


def bounds(floors: dict, model, slo_ttft_s: float, slo_tpot_s: float) -> dict:
    """A cell's TTFT floor and goodput ceilings (module docstring)."""
    per_config = floors["ttft_s"].values()
    ttft = [None if None in both else min(both) for both in zip(*per_config)]
    arrivals = floors["arrivals"]
    ends, countable_ends = {}, []  # each answered request's earliest end; those that count
    for index, (arrival, first, prompt, output) in enumerate(zip(
            arrivals, ttft, floors["prompt_tokens"], floors["output_tokens"])):
        if first is None:
            continue
        decode = decode_floor_s(model, prompt, output)
        ends[index] = arrival + first + decode
        if first <= slo_ttft_s and (output < 2 or decode / (output - 1) <= slo_tpot_s):
            countable_ends.append(ends[index])
    start, last_arrival = min(arrivals), max(arrivals)
    if not ends:
        raise ValueError("no request was answered on an idle replica")
    last = max(ends, key=ends.get)  # the answered request that ends last at best
    makespan = max(ends[last], last_arrival) - start
    shedding = max((k / (max(end, last_arrival) - start)
                    for k, end in enumerate(sorted(countable_ends), 1)), default=0.0)
    answered = [t for t in ttft if t is not None]
    return {"ttft_p90_floor_s": percentile(answered, 0.9),
            "ttft_mean_floor_s": sum(answered) / len(answered),
            "goodput_ceiling_rps": len(countable_ends) / makespan,
            "goodput_ceiling_shedding_rps": shedding, "makespan_floor_s": makespan,
            "throughput_ceiling_tok_s": sum(floors["output_tokens"][i] for i in ends) / makespan,
            "last_floor_end": {"index": last, "arrival_s": arrivals[last],
                               "prompt_tokens": floors["prompt_tokens"][last],
                               "output_tokens": floors["output_tokens"][last],
                               "first_token_s": ttft[last], "end_s": ends[last]},
            "requests": len(arrivals),
            "countable_requests": len(countable_ends),
            "ttft_p90_floor_by_config_s": {label: percentile(values, 0.9)
                                           for label, values in floors["ttft_s"].items()}}


def verdicts(cell_bounds: dict, targets: list[dict], cell: dict) -> list[dict]:
    """The cell's targets that a bound decides, each with the best ratio a router that
    answers every request could show (`reachable`: the bound does not rule it out)."""
    out = []
    for target in targets:
        measure, theirs = target["measure"], target["theirs_value"]
        shedding = None  # goodput's best by shedding the requests that would end last
        if measure == "TTFT p90":
            best = cell_bounds["ttft_p90_floor_s"] / theirs
        elif measure == "goodput":
            best = cell_bounds["goodput_ceiling_rps"] / theirs
            shedding = cell_bounds["goodput_ceiling_shedding_rps"] / theirs
        elif measure == "throughput":
            best = cell_bounds["throughput_ceiling_tok_s"] / theirs
        elif measure == LENGTH_RANK_TARGET:
            best = cell_bounds["ttft_mean_floor_s"] / cell[FCFS]["summary"]["ttft_mean_s"]
        else:
            continue
        sense, limit = target["bound"].split()  # as bench/contest.py states it: "<= 0.8"
        reachable = best <= float(limit) if sense == "<=" else best >= float(limit)
        out.append({"measure": measure, "against": target["against"], "ours": target["ratio"],
                    "best_possible": best, "best_possible_shedding": shedding,
                    "bound": target["bound"], "met": target["met"], "reachable": reachable})
    return out


def markdown(results: dict) -> list[str]:
    lines = ["| workload | load | measure | against | ours | best a router answering every "
             "request could show | by shedding | target | |",
             "|---|---:|---|---|---:|---:|---:|---|---|"]
    for key, cell in results.items():
        workload, replicas, load = key.split("/")
        for v in cell["verdicts"]:
            state = ("met" if v["met"] else "missed, not ruled out" if v["reachable"]
                     else "**out of reach**")
            shedding = v["best_possible_shedding"]
            lines.append(f"| {workload} x{replicas} | {float(load):g}x | {v['measure']} | "
                         f"{v['against']} | {v['ours']:.2f}x | {v['best_possible']:.2f}x | "
                         f"{'' if shedding is None else f'{shedding:.2f}x'} | {v['bound']} | "
                         f"{state} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("contest", help="a finished contest run's JSON")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    contest = json.loads(Path(args.contest).read_text())
    run = contest["args"]
    settings = run_settings(contest["preset"], run["seed"], run["requests_per_replica"],
                            run["duration_s"])
    model = PRESETS[contest["preset"]]
    provenance = announce("contest_bounds")
    started = time.time()
    cells = [(w, size, load) for w, by_size in contest["results"].items()
             for size, by_load in by_size.items() for load in by_load]
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        futures = {}
        for w, size, load in cells:
            rate = cell_rate(contest["capacity"][w], int(size), float(load))
            futures[(w, size, load)] = pool.submit(
                first_token_floors, w, int(size), run_requests(settings, int(size), rate),
                rate, settings)
        results = {}
        for (w, size, load), future in futures.items():
            cell_bounds = bounds(future.result(), model, contest["slo"]["ttft_s"],
                                 contest["slo"]["tpot_s"])
            targets = [t for t in contest["targets"] if t["workload"] == w
                       and t["replicas"] == int(size) and t["load"] == float(load)]
            cell_bounds["verdicts"] = verdicts(cell_bounds, targets,
                                               contest["results"][w][size][load])
            results[f"{w}/{size}/{load}"] = cell_bounds
            print(f"[{time.time() - started:.0f} s] {w} x{size} {load}x: TTFT p90 floor "
                  f"{cell_bounds['ttft_p90_floor_s']:.3f} s, goodput ceiling "
                  f"{cell_bounds['goodput_ceiling_rps']:.1f} req/s, throughput ceiling "
                  f"{cell_bounds['throughput_ceiling_tok_s']:.0f} tok/s", file=sys.stderr)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(f"{args.out}.json").write_text(json.dumps({
        "command": "python -m blockserve.bench.contest_bounds " + shlex.join(sys.argv[1:]),
        **provenance, "simulated": True, "preset": contest["preset"], "contest": args.contest,
        "idle_gap_s": IDLE_GAP_S, "floor_configs": {label: CONFIGS[label]
                                                    for label in FLOOR_CONFIGS},
        "results": results, "wall_s": time.time() - started}, indent=1))
    Path(f"{args.out}.md").write_text("\n".join(markdown(results)) + "\n")
    print(f"wrote {args.out}.json, .md ({time.time() - started:.0f} s)")


if __name__ == "__main__":
    main()
