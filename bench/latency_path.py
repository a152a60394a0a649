"""Where one streamed request's time to first token goes, point by point along the path.

    flock /tmp/blockserve-heavy.lock python -m blockserve.bench.latency_path \
        --out docs/results/latency_path

One small streamed completion at a time (a 32-token prompt, `--tokens` tokens out), to
deploy.yaml (or each of `--configs`, deploy.yaml with the harness's overrides:
`"blockserve + router.queue_order=fcfs"`) with `BLOCKSERVE_PATH_TRACE` on
(protocol/path_trace.py: the router and the replicas write the time they pass each
point) and to raw vLLM servers (`vllm serve`, the same engine arguments, client round
robin), in A B B A order (A: every configuration). For blockserve every request's points
are lined up with its client's send and first event; the JSON has, per configuration,
the median time from the send to each point and the median of each segment between
consecutive points. A raw server has no points inside: its figures are the client's alone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from blockserve.bench import targets
from blockserve.bench.harness import VLLM_ENGINE_DEFAULTS, overridden
from blockserve.bench.provenance import announce
from blockserve.protocol.path_trace import POINTS

SENT, FIRST = POINTS[0], POINTS[-1]
WARM_UP = 5  # requests sent first and left out of the figures
GAP_S = 0.25  # between one request's end and the next one's send


async def one_at_a_time(urls: list[str], model: str, requests: int, tokens: int
                        ) -> list[dict[str, float]]:
    """Each request's client points (unix times): sent, first event, and `end`."""
    rng = random.Random(0)
    rows = []
    async with httpx.AsyncClient(timeout=60, headers={
            "Authorization": f"Bearer {targets.API_KEY}"}) as http:
        for index in range(WARM_UP + requests):
            body = {"model": model, "prompt": [rng.randrange(10, 4000) for _ in range(32)],
                    "max_tokens": tokens, "ignore_eos": True, "stream": True}
            row = {SENT: time.time()}
            url = urls[index % len(urls)]
            async with http.stream("POST", f"{url}/v1/completions", json=body) as response:
                if response.status_code != 200:
                    raise RuntimeError(f"{response.status_code}: {await response.aread()}")
                async for line in response.aiter_lines():
                    if line.startswith("data:") and FIRST not in row:
                        row[FIRST] = time.time()
            row["end"] = time.time()
            if index >= WARM_UP:
                rows.append(row)
            await asyncio.sleep(GAP_S)
    return rows


def read_marks(directory: Path) -> list[tuple[float, str]]:
    """Every process's points in `directory`, in time order."""
    marks = []
    for log in directory.glob("*.log"):
        for line in log.read_text().splitlines():
            stamp, point = line.split(" ", 1)
            marks.append((float(stamp), point))
    return sorted(marks)


def line_up(rows: list[dict[str, float]], marks: list[tuple[float, str]]
            ) -> list[dict[str, float]]:
    """Each request's client points with the path's points passed between its send and its
    end (one request at a time, so nothing else passes them then)."""
    lined = []
    for row in rows:
        passed = {point: stamp for stamp, point in marks if row[SENT] <= stamp <= row["end"]}
        lined.append({**passed, **row})
    return lined


def split(lined: list[dict[str, float]]) -> dict:
    """Median ms from the send to each point, and of each segment between consecutive
    points that every request passed (per request, then the median)."""
    points = [p for p in POINTS if all(p in row for row in lined)]
    since_sent = {p: statistics.median((row[p] - row[SENT]) * 1e3 for row in lined)
                  for p in points + ["end"]}
    segments = {f"{a} -> {b}": statistics.median((row[b] - row[a]) * 1e3 for row in lined)
                for a, b in zip(points, points[1:])}
    return {"requests": len(lined), "ms_since_sent": since_sent, "segments_ms": segments}


def measure(name: str, requests: int, tokens: int) -> dict:
    if name == "raw vLLM x2":
        with targets.raw_vllm(name, engine_args=VLLM_ENGINE_DEFAULTS) as target:
            rows = asyncio.run(one_at_a_time(target.base_urls, target.model, requests, tokens))
        return split(rows)
    directory = Path(tempfile.mkdtemp(prefix="bs-path-"))
    with targets.blockserve(name, *overridden(name),
                            env={"BLOCKSERVE_PATH_TRACE": str(directory)}) as target:
        rows = asyncio.run(one_at_a_time(target.base_urls, target.model, requests, tokens))
    return split(line_up(rows, read_marks(directory)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--configs", nargs="+", default=["blockserve"], metavar="CONFIG",
                        help="blockserve, or blockserve + overrides (bench/harness.py)")
    parser.add_argument("--out", default="docs/results/latency_path")
    args = parser.parse_args()
    try:
        for entry in args.configs:
            overridden(entry)
    except ValueError as exc:
        parser.error(str(exc))
    provenance = announce("latency_path")
    order = [*args.configs, "raw vLLM x2", "raw vLLM x2", *args.configs[::-1]]
    runs: dict[str, list[dict]] = {name: [] for name in order}
    for name in order:
        runs[name].append(measure(name, args.requests, args.tokens))
        print(f"{name}: {json.dumps(runs[name][-1]['ms_since_sent'])}", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(f"{args.out}.json").write_text(json.dumps({
        "command": "python -m blockserve.bench.latency_path " + shlex.join(sys.argv[1:]),
        **provenance, "time": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "requests": args.requests, "tokens": args.tokens, "runs": runs}, indent=1))
    print(f"wrote {args.out}.json")


if __name__ == "__main__":
    main()
