"""What a prefix-cache hit can save in time to first token on this deployment.

    python -m blockserve.bench.prefill_saving [--lengths 64 384 768] [--prompts 8]
        [--out docs/results/prefill_saving]

deploy/deploy.yaml as it is, idle: one request at a time, each prompt sent twice, first
cold (nothing of it cached anywhere), then warm (its full blocks cached; the exact index
sends it back to the replica that holds them, and vLLM's `cached_tokens` confirms the
hit). The warm / cold TTFT ratio is the most any prefix routing can gain per request
here, before queueing: issue 17's TTFT targets (<= 0.5x power of two) ask routing to
halve TTFT, which it can only do where prefill is most of TTFT.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
from pathlib import Path

from blockserve.bench import targets
from blockserve.bench.client import replay
from blockserve.bench.workloads import KNOWN, RequestSpec, random_tokens

GAP_S = 1.0  # between requests: each runs alone


def specs(lengths: list[int], prompts: int, seed: int) -> list[tuple[int, str, RequestSpec]]:
    """(prompt length, "cold" or "warm", request), one request every GAP_S."""
    rng, planned = random.Random(seed), []
    for length in lengths:
        for _ in range(prompts):
            prompt = random_tokens(rng, length)
            planned += [(length, kind, prompt) for kind in ("cold", "warm")]
    return [(length, kind, RequestSpec(i * GAP_S, prompt, output_tokens=4))
            for i, (length, kind, prompt) in enumerate(planned)]


def summary(planned: list, records: list) -> dict:
    by_length: dict = {}
    for (length, kind, _), record in zip(planned, records):
        entry = by_length.setdefault(str(length), {"cold": [], "warm": [], "cached": []})
        if record.status == 200 and record.ttft_s is not None:
            entry[kind].append(record.ttft_s)
            if kind == "warm":
                entry["cached"].append((record.cached_tokens or 0) / length)
    result = {}
    for length, entry in by_length.items():
        cold, warm = statistics.median(entry["cold"]), statistics.median(entry["warm"])
        result[length] = {"cold_ttft_p50_s": cold, "warm_ttft_p50_s": warm,
                          "warm_over_cold": warm / cold,
                          "warm_cached_share": statistics.mean(entry["cached"]),
                          "requests": len(entry["cold"]) + len(entry["warm"])}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 384, 768])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="results/prefill_saving")
    args = parser.parse_args()
    planned = specs(args.lengths, args.prompts, args.seed)
    with targets.blockserve("blockserve (deploy.yaml)") as target:
        records, _ = asyncio.run(replay([spec for _, _, spec in planned], target.base_urls,
                                        targets.API_KEY, target.model, lengths=KNOWN))
    result = {"args": vars(args), "by_prompt_tokens": summary(planned, records),
              "records": [r.to_dict() for r in records]}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(f"{args.out}.json").write_text(json.dumps(result, indent=1))
    for length, row in result["by_prompt_tokens"].items():
        print(f"{length:>5} prompt tokens: cold {row['cold_ttft_p50_s'] * 1000:.1f} ms, "
              f"warm {row['warm_ttft_p50_s'] * 1000:.1f} ms "
              f"({row['warm_over_cold']:.2f}x, {row['warm_cached_share']:.0%} cached)")


if __name__ == "__main__":
    main()
