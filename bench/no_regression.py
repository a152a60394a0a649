"""The no-regression figures (issue 26) over one or more harness runs, pooled.

    python -m blockserve.bench.no_regression docs/results/no_regression10.json \
        docs/results/no_regression11.json [--out docs/results/no_regression10_11]

Each configuration of the runs that is not a peer (ours and any candidate) must keep, on
every workload, against power of two and against round robin: throughput and goodput at
least 0.97x, TTFT p99 at most 1.2x. On this 2-core machine the same requests against the
same configuration moved up to 2x between two deployments (docs/benchmarks.md, run 11),
so one run of 2 rounds can miss or meet a 3% figure by chance; runs of the same command
pool into more rounds. A configuration's replays of a workload, from every run given,
are pooled as the harness pools seeds (bench/report.py): all their requests, over their
summed makespans; each figure pools only the runs that replayed both configurations.
The runs must share their goodput SLOs, and a configuration its settings: "blockserve"
is deploy.yaml as each run found it, so runs from before and after a change of the
default do not pool. A default whose setting deploy.yaml does not spell (a class default)
looks the same before and after its change: `--pool-as RUN CONFIG NAME` pools the RUNth
file's CONFIG under NAME instead (e.g. the new default with the run that tried it as a
candidate), without that check, and the report says so.

Beside each throughput figure stands the same ratio at equal machine speed, where every
replay recorded the harness's CPU speed probe (bench/cpu_speed.py): each side's tokens
over its makespans weighted by the probe's median speed during them. It assumes that the
engines' speed scales with the probe's (their correlation was 0.87-0.92 in run 11); it
tells a configuration's own loss from a slow spell of the machine, and judges nothing.
Where the replays also recorded the engines' own mean ITL (the harness since `262f703`),
the throughput figure also shows the ratio of the engines' ITL at equal machine speed:
whether a configuration's engines make each token slower, or only ran on a slower spell.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import NamedTuple

from blockserve.bench.report import MEMORY_BLIND, Target, summary_over

FIGURES = [Target(MEMORY_BLIND, "output_tokens_per_s", 0.97, True),
           Target(MEMORY_BLIND, "goodput_rps", 0.97, True),
           Target(MEMORY_BLIND, "ttft_p99_s", 1.2, False)]


def replays(runs: list[dict], pool_as: dict[tuple[int, str], str] | None = None
            ) -> dict[tuple[str, str], dict[int, dict]]:
    """(configuration, workload) -> {index of the run: its pooled result there};
    `pool_as`: (index of a run, a configuration of it) -> the name it counts as
    (module docstring)."""
    pool_as = pool_as or {}
    found: dict[tuple[str, str], dict[int, dict]] = {}
    settings: dict[str, tuple[int, dict | None]] = {}
    for index, run in enumerate(runs):
        for name, by_workload in run["results"].items():
            if (index, name) in pool_as:
                name = pool_as[index, name]
                if name in run["results"]:
                    raise ValueError(f"run {index + 1} has {name!r} already: it cannot "
                                     f"pool another configuration as it")
            first, notes = settings.setdefault(name, (index, by_workload.get("notes")))
            if by_workload.get("notes") != notes and name not in pool_as.values():
                raise ValueError(f"{name!r} ran other settings in run {index + 1} than in "
                                 f"run {first + 1}: pool runs of the same configurations")
            for workload in run["args"]["workloads"]:
                if workload in by_workload:
                    found.setdefault((name, workload), {})[index] = by_workload[workload]
    return found


def _seeds(results: list[dict]) -> list[dict]:
    """Every seed's replay in these pooled results."""
    return [seed for result in results for seed in result["seeds"]]


def _output_tokens(seed: dict) -> float:
    return seed["summary"]["output_tokens_per_s"] * seed["summary"]["makespan_s"]


def pool(results: list[dict], slo_ttft_s: float, slo_itl_s: float) -> dict:
    """One summary of several runs' pooled results of a configuration on a workload."""
    return summary_over([r for result in results for r in result["records"]],
                        [seed["summary"] for seed in _seeds(results)], slo_ttft_s, slo_itl_s)


def tokens_per_speed(results: list[dict]) -> float | None:
    """Output tokens per second per unit of the probe's speed over these replays (module
    docstring); None where a replay has no probe (runs before `0ff3174`)."""
    seeds = _seeds(results)
    if not all("cpu_speed" in seed for seed in seeds):
        return None
    return (sum(map(_output_tokens, seeds))
            / sum(s["cpu_speed"]["median"] * s["summary"]["makespan_s"] for s in seeds))


def engine_itl_times_speed(results: list[dict]) -> float | None:
    """The engines' mean ITL times the probe's speed over these replays, weighted by
    their output tokens: ITL at equal machine speed, up to a constant (module docstring);
    None where a replay lacks either."""
    seeds = _seeds(results)
    if not all("cpu_speed" in s and s.get("router", {}).get("engine_itl_mean_s")
               for s in seeds):
        return None
    return (sum(s["router"]["engine_itl_mean_s"] * s["cpu_speed"]["median"] * _output_tokens(s)
                for s in seeds) / sum(map(_output_tokens, seeds)))


class _Side(NamedTuple):
    """One configuration's replays of a workload over the runs it shares with a peer."""

    pooled: dict  # their summary, pooled
    per_run: list[dict]  # each run's summary
    tokens_per_speed: float | None
    engine_itl_times_speed: float | None


def _side(results: list[dict], slo_ttft_s: float, slo_itl_s: float) -> _Side:
    return _Side(pool(results, slo_ttft_s, slo_itl_s), [r["summary"] for r in results],
                 tokens_per_speed(results), engine_itl_times_speed(results))


def figures(runs: list[dict], pool_as: dict[tuple[int, str], str] | None = None
            ) -> list[dict]:
    """Every figure of every configuration that is not a peer: its ratio pooled over the
    runs that replayed both it and the peer, met or not, and its ratio in each of them."""
    slos = {(run["args"]["slo_ttft"], run["args"]["slo_itl"]) for run in runs}
    if len(slos) != 1:
        raise ValueError(f"the runs' goodput SLOs differ: {sorted(slos)}")
    (slo_ttft_s, slo_itl_s), = slos
    found = replays(runs, pool_as)
    checks = []
    for (name, workload), mine in found.items():
        if name in MEMORY_BLIND:
            continue
        # Each peer over the runs that replayed both, side by side: ours' windows that
        # the peer never saw would weigh on one side of the ratio only. Pooled once per
        # peer, not once per figure.
        pairs = {}
        for peer in dict.fromkeys(p for target in FIGURES for p in target.against):
            theirs = found.get((peer, workload), {})
            shared = [index for index in mine if index in theirs]
            if shared:
                pairs[peer] = (_side([mine[i] for i in shared], slo_ttft_s, slo_itl_s),
                               _side([theirs[i] for i in shared], slo_ttft_s, slo_itl_s))
        for target in FIGURES:
            for peer in (p for p in target.against if p in pairs):
                me, them = pairs[peer]
                value, met = target.check(me.pooled, them.pooled)
                per_run = [target.check(m, t)[0] for m, t in zip(me.per_run, them.per_run)]
                check = {"configuration": name, "workload": workload, "against": peer,
                         "metric": target.key, "bound": target.bound_text, "ratio": value,
                         "met": met, "per_run": per_run, "runs": len(me.per_run)}
                if target.key == "output_tokens_per_s":
                    for key, field in (("at_equal_speed", "tokens_per_speed"),
                                       ("engine_itl_at_equal_speed", "engine_itl_times_speed")):
                        if getattr(me, field) and getattr(them, field):
                            check[key] = getattr(me, field) / getattr(them, field)
                checks.append(check)
    return checks


def table(checks: list[dict]) -> str:
    lines = []
    for name in dict.fromkeys(c["configuration"] for c in checks):
        mine = [c for c in checks if c["configuration"] == name]
        lines += [f"\n**{name}**: {sum(c['met'] for c in mine)} of {len(mine)} figures met\n",
                  "| workload | vs | figure | bound | pooled | each run | at equal CPU speed "
                  "| engines' ITL at equal CPU speed |",
                  "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {c['workload']} | {c['against']} | {c['metric']} | {c['bound']} | "
                  f"{c['ratio']:.2f}x{'' if c['met'] else ' **missed**'} | "
                  f"{' / '.join(f'{r:.2f}x' for r in c['per_run'])} | "
                  f"{_ratio(c, 'at_equal_speed')} | {_ratio(c, 'engine_itl_at_equal_speed')} |"
                  for c in mine]
    return "\n".join(lines)


def _ratio(check: dict, key: str) -> str:
    return f"{check[key]:.2f}x" if key in check else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="the harness's <out>.json files")
    parser.add_argument("--out", help="also write <out>.json and <out>.md")
    parser.add_argument("--pool-as", nargs=3, action="append", default=[],
                        metavar=("RUN", "CONFIG", "NAME"),
                        help="pool the RUNth file's (from 1) CONFIG as NAME (module docstring)")
    args = parser.parse_args()
    runs = [json.loads(Path(path).read_text()) for path in args.runs]
    try:
        pool_as = {(int(run) - 1, config): name for run, config, name in args.pool_as}
    except ValueError:
        parser.error("--pool-as RUN is a file's position, from 1")
    try:
        checks = figures(runs, pool_as)
    except ValueError as exc:
        parser.error(str(exc))
    text = (f"No-regression figures over {', '.join(args.runs)}, pooled\n"
            + "".join(f"\nRun {index + 1}'s {config!r} is pooled as {name!r} (--pool-as).\n"
                      for (index, config), name in pool_as.items()) + table(checks))
    print(text)
    if args.out:
        Path(f"{args.out}.json").write_text(json.dumps(
            {"runs": args.runs, "commits": [run.get("commit") for run in runs],
             "pool_as": [[index + 1, config, name] for (index, config), name in pool_as.items()],
             "figures": checks}, indent=1))
        Path(f"{args.out}.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
