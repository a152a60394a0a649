"""Replay a workload against a deployment that is already running (`make serve`), and
print the client's summary (tok/s, goodput, TTFT/ITL/e2e percentiles) as JSON.

    python -m blockserve.bench.replay [--url http://127.0.0.1:8000] [--workload azure_code]
        [--requests 300] [--seed 0] [--length-mode unknown] [--out FILE.json]

From a terminal other than the deployment's, run it through `make client` (or
`python -m blockserve.bench.second_terminal -- ...`): bench/second_terminal.py says why.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os

from blockserve.bench.client import replay
from blockserve.bench.harness import deployment_lengths, workload
from blockserve.bench.report import SLO_ITL_S, SLO_TTFT_S, summarise
from blockserve.bench.workloads import WORKLOADS, LengthMode
from blockserve.tools.launch import app_config


def run(url: str, api_key: str, name: str, requests: int, seed: int,
        mode: LengthMode) -> dict:
    """One replay's summary; its records are left out (the harness keeps those)."""
    specs, scaling = workload(name, requests, seed)
    records, makespan = asyncio.run(replay(specs, [url], api_key,
                                           app_config().replica.model_name,
                                           lengths=deployment_lengths(mode)))
    return {"workload": name, "seed": seed, "length_mode": mode.value, "scaling": scaling,
            "summary": summarise(records, makespan, float("nan"), SLO_TTFT_S, SLO_ITL_S)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=os.environ.get("BLOCKSERVE_URL",
                                                        "http://127.0.0.1:8000"))
    parser.add_argument("--api-key", default=os.environ.get("BLOCKSERVE_API_KEY", "none"))
    parser.add_argument("--workload", default="azure_code",
                        choices=sorted(WORKLOADS))
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--length-mode", default="unknown", choices=[m.value for m in LengthMode])
    parser.add_argument("--out", help="also write the summary to this JSON file")
    args = parser.parse_args(argv)
    result = run(args.url, args.api_key, args.workload, args.requests, args.seed,
                 LengthMode(args.length_mode))
    text = json.dumps(result, indent=1)
    if args.out:
        with open(args.out, "w") as out:
            out.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
