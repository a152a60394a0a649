"""Soak: a real trace replayed against the real deployment for an hour at its capacity,
output lengths unknown, with a sprinkle of fuzzed and cancelled requests. Nothing may
grow: every minute it records the router's and the engines' memory, the router's open
connections, the ledger's blocks against the replicas' snapshots, the queue, the 429s
and the TTFT p99, and it passes when each is flat after the warm-up.

    python -m blockserve.bench.soak [--minutes 60] [--warmup-minutes 10] [--sample-s 60]
        [--out docs/results/soak]

Load: azure_code windows (bench/traces.py, seeds 0..7 in turn) back to back at 1.0x the
deployment's measured capacity, each request told only the loose cap the context leaves
(the harness's unknown length mode). Capacity is measured first, not taken from the
trace scaling's KV rule (which brings a window in about 7 s that takes this deployment
about 45 s to serve, so a backlog would grow all hour): one window is replayed alone and
the time it takes to serve becomes the period over which every later window's arrivals
are spread, gaps keeping their shape.
Sprinkle: every `SPRINKLE_S` one request drawn by schemathesis from the served
/openapi.json (bench/fuzz.py) and one stream the client closes (after its first event,
or before it). Every sprinkled request is accounted for, and none may get a 5xx.

Trend test, per series over the samples after the warm-up: the Theil-Sen slope times
the span is the drift; the series is flat when |drift| <= max(FLOOR, 2 x noise), noise
being 1.4826 x the median absolute residual about that line (a robust sigma). At the end,
with the load stopped, the ledger holds no reservation and no replica holds a block.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import itertools
import json
import random
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil

from blockserve.bench import fuzz
from blockserve.bench.client import replay
from blockserve.bench.harness import deployment_lengths, workload
from blockserve.bench.report import percentile
from blockserve.bench.targets import API_KEY
from blockserve.bench.workloads import LengthMode
from blockserve.tools.launch import app_config, load_config, replica_count, serve_run

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
TRACE, WINDOW_REQUESTS, WINDOW_SEEDS = "azure_code", 300, range(8)
SPRINKLE_S = 2.0
FUZZ_CASES = 60  # per route and mode, drawn once and cycled
FUZZ_MAX_TOKENS = 64  # a sprinkle, not load of its own (bench/fuzz.py affordable)
# Per series: (unit, the drift no soak could tell from noise on this machine).
SERIES = {
    "router_rss_mb": ("MB", 20.0),
    "engine_rss_mb": ("MB", 50.0),
    "router_connections": ("connections", 8.0),
    "ledger_reserved_blocks": ("blocks", 10.0),
    "snapshot_committed_blocks": ("blocks", 10.0),
    "ledger_drift_blocks": ("blocks", 4.0),
    "queued_requests": ("requests", 5.0),
    "rejected_429": ("per minute", 5.0),
    "ttft_p99_s": ("s", 0.25),
}


# --- what is measured ------------------------------------------------------------------
def _processes(serve_pid: int) -> dict[str, list[psutil.Process]]:
    """The router, and the engines' processes (EngineCore and its workers), that
    `serve run` (process `serve_pid`) started."""
    found: dict[str, list[psutil.Process]] = {"router": [], "engine": []}
    for proc in psutil.Process(serve_pid).children(recursive=True):
        try:
            command = " ".join(proc.cmdline())
        except psutil.Error:
            continue
        if "ServeReplica:blockserve:Router" in command:
            found["router"].append(proc)
        elif command.startswith("VLLM::"):
            found["engine"].append(proc)
    return found


def _rss_mb(processes: list[psutil.Process]) -> float:
    total = 0
    for proc in processes:
        try:
            total += proc.memory_info().rss
        except psutil.Error:
            pass
    return total / 2**20


def _connections(processes: list[psutil.Process]) -> int:
    count = 0
    for proc in processes:
        try:
            count += sum(c.status == psutil.CONN_ESTABLISHED
                         for c in proc.net_connections(kind="tcp"))
        except psutil.Error:
            pass
    return count


def state(base_url: str) -> dict:
    """The router's ledger against the replicas' own snapshots, and its queue."""
    admin = httpx.get(f"{base_url}/admin/state", headers=HEADERS, timeout=30).json()
    replicas = admin["replicas"]
    return {"queued_requests": admin["queue"]["requests"],
            "ledger_reserved_blocks": sum(r["blocks"]["reserved"] for r in replicas),
            "ledger_drift_blocks": sum(abs(r["drift_blocks"] or 0) for r in replicas),
            "snapshot_committed_blocks": sum(r["blocks"]["committed"] for r in replicas),
            "snapshot_held_blocks": sum(r["snapshot"]["held_blocks"] for r in replicas),
            "in_flight": sum(r["in_flight_requests"] for r in replicas),
            "replica_running": sum(r["snapshot"]["running"] for r in replicas),
            "engine_pids": sorted(r["engine"].get("engine_pid") or 0 for r in replicas)}


class Sampler(threading.Thread):
    """Every `interval_s`, the server-side series; the client's join them per minute."""

    def __init__(self, base_url: str, serve_pid: int, interval_s: float) -> None:
        super().__init__(daemon=True)
        self.base_url, self.serve_pid, self.interval_s = base_url, serve_pid, interval_s
        self.rows: list[dict] = []
        self.stopped = threading.Event()

    def run(self) -> None:
        started = time.monotonic()
        while not self.stopped.wait(self.interval_s):
            processes = _processes(self.serve_pid)
            row = {"t_s": round(time.monotonic() - started, 1),
                   "router_rss_mb": _rss_mb(processes["router"]),
                   "engine_rss_mb": _rss_mb(processes["engine"]),
                   "router_connections": _connections(processes["router"])}
            try:
                row.update(state(self.base_url))
            except (httpx.HTTPError, ValueError, KeyError) as exc:
                row["state_error"] = repr(exc)
            self.rows.append(row)


# --- the load ----------------------------------------------------------------------------
async def measured_period(base_url: str, model: str, window: list) -> float:
    """Seconds the deployment takes to serve one window alone: its capacity, measured."""
    started = time.monotonic()
    await replay(window, [base_url], API_KEY, model,
                 lengths=deployment_lengths(LengthMode.UNKNOWN))
    return time.monotonic() - started


def spread(specs: list, period_s: float) -> list:
    """The window's arrivals stretched to fill `period_s`, gaps keeping their shape."""
    span = specs[-1].arrival_s or 1.0
    scale = period_s * (len(specs) - 1) / len(specs) / span
    return [dataclasses.replace(spec, arrival_s=spec.arrival_s * scale) for spec in specs]


async def trace_load(base_url: str, model: str, until: float, windows: list[list],
                     period_s: float, finished: list[tuple[float, list]]) -> int:
    """Trace windows, one every `period_s`, until `until` (monotonic); each window's
    records land in `finished` with the time it ended. Returns the requests sent."""
    lengths = deployment_lengths(LengthMode.UNKNOWN)
    tasks, sent = [], 0

    async def one_window(specs: list) -> None:
        records, _ = await replay(specs, [base_url], API_KEY, model, lengths=lengths)
        finished.append((time.monotonic(), records))

    for specs in itertools.cycle(windows):
        if time.monotonic() >= until:
            break
        tasks.append(asyncio.create_task(one_window(spread(specs, period_s))))
        sent += len(specs)
        await asyncio.sleep(period_s)
    await asyncio.gather(*tasks)
    return sent


async def cancelled_stream(http: httpx.AsyncClient, model: str, rng: random.Random) -> str:
    """A stream the client closes after its first event, or before any."""
    before = rng.random() < 0.5
    body = {"model": model, "max_tokens": rng.randint(16, 256), "stream": True,
            "ignore_eos": True, "prompt": " ".join(rng.choice(["alpha", "beta", "gamma"])
                                                   for _ in range(rng.randint(5, 200)))}
    async with http.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200 or before:
            return f"cancelled:{response.status_code}"
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                break
        return "cancelled:200"


async def sprinkle(base_url: str, model: str, until: float, bodies: list[tuple[str, object]],
                   outcomes: collections.Counter, wrong: list[str]) -> None:
    """One fuzzed request and one cancelled stream every SPRINKLE_S until `until`."""
    rng = random.Random(0)
    cases = itertools.cycle(bodies)
    with httpx.Client(base_url=base_url, headers=HEADERS, timeout=600) as sync_http:
        async def fuzzed(path: str, body: object) -> None:
            outcome = await asyncio.to_thread(fuzz.send, sync_http, path, body)
            outcomes[f"fuzzed:{outcome.status}"] += 1
            if outcome.problem():
                wrong.append(outcome.report())

        async with httpx.AsyncClient(base_url=base_url, headers=HEADERS, timeout=600) as http:
            async def cancelled() -> None:
                try:
                    outcomes[await cancelled_stream(http, model, rng)] += 1
                except httpx.HTTPError as exc:
                    outcomes[f"cancelled:client-error:{type(exc).__name__}"] += 1

            tasks = []
            while time.monotonic() < until:
                tasks += [asyncio.create_task(fuzzed(*next(cases))),
                          asyncio.create_task(cancelled())]
                await asyncio.sleep(SPRINKLE_S)
            await asyncio.gather(*tasks)


# --- the verdict -------------------------------------------------------------------------
def theil_sen(xs: list[float], ys: list[float]) -> float:
    slopes = [(y2 - y1) / (x2 - x1) for (x1, y1), (x2, y2)
              in itertools.combinations(zip(xs, ys), 2) if x2 != x1]
    return statistics.median(slopes) if slopes else 0.0


def trend(xs: list[float], ys: list[float], floor: float) -> dict:
    """The stated trend test (module docstring) on one series."""
    slope = theil_sen(xs, ys)
    intercept = statistics.median(y - slope * x for x, y in zip(xs, ys))
    noise = 1.4826 * statistics.median(abs(y - slope * x - intercept) for x, y in zip(xs, ys))
    drift = slope * (xs[-1] - xs[0])
    allowed = max(floor, 2 * noise)
    return {"drift": drift, "noise": noise, "allowed": allowed, "first": ys[0], "last": ys[-1],
            "median": statistics.median(ys), "flat": abs(drift) <= allowed}


def per_minute(rows: list[dict], finished: list[tuple[float, list]], started: float,
               interval_s: float) -> list[dict]:
    """Each sample with the client's 429s and TTFT p99 of the windows that ended since
    the sample before."""
    for row in rows:
        window = [records for ended, records in finished
                  if row["t_s"] - interval_s < ended - started <= row["t_s"]]
        records = [r for records in window for r in records]
        row["rejected_429"] = sum(r.status == 429 for r in records)
        row["errors"] = sum(r.status not in (200, 429) for r in records)
        row["ttft_p99_s"] = percentile([r.ttft_s for r in records if r.status == 200], 0.99)
        row["requests_finished"] = len(records)
    return rows


def verdict(rows: list[dict], warmup_s: float) -> dict:
    after = [row for row in rows if row["t_s"] > warmup_s]
    checks = {}
    for name, (unit, floor) in SERIES.items():
        points = [(row["t_s"], row[name]) for row in after if row.get(name) is not None]
        if len(points) < 3:
            checks[name] = {"flat": False, "why": f"only {len(points)} samples after warm-up"}
            continue
        checks[name] = {"unit": unit, **trend(*map(list, zip(*points)), floor)}
    return checks


def plot(rows: list[dict], checks: dict, warmup_s: float, out: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 3, figsize=(14, 10), sharex=True)
    for ax, (name, (unit, _)) in zip(axes.flat, SERIES.items()):
        points = [(row["t_s"] / 60, row[name]) for row in rows if row.get(name) is not None]
        if points:
            ax.plot(*zip(*points), marker="o", ms=3)
        ax.axvline(warmup_s / 60, color="grey", ls=":")
        flat = checks.get(name, {}).get("flat")
        ax.set_title(f"{name} ({'flat' if flat else 'NOT flat'})", fontsize=10)
        ax.set_ylabel(unit)
    for ax in axes[-1]:
        ax.set_xlabel("minutes")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(f"{out}.png", dpi=90)


# --- the run -----------------------------------------------------------------------------
def idle_state(base_url: str) -> dict:
    now = state(base_url)
    return {key: now[key] for key in ("queued_requests", "ledger_reserved_blocks",
                                      "in_flight", "snapshot_held_blocks", "replica_running")}


def soak(args) -> dict:
    config = load_config()
    windows = [workload(TRACE, WINDOW_REQUESTS, seed)[0] for seed in WINDOW_SEEDS]
    outcomes: collections.Counter = collections.Counter()
    wrong: list[str] = []
    finished: list[tuple[float, list]] = []
    with serve_run(config, expected_replicas=replica_count(config),
                   env={"BLOCKSERVE_API_KEY": API_KEY}) as run:
        model = app_config(config).replica.model_name
        spec = httpx.get(f"{run.base_url}/openapi.json", timeout=60).json()
        bodies = [(path, fuzz.affordable(body, index, FUZZ_MAX_TOKENS))
                  for path in fuzz.ROUTES for mode in fuzz.MODES
                  for index, body in enumerate(fuzz.generate(spec, path, mode, FUZZ_CASES,
                                                             args.seed))]
        random.Random(args.seed).shuffle(bodies)
        period_s = asyncio.run(measured_period(run.base_url, model, windows[0]))
        engines_before = state(run.base_url)["engine_pids"]
        sampler = Sampler(run.base_url, run.process.pid, args.sample_s)
        started = time.monotonic()
        until = started + args.minutes * 60
        sampler.start()

        async def load() -> int:
            sent, _ = await asyncio.gather(
                trace_load(run.base_url, model, until, windows, period_s, finished),
                sprinkle(run.base_url, model, until, bodies, outcomes, wrong))
            return sent

        sent = asyncio.run(load())
        elapsed = time.monotonic() - started
        sampler.stopped.set()
        sampler.join()
        time.sleep(5)
        final = idle_state(run.base_url)
        engines_after = state(run.base_url)["engine_pids"]
    rows = per_minute(sampler.rows, finished, started, args.sample_s)
    checks = verdict(rows, args.warmup_minutes * 60)
    records = [r for _, window in finished for r in window]
    return {
        "command": f"python -m blockserve.bench.soak --minutes {args.minutes} --warmup-minutes "
                   f"{args.warmup_minutes} --sample-s {args.sample_s} --seed {args.seed} "
                   f"--out {args.out}",
        "label": args.label, "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "elapsed_s": elapsed, "trace": TRACE, "window_requests": WINDOW_REQUESTS,
        "window_period_s": period_s,
        "window_seeds": list(WINDOW_SEEDS), "length_mode": "unknown",
        "trace_requests": {"sent": sent, "finished": len(records),
                           "ok": sum(r.status == 200 for r in records),
                           "rejected_429": sum(r.status == 429 for r in records),
                           "errors": sum(r.status not in (200, 429) for r in records),
                           "output_tokens": sum(r.output_tokens for r in records
                                                if r.status == 200)},
        "sprinkle": dict(outcomes), "sprinkle_5xx_or_malformed": wrong[:20],
        "engines_restarted": engines_before != engines_after,
        "final_idle_state": final, "samples": rows, "trend": checks,
        "passed": (all(check["flat"] for check in checks.values()) and not wrong
                   and all(v == 0 for v in final.values())
                   and engines_before == engines_after),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=60)
    parser.add_argument("--warmup-minutes", type=float, default=10)
    parser.add_argument("--sample-s", type=float, default=60)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--label", default="the hour run")
    parser.add_argument("--out", default="results/soak")
    args = parser.parse_args()
    # A stopped soak (timeout, kill) still stops its deployment: serve_run's finally runs.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    report = soak(args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(f"{args.out}.json").write_text(json.dumps(report, indent=1, default=repr) + "\n")
    plot(report["samples"], report["trend"], args.warmup_minutes * 60, args.out,
         f"soak ({args.label}): {args.minutes:g} min, {TRACE} at capacity, lengths unknown")
    for name, check in report["trend"].items():
        print(f"{name:<28} {'flat' if check['flat'] else 'NOT FLAT':<9} "
              + (f"drift {check['drift']:+.2f} allowed {check['allowed']:.2f}"
                 if "drift" in check else check["why"]))
    print(f"trace: {report['trace_requests']}  sprinkle: {report['sprinkle']}")
    print(f"final: {report['final_idle_state']}  passed: {report['passed']}")


if __name__ == "__main__":
    main()
