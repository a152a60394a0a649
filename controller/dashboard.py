"""The Grafana dashboard, generated from code, and a PNG renderer that needs no Grafana.

    python -m blockserve.controller.dashboard build            # writes dashboards/blockserve.json
    python -m blockserve.controller.dashboard render --prometheus http://127.0.0.1:9090 --out x.png

Every panel's PromQL is here, so a test can check each metric it names against what the
router exports and evaluate every query against a real Prometheus.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from blockserve.protocol.blocks import STATES

DASHBOARD_PATH = Path(__file__).resolve().parent.parent / "dashboards" / "blockserve.json"
SEL = 'app="$app", replica=~"$replica"'
RATE = "$__rate_interval"


@dataclass
class Panel:
    title: str
    targets: list[tuple[str, str]]  # (PromQL, legend)
    unit: str = "short"
    kind: str = "timeseries"  # timeseries | heatmap | stat
    stacked: bool = False
    width: int = 12
    description: str = ""


@dataclass
class Row:
    title: str
    panels: list[Panel] = field(default_factory=list)


def _quantiles(metric: str, by: str = "") -> list[tuple[str, str]]:
    group = f"le{', ' + by if by else ''}"
    legend = f"{{{{{by}}}}} " if by else ""
    return [(f"histogram_quantile({q}, sum by ({group}) (rate({metric}_bucket{{{SEL_FOR[metric]}}}[{RATE}])))",
             f"{legend}p{int(q * 100)}") for q in (0.5, 0.99)]


SEL_FOR = {
    "blockserve_admission_wait_seconds": 'app="$app"',
    "blockserve_time_to_first_token_seconds": 'app="$app"',
    "blockserve_request_duration_seconds": 'app="$app"',
    "blockserve_replica_inter_token_latency_seconds": SEL,
    "blockserve_replica_time_to_first_token_seconds": SEL,
}

ROWS = [
    Row("Cluster block utilisation", [
        Panel("Held KV blocks / capacity (cluster)",
              [(f'sum(blockserve_replica_kv_blocks{{{SEL}, state="held"}}) / '
                f'sum(blockserve_replica_kv_blocks_capacity{{{SEL}}})', "held")],
              unit="percentunit", kind="stat", width=6),
        Panel("KV blocks by state (cluster)",
              [(f'sum by (state) (blockserve_replica_kv_blocks{{{SEL}}})', "{{state}}")],
              stacked=True, width=18),
    ]),
    Row("Per-replica block breakdown", [
        Panel(f"KV blocks per replica: {' / '.join(STATES)}",
              [(f'blockserve_replica_kv_blocks{{{SEL}}}', "{{replica}} {{state}}")],
              stacked=True, width=24,
              description="; ".join(f"{state}: {meaning}" for state, meaning in STATES.items())),
        Panel("What running and waiting work will still take",
              [(f'blockserve_replica_kv_growth_blocks{{{SEL}}}', "{{replica}} growth"),
               (f'blockserve_replica_kv_waiting_blocks{{{SEL}}}', "{{replica}} waiting")],
              width=12, description="growth: further blocks the running requests take before "
                                    "their peak; waiting: new blocks the engine's waiting "
                                    "requests need to start"),
        Panel("KV usage heatmap per replica",
              [(f'blockserve_replica_kv_usage_ratio{{{SEL}}}', "{{replica}}")],
              unit="percentunit", kind="heatmap", width=12),
    ]),
    Row("Block policies", [
        Panel("What the block policies did, per replica (rate)",
              [(f'rate(blockserve_replica_{effect}_total{{{SEL}}}[{RATE}]) * on (app, replica) '
                f'group_left (eviction, retention, budget) '
                f'blockserve_replica_block_policies_info{{{SEL}}}',
                f"{{{{replica}}}} {label} ({{{{{kind}}}}})")
               for effect, label, kind in (("cached_blocks_evicted", "evicted", "eviction"),
                                           ("blocks_spared", "spared", "eviction"),
                                           ("blocks_sent_first", "sent first", "retention"),
                                           ("admissions_refused", "refused", "budget"))],
              unit="ops", width=24,
              description="replica.scheduler.block_eviction / block_retention / block_budget "
                          "at work: cached blocks evicted, spared by the eviction policy, "
                          "sent first by the retention policy, admissions the budget "
                          "refused (counted while block policies are installed)"),
    ]),
    Row("Admission queue and ledger", [
        Panel("Queue depth", [('sum(blockserve_queue_requests{app="$app"})', "requests"),
                              ('sum(blockserve_queue_blocks{app="$app"})', "blocks")]),
        Panel("Admission wait", _quantiles("blockserve_admission_wait_seconds"), unit="s"),
        Panel("Router ledger: reserved and available blocks, requests in flight",
              [(f'sum by (replica) (blockserve_ledger_reserved_blocks{{{SEL}}})',
                "{{replica}} reserved"),
               (f'min by (replica) (blockserve_ledger_available_blocks{{{SEL}}})',
                "{{replica}} available"),
               (f'sum by (replica) (blockserve_ledger_in_flight_requests{{{SEL}}})',
                "{{replica}} requests")],
              description="summed over routers; reserved: the demand of unfinished requests; "
                          "available: total - committed - unreflected, what the most "
                          "committed router may still give out"),
        Panel("Ledger drift (predicted - reported blocks)",
              [(f'max by (replica) (blockserve_ledger_drift_blocks{{{SEL}}})', "{{replica}}")]),
    ]),
    Row("Preemptions and requests", [
        Panel("Preemption rate", [(f'sum by (replica) (rate(blockserve_replica_preemptions_total'
                                   f'{{{SEL}}}[{RATE}]))', "{{replica}}")], unit="ops"),
        Panel("Preemptions (total)", [(f'sum(blockserve_replica_preemptions_total{{{SEL}}})',
                                       "preemptions")], kind="stat", width=6),
        Panel("Running / waiting per replica",
              [(f'blockserve_replica_requests{{{SEL}}}', "{{replica}} {{state}}")], width=18),
    ]),
    Row("Prefix cache", [
        Panel("Prefix cache hit rate",
              [(f'sum by (replica) (rate(blockserve_replica_prefix_cache_hits_tokens_total'
                f'{{{SEL}}}[{RATE}])) / sum by (replica) (rate('
                f'blockserve_replica_prefix_cache_queries_tokens_total{{{SEL}}}[{RATE}]))',
                "{{replica}}")], unit="percentunit", width=12),
        Panel("Routing regret: predicted vs reported prefix hit",
              [(f'sum by (replica) (rate(blockserve_prefix_{kind}_tokens_total{{{SEL}}}'
                f'[{RATE}])) / sum by (replica) (rate(blockserve_prefix_prompt_tokens_total'
                f'{{{SEL}}}[{RATE}]))', f"{{{{replica}}}} {legend}")
               for kind, legend in (("predicted_hit", "predicted"),
                                    ("reported_hit", "reported"), ("regret", "regret"))],
              unit="percentunit", width=12,
              description="Per request: the prefix hit the router's index predicted at "
                          "placement against the hit vLLM reported (router/regret.py), as "
                          "shares of prompt tokens; regret sums |predicted - reported|."),
    ]),
    Row("Latency", [
        Panel("Time to first token (router)",
              _quantiles("blockserve_time_to_first_token_seconds"), unit="s", width=8),
        Panel("Inter-token latency (vLLM, per replica)",
              _quantiles("blockserve_replica_inter_token_latency_seconds", "replica"),
              unit="s", width=8),
        Panel("End-to-end latency (router)",
              _quantiles("blockserve_request_duration_seconds"), unit="s", width=8),
    ]),
    Row("Router decisions", [
        Panel("Decisions per replica and policy",
              [(f'sum by (replica, policy) (rate(blockserve_decisions_total{{{SEL}}}[{RATE}]))',
                "{{policy}} -> {{replica}}")], unit="reqps"),
        Panel("Rejections by reason",
              [(f'sum by (reason) (rate(blockserve_rejections_total{{app="$app"}}[{RATE}]))',
                "{{reason}}")], unit="reqps"),
    ]),
]


def _variables() -> list[dict]:
    def query(name: str, expression: str, multi: bool) -> dict:
        return {"name": name, "type": "query", "label": name,
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "query": {"query": expression, "refId": f"{name}-var"},
                "definition": expression, "refresh": 2, "multi": multi,
                "includeAll": multi, "allValue": ".*" if multi else None, "sort": 1,
                "current": {}}

    return [
        {"name": "datasource", "type": "datasource", "query": "prometheus",
         "label": "Prometheus", "current": {}, "hide": 0},
        query("app", "label_values(blockserve_replica_kv_blocks_capacity, app)", False),
        query("replica",
              'label_values(blockserve_replica_kv_blocks_capacity{app="$app"}, replica)', True),
    ]


def build() -> dict:
    panels, next_id, y = [], 1, 0
    for row in ROWS:
        panels.append({"id": next_id, "type": "row", "title": row.title, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        next_id, y, x = next_id + 1, y + 1, 0
        for panel in row.panels:
            if x + panel.width > 24:
                x, y = 0, y + 8
            panels.append(_panel(panel, next_id, x, y))
            next_id, x = next_id + 1, x + panel.width
        y += 8
    return {
        "title": "blockserve: KV blocks", "uid": "blockserve-blocks", "schemaVersion": 39,
        "version": 1, "editable": True, "tags": ["blockserve", "vllm", "kv-cache"],
        "time": {"from": "now-30m", "to": "now"}, "refresh": "10s",
        "templating": {"list": _variables()}, "panels": panels,
        "annotations": {"list": []},
    }


def _panel(panel: Panel, panel_id: int, x: int, y: int) -> dict:
    defaults: dict = {"unit": panel.unit}
    if panel.kind == "timeseries":
        defaults["custom"] = {"stacking": {"mode": "normal" if panel.stacked else "none"},
                              "fillOpacity": 60 if panel.stacked else 10}
    return {
        "id": panel_id, "type": panel.kind, "title": panel.title,
        "description": panel.description,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"h": 8, "w": panel.width, "x": x, "y": y},
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "targets": [{"refId": chr(ord("A") + i), "expr": expr, "legendFormat": legend,
                     "datasource": {"type": "prometheus", "uid": "${datasource}"}}
                    for i, (expr, legend) in enumerate(panel.targets)],
    }


def queries(dashboard: dict) -> list[tuple[str, str]]:
    """(panel title, PromQL) for every target of every panel."""
    return [(p["title"], t["expr"]) for p in dashboard["panels"] for t in p.get("targets", [])]


def metric_names(expression: str) -> set[str]:
    names = set(re.findall(r"\b(blockserve_[a-z_]+)", expression))
    for suffix in ("_bucket", "_count", "_sum"):
        names = {n[: -len(suffix)] if n.endswith(suffix) and "_seconds" in n else n
                 for n in names}
    return names


def substitute(expression: str, app: str, rate_window: str = "1m") -> str:
    return (expression.replace("$app", app).replace("$replica", ".*")
            .replace("$__rate_interval", rate_window))


# --- rendering without Grafana -------------------------------------------------------------
def render(prometheus_url: str, out: str, app: str, minutes: float = 10.0) -> None:
    import httpx
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dashboard = build()
    drawable = [p for p in dashboard["panels"] if p["type"] != "row"]
    columns = 3
    rows = -(-len(drawable) // columns)
    figure, axes = plt.subplots(rows, columns, figsize=(6 * columns, 3.2 * rows))
    end = time.time()
    for axis, panel in zip(axes.flat, drawable):
        axis.set_title(panel["title"], fontsize=9)
        stacked = panel["fieldConfig"]["defaults"].get("custom", {}).get(
            "stacking", {}).get("mode") == "normal"
        series = []
        for target in panel["targets"]:
            response = httpx.get(f"{prometheus_url}/api/v1/query_range", params={
                "query": substitute(target["expr"], app, "30s"), "start": end - minutes * 60,
                "end": end, "step": max(1.0, minutes * 60 / 300)}, timeout=30).json()
            for result in response["data"]["result"]:
                label = re.sub(r"\{\{(\w+)\}\}", lambda m: result["metric"].get(m.group(1), ""),
                               target["legendFormat"])
                points = [(float(t) - end, float(v)) for t, v in result["values"]
                          if v not in ("NaN", "+Inf", "-Inf")]
                if points:
                    series.append((label, points))
        if panel["type"] == "heatmap" and series:
            grid = [[v for _, v in points] for _, points in series]
            width = min(len(row) for row in grid)
            axis.imshow([row[:width] for row in grid], aspect="auto", cmap="viridis",
                        vmin=0, vmax=1, extent=(series[0][1][0][0], 0, len(grid), 0))
            axis.set_yticks([i + 0.5 for i in range(len(grid))], [s[0] for s in series],
                            fontsize=7)
        elif stacked and series:
            times = [t for t, _ in series[0][1]]
            aligned = [[dict(points).get(t, 0.0) for t in times] for _, points in series]
            axis.stackplot(times, aligned, labels=[s[0] for s in series])
        else:
            for label, points in series:
                axis.plot([t for t, _ in points], [v for _, v in points], label=label)
        if series and panel["type"] != "heatmap":
            axis.legend(fontsize=6, loc="upper left")
        axis.set_xlabel("seconds before now", fontsize=7)
        axis.tick_params(labelsize=7)
    for axis in list(axes.flat)[len(drawable):]:
        axis.axis("off")
    figure.tight_layout()
    figure.savefig(out, dpi=80)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    build_cmd = commands.add_parser("build")
    build_cmd.add_argument("--out", default=str(DASHBOARD_PATH))
    render_cmd = commands.add_parser("render")
    render_cmd.add_argument("--prometheus", default="http://127.0.0.1:9090")
    render_cmd.add_argument("--app", default="blockserve")
    render_cmd.add_argument("--minutes", type=float, default=10.0)
    render_cmd.add_argument("--out", default="dashboard.png")
    args = parser.parse_args(argv)
    if args.command == "build":
        Path(args.out).write_text(json.dumps(build(), indent=2) + "\n")
        print(f"wrote {args.out}")
    else:
        render(args.prometheus, args.out, args.app, args.minutes)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
