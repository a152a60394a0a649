"""Cross-check our load client against one nobody here wrote: NVIDIA's aiperf.

    python -m blockserve.bench.crosscheck [--config blockserve] [--requests 64] [--rate 8]

Deploys one configuration of the policy benchmark, then measures the same steady
workload (fixed prompt and output lengths, constant arrival rate) with aiperf and with
bench/client.py, one after the other, and prints both and their ratio. aiperf lives in
its own virtual environment (`.venv-aiperf`, created on first use: ~1.2 GB, minutes),
because its pinned dependencies do not fit beside vLLM's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from blockserve.bench import targets
from blockserve.bench.client import replay
from blockserve.bench.harness import CONFIGURATIONS, SLO_ITL_S, SLO_TTFT_S, summarise
from blockserve.bench.workloads import steady
from blockserve.tools.launch import REPO, app_config

AIPERF = "aiperf==0.13.0"
AIPERF_VENV = REPO / ".venv-aiperf"


def aiperf_binary() -> Path:
    binary = AIPERF_VENV / "bin" / "aiperf"
    if not binary.exists():
        print(f"installing {AIPERF} into {AIPERF_VENV} (once) ...", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(AIPERF_VENV)], check=True)
        subprocess.run([str(AIPERF_VENV / "bin" / "pip"), "install", "-q", AIPERF], check=True)
    return binary


def run_aiperf(target: targets.Target, args, model_dir: str) -> dict:
    """aiperf's own summary (milliseconds, tokens/s) of one steady run."""
    artifacts = Path(tempfile.mkdtemp(prefix="bs-aiperf-"))
    command = [
        str(aiperf_binary()), "profile", "--model", target.model, "--tokenizer", model_dir,
        "--url", target.base_urls[0], "--endpoint-type", "completions", "--streaming",
        "--request-rate", str(args.rate), "--arrival-pattern", "constant",
        "--request-count", str(args.requests), "--random-seed", "0",
        "--synthetic-input-tokens-mean", str(args.prompt_tokens),
        "--synthetic-input-tokens-stddev", "0",
        "--output-tokens-mean", str(args.output_tokens), "--output-tokens-stddev", "0",
        "--extra-inputs", "ignore_eos:true", "--extra-inputs", f"min_tokens:{args.output_tokens}",
        "--api-key", targets.API_KEY, "--artifact-dir", str(artifacts), "--ui-type", "none"]
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}  # local tokenizer
    subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL)
    export = next(artifacts.rglob("profile_export_aiperf.json"))
    return json.loads(export.read_text())


def run_ours(target: targets.Target, args) -> dict:
    specs = steady(n=args.requests, rate=args.rate, prompt_tokens=args.prompt_tokens,
                   output_tokens=args.output_tokens, seed=1)
    before = target.preemptions()
    records, makespan = asyncio.run(replay(specs, target.base_urls, targets.API_KEY,
                                           target.model))
    return summarise(records, makespan, target.preemptions() - before, SLO_TTFT_S, SLO_ITL_S)


def aiperf_metric(summary: dict, name: str, stat: str) -> float:
    """aiperf's export holds each metric as {"unit": ..., "avg"/"p50"/...}; ms -> s."""
    metric = summary[name]
    return metric[stat] / (1000 if metric["unit"] == "ms" else 1)


ROWS = [("TTFT p50 s", "ttft_p50_s", "time_to_first_token", "p50"),
        ("TTFT p99 s", "ttft_p99_s", "time_to_first_token", "p99"),
        ("ITL p50 s", "itl_p50_s", "inter_token_latency", "p50"),
        ("e2e p50 s", "e2e_p50_s", "request_latency", "p50"),
        ("output tok/s", "output_tokens_per_s", "output_token_throughput", "avg")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="blockserve", choices=list(CONFIGURATIONS))
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--rate", type=float, default=8.0)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--output-tokens", type=int, default=96)
    parser.add_argument("--out", default="results/crosscheck")
    args = parser.parse_args()
    model_dir = app_config().replica.model
    aiperf_binary()
    with CONFIGURATIONS[args.config](args.config) as target:
        run_ours(target, argparse.Namespace(**{**vars(args), "requests": 8}))  # warm-up
        theirs = run_aiperf(target, args, model_dir)
        ours = run_ours(target, args)
    lines = [f"{args.config}: {args.requests} requests at {args.rate}/s, "
             f"{args.prompt_tokens} prompt + {args.output_tokens} output tokens, streamed",
             f"{'metric':<14}{'bench.client':>14}{'aiperf':>10}{'ours/aiperf':>13}"]
    for label, key, name, stat in ROWS:
        mine, other = ours[key], aiperf_metric(theirs, name, stat)
        lines.append(f"{label:<14}{mine:>14.3f}{other:>10.3f}{mine / other:>12.2f}x")
    report = "\n".join(lines)
    print(report)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(f"{args.out}.json").write_text(json.dumps(
        {"args": vars(args), "ours": ours, "aiperf": theirs, "report": report}, indent=1))


if __name__ == "__main__":
    main()
