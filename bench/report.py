"""What a benchmark run reports: per-request records summarised, tables of absolute
numbers and of ratios against our configuration, issue 15's targets checked, TTFT CDF
and KV usage plots. Shared by the harness and the simulator."""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace

from blockserve.router.predictors import quantile

OURS = "blockserve"
SLO_TTFT_S, SLO_ITL_S = 2.0, 0.1  # goodput counts requests within both


def percentile(values: list[float | None], q: float) -> float | None:
    """The `q` quantile of the measured values (None where nothing was measured)."""
    values = sorted(v for v in values if v is not None)
    return quantile(values, q) if values else None


def summarise(records, makespan: float, preemptions: float, slo_ttft_s: float,
              slo_itl_s: float) -> dict:
    ok = [r for r in records if r.status == 200]
    good = [r for r in ok if r.ttft_s is not None and r.ttft_s <= slo_ttft_s
            and (r.itl_s is None or r.itl_s <= slo_itl_s)]
    return {
        "requests": len(records), "ok": len(ok),
        "rejected_429": sum(r.status == 429 for r in records),
        "errors": sum(r.status not in (200, 429) for r in records),
        "makespan_s": makespan,
        "output_tokens_per_s": sum(r.output_tokens for r in ok) / makespan,
        "goodput_rps": len(good) / makespan,
        "preemptions": preemptions,
        **{f"{metric}_p{int(q * 100)}_s": percentile([getattr(r, f"{metric}_s") for r in ok], q)
           for metric in ("ttft", "itl", "e2e") for q in (0.5, 0.99)},
    }


def summary_over(records: list[dict], summaries: list[dict], slo_ttft_s: float,
                 slo_itl_s: float) -> dict:
    """Requests recorded in several runs (their `summaries`), summarised as one run: over
    the runs' summed makespans and preemptions (None where a run has none measured)."""
    preemptions = [s["preemptions"] for s in summaries]
    return summarise([SimpleNamespace(**r) for r in records],
                     sum(s["makespan_s"] for s in summaries),
                     None if None in preemptions else sum(preemptions), slo_ttft_s, slo_itl_s)


# What a seed's replay recorded besides its figures, kept per seed when seeds pool.
SEED_DETAILS = ("router", "cpu_cores", "cpu_speed", "engines_idle", "engine_load")


def pooled(runs: list[dict], slo_ttft_s: float, slo_itl_s: float) -> dict:
    """One workload replayed with several seeds, as one run: every request's record, the
    makespans and preemptions summed (so throughput and goodput are totals over the
    time all seeds took, and percentiles are over all requests)."""
    records = [r for run in runs for r in run["records"]]
    return {"summary": summary_over(records, [run["summary"] for run in runs], slo_ttft_s,
                                    slo_itl_s),
            "length_check": {key: (max if key.startswith("max") else sum)(
                run["length_check"][key] for run in runs) for key in runs[0]["length_check"]},
            "records": records,
            "kv_usage": runs[0]["kv_usage"],
            "seeds": [{"seed": run["seed"], "summary": run["summary"],
                       "length_check": run["length_check"],
                       **{key: run[key] for key in SEED_DETAILS if key in run}}
                      for run in runs]}


def _known(value) -> bool:
    return value is not None and not math.isnan(value)


def ratio(mine: dict, theirs: dict, key: str) -> float | None:
    """ours / theirs; inf where only theirs is 0, nan where both are, None where either
    is not measured (a peer that exports no preemptions)."""
    a, b = mine.get(key), theirs.get(key)
    if not (_known(a) and _known(b)):
        return None
    if b == 0:
        return math.nan if a == 0 else math.inf
    return a / b


def _shown(value: float | None) -> str:
    if value is None:
        return "-"
    return "0/0" if math.isnan(value) else "inf" if math.isinf(value) else f"{value:.2f}x"


def ratio_table(results: dict, workload: str) -> list[str]:
    ours = results.get(OURS, {}).get(workload)
    if ours is None:
        return []
    rows = [f"\n{workload}: {OURS} vs each configuration (ratio = ours / theirs)",
            f"{'vs':<30}{'p99 TTFT':>10}{'p50 TTFT':>10}{'preempt':>10}{'tok/s':>8}"
            f"{'goodput':>9}"]
    mine = ours["summary"]
    for name, by_workload in results.items():
        if name == OURS or workload not in by_workload:
            continue
        theirs = by_workload[workload]["summary"]
        rows.append(f"{name:<30}" + "".join(
            f"{_shown(ratio(mine, theirs, key)):>{width}}" for key, width in
            (("ttft_p99_s", 10), ("ttft_p50_s", 10), ("preemptions", 10),
             ("output_tokens_per_s", 8), ("goodput_rps", 9))))
    return rows


def absolute_table(results: dict, workload: str) -> list[str]:
    rows = [f"\n{workload}: absolute",
            f"{'configuration':<30}{'ok':>5}{'429':>5}{'err':>5}{'tok/s':>8}{'TTFT p50':>10}"
            f"{'TTFT p99':>10}{'ITL p50':>9}{'preempt':>9}{'goodput':>9}"]
    for name, by_workload in results.items():
        if workload not in by_workload:
            continue
        s = by_workload[workload]["summary"]
        rows.append(f"{name:<30}{s['ok']:>5}{s['rejected_429']:>5}{s['errors']:>5}"
                    f"{s['output_tokens_per_s']:>8.0f}{s['ttft_p50_s'] or 0:>10.2f}"
                    f"{s['ttft_p99_s'] or 0:>10.2f}{s['itl_p50_s'] or 0:>9.3f}"
                    f"{s['preemptions']:>9.0f}{s['goodput_rps']:>9.2f}")
    return rows


@dataclass(frozen=True)
class Target:
    """Issue 15: ours / `against` on `key` must be `at_least` (else at most) `bound`."""

    against: tuple[str, ...]
    key: str
    bound: float
    at_least: bool

    @property
    def bound_text(self) -> str:
        return f"{'>=' if self.at_least else '<='} {self.bound}x"

    def check(self, mine: dict, theirs: dict) -> tuple[float | None, bool]:
        """(ours / theirs, met); on the values, so 0 preemptions against 0 is met."""
        value, a, b = ratio(mine, theirs, self.key), mine.get(self.key), theirs.get(self.key)
        if value is None:
            return None, False
        return value, a >= self.bound * b if self.at_least else a <= self.bound * b


MEMORY_BLIND = ("power of two", "round robin")
TARGETS = [Target(MEMORY_BLIND, "output_tokens_per_s", 1.05, True),
           Target(MEMORY_BLIND, "goodput_rps", 1.3, True),
           Target(MEMORY_BLIND, "ttft_p99_s", 0.7, False),
           Target(MEMORY_BLIND, "preemptions", 0.2, False),
           Target(("raw vLLM x2",), "output_tokens_per_s", 0.95, True)]


def target_checks(results: dict, workload: str) -> list[dict]:
    """Every target whose two configurations ran this workload: ratio, met or missed."""
    ours = results.get(OURS, {}).get(workload)
    checks = []
    for target in TARGETS if ours else []:
        for name in target.against:
            if workload not in results.get(name, {}):
                continue
            theirs = results[name][workload]
            value, met = target.check(ours["summary"], theirs["summary"])
            check = {"workload": workload, "against": name, "metric": target.key,
                     "bound": target.bound_text,
                     "ratio": value, "met": met}
            seeds = _per_seed(target, ours, theirs)
            if seeds:
                check.update(seed_ratios=[value for value, _ in seeds],
                             met_seeds=sum(met for _, met in seeds))
            checks.append(check)
    return checks


def _per_seed(target: "Target", ours: dict, theirs: dict) -> list[tuple[float | None, bool]]:
    """The target checked on each seed both pooled runs replayed (none for one run)."""
    mine = {run["seed"]: run["summary"] for run in ours.get("seeds", [])}
    return [target.check(mine[run["seed"]], run["summary"])
            for run in theirs.get("seeds", []) if run["seed"] in mine] if len(mine) > 1 else []


def seed_spread(check: dict) -> str:
    """`min-max over n seeds (met in k)`, or nothing for a run of one seed."""
    known = [r for r in check.get("seed_ratios", []) if r is not None and not math.isnan(r)]
    if not known:
        return ""
    return (f"{min(known):.2f}-{max(known):.2f}x over {len(check['seed_ratios'])} seeds, "
            f"met in {check['met_seeds']}")


def target_table(checks: list[dict]) -> list[str]:
    if not checks:
        return []
    rows = [f"\n{checks[0]['workload']}: issue 15's targets ({OURS} / them)"]
    rows += [f"  vs {c['against']:<14}{c['metric']:<22}{c['bound']:>9}  "
             f"{_shown(c['ratio']):>7}  {'met' if c['met'] else 'MISSED'}  {seed_spread(c)}"
             for c in checks]
    return rows


def plot(results: dict, workloads: list[str], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(workloads), figsize=(6 * len(workloads), 4), squeeze=False)
    for axis, workload in zip(axes[0], workloads):
        for name, by_workload in results.items():
            if workload in by_workload:
                ttfts = sorted(r["ttft_s"] for r in by_workload[workload]["records"]
                               if r["ttft_s"] is not None)
                axis.plot(ttfts, [(i + 1) / len(ttfts) for i in range(len(ttfts))], label=name)
        axis.set_title(f"TTFT CDF: {workload}")
        axis.set_xlabel("seconds")
        axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(f"{out}-ttft.png", dpi=80)
    names = [n for n in results if workloads[0] in results[n]  # peers export no KV usage
             and any(usage for _, usage in results[n][workloads[0]]["kv_usage"])]
    if not names:
        return
    figure, axes = plt.subplots(len(names), 1, figsize=(9, 2.2 * len(names)), squeeze=False)
    for axis, name in zip(axes[:, 0], names):
        trace = results[name][workloads[0]]["kv_usage"]
        for replica in sorted({r for _, usage in trace for r in usage}):
            axis.plot([t for t, _ in trace], [u.get(replica, 0) for _, u in trace], label=replica)
        axis.set_ylim(0, 1.05)
        axis.set_title(f"{name}: KV usage per replica ({workloads[0]})", fontsize=9)
        axis.legend(fontsize=6, loc="upper right")
    axes[-1, 0].set_xlabel("seconds")
    figure.tight_layout()
    figure.savefig(f"{out}-kv.png", dpi=80)


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


def _milliseconds(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f} ms"


def markdown(results: dict, labels: list[str], checks: list[dict]) -> str:
    """The run's tables in Markdown (`<out>.md`), for docs that quote it verbatim."""
    lines = []
    for label in labels:
        lines += [f"\n**{label}**\n",
                  "| configuration | ok | tok/s | TTFT p50 | TTFT p99 | ITL p50 | preemptions "
                  "| goodput req/s | ended at true length |", "|---" * 9 + "|"]
        for name, by_label in results.items():
            if label not in by_label:
                continue
            s, length = by_label[label]["summary"], by_label[label]["length_check"]
            lines.append(f"| {name} | {s['ok']}/{s['requests']} | {s['output_tokens_per_s']:.0f} "
                         f"| {_seconds(s['ttft_p50_s'])} | {_seconds(s['ttft_p99_s'])} "
                         f"| {_milliseconds(s['itl_p50_s'])} | {s['preemptions']:.0f} "
                         f"| {s['goodput_rps']:.2f} | {length['exact']}/{length['ok']} |")
    if checks:
        lines += [f"\n**Targets ({OURS} / them; ratio of the seeds pooled, then each seed's)**\n",
                  "| workload | vs | metric | target | ratio | | per seed |", "|---" * 7 + "|"]
        lines += [f"| {c['workload']} | {c['against']} | {c['metric']} | {c['bound']} "
                  f"| {_shown(c['ratio'])} | {'met' if c['met'] else '**missed**'} "
                  f"| {seed_spread(c) or '-'} |" for c in checks]
    return "\n".join(lines) + "\n"
