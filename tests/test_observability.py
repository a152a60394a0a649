"""Metrics and the dashboard: promtool-clean expositions, a dashboard whose every query
names an exported metric, and (with the deployment) a real Prometheus that scrapes it."""

import asyncio
import concurrent.futures
import contextlib
import json
import math
import random
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import openai
import pytest

from blockserve.controller import dashboard
from blockserve.protocol.queue_orders import FirstComeFirstServed
from blockserve.protocol.snapshot import BlockSnapshot
from blockserve.router.admission import AdmissionQueue
from blockserve.router.ledger import Ledger
from blockserve.router.metrics import RouterMetrics
from blockserve.router.placement import BestFitBlocks
from blockserve.tools.launch import free_port, wait_until_answers
from conftest import SHAPE
from deployed import TOO_MANY_BLOCKS

PROMTOOL = shutil.which("promtool")
PROMETHEUS = shutil.which("prometheus")
needs_prometheus = pytest.mark.skipif(
    PROMETHEUS is None or PROMTOOL is None,
    reason="Debian's prometheus package is not installed (make test installs it)")


POLICIES = {"eviction": "protect_shared", "retention": "vllm", "budget": "vllm"}


def sample_ledger() -> Ledger:
    """One replica reporting, as the router's ledger holds it."""
    ledger = Ledger()
    ledger.report("r1", BlockSnapshot(timestamp=time.time(), total_blocks=160, block_size=32,
                                      free_blocks=100, cached_blocks=20, held_blocks=60,
                                      growth_blocks=10, waiting_blocks=5, running=3, waiting=1,
                                      block_policies_installed=1, cached_blocks_evicted_total=9,
                                      blocks_spared_total=4),
                  {"vllm_prefix_cache_queries_total": 100, "vllm_prefix_cache_hits_total": 40,
                   "vllm_itl_buckets": [1] * 15, "vllm_itl_sum": 3.0,
                   "vllm_ttft_buckets": [2] * 15, "vllm_ttft_sum": 5.0,
                   "block_policies": POLICIES})
    ledger.reserve("r1", 7)
    return ledger


def sample_exposition(ledger: Ledger | None = None) -> str:
    """The router's exposition of `sample_ledger()`, built from the real classes."""
    ledger = ledger or sample_ledger()
    queue = AdmissionQueue(ledger, BestFitBlocks(), FirstComeFirstServed(), max_requests=1,
                           max_tokens=1, timeout_s=1)
    metrics = RouterMetrics("blockserve", "BestFitBlocks", queue)
    metrics.admitted("r1", 0.2)
    metrics.rejected("too_large")
    metrics.ttft.labels("blockserve", metrics.router).observe(0.3)
    metrics.e2e.labels("blockserve", metrics.router, "200").observe(1.0)
    return metrics.exposition().decode()


def exported_names(exposition: str) -> set[str]:
    return {m.group(1) for m in re.finditer(r"^# TYPE (\S+) ", exposition, re.MULTILINE)}


@needs_prometheus
def test_router_exposition_passes_promtool():
    result = subprocess.run([PROMTOOL, "check", "metrics"], input=sample_exposition(),
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def samples(exposition: str) -> dict[str, float]:
    return {key: float(value) for key, _, value in
            (line.rpartition(" ") for line in exposition.splitlines())
            if key and not key.startswith("#")}


def test_block_states_sum_to_capacity():
    states = {k: v for k, v in samples(sample_exposition()).items()
              if k.startswith("blockserve_replica_kv_blocks{")}
    assert sorted(states.values()) == [20, 60, 80]  # cached, held, empty (100 free - 20)
    assert sum(states.values()) == 160


def test_status_and_metrics_show_the_same_blocks():
    """`blockserve status` prints /admin/state's `blocks` (protocol/blocks.py's
    BlockStates), the metrics export the same object: one set of numbers."""
    from blockserve.controller.cli import COLUMNS, render

    ledger = sample_ledger()
    entry = ledger.replicas["r1"]
    state = {"policies": {"placement": {"cls": "best_fit"}, "queue_order": {"cls": "fcfs"}},
             "queue": {"requests": 0, "blocks": 0},
             "replicas": [{"replica_id": "r1", "snapshot": entry.snapshot.to_dict(),
                           "blocks": entry.blocks.to_dict(), "in_flight_requests": 1,
                           "heard_from_s_ago": 0.1}]}
    header, row = render(state).splitlines()[3:5]
    printed = dict(zip(header.split()[1:], row.split()[1:]))
    assert {key: int(printed[key]) for key in COLUMNS} == {
        "held": 60, "cached": 20, "empty": 80, "growth": 10, "waiting": 5, "reserved": 7,
        "available": 160 - (60 + 10 + 5) - 7, "total": 160}
    exported = samples(sample_exposition(ledger))
    key = 'app="blockserve",replica="r1"'
    for state_name in ("held", "cached", "empty"):
        assert exported[f'blockserve_replica_kv_blocks{{{key},state="{state_name}"}}'] \
            == int(printed[state_name])
    # the ledger's series are the router's own (issue 28): labelled with it
    routed = 'app="blockserve",replica="r1",router="local"'
    for metric, column, labels in (("replica_kv_growth_blocks", "growth", key),
                                   ("replica_kv_waiting_blocks", "waiting", key),
                                   ("ledger_reserved_blocks", "reserved", routed),
                                   ("ledger_available_blocks", "available", routed)):
        assert exported[f"blockserve_{metric}{{{labels}}}"] == int(printed[column]), metric


def test_block_policies_are_exported_per_replica():
    exported = samples(sample_exposition())
    info = [k for k in exported if k.startswith("blockserve_replica_block_policies_info{")]
    assert info == ['blockserve_replica_block_policies_info{app="blockserve",budget="vllm",'
                    'eviction="protect_shared",replica="r1",retention="vllm"}']
    assert exported[info[0]] == 1
    key = '{app="blockserve",replica="r1"}'
    assert exported[f"blockserve_replica_blocks_spared_total{key}"] == 4
    assert exported[f"blockserve_replica_cached_blocks_evicted_total{key}"] == 9
    assert exported[f"blockserve_replica_admissions_refused_total{key}"] == 0


def test_every_dashboard_query_names_an_exported_metric():
    exported = exported_names(sample_exposition())
    for title, expression in dashboard.queries(dashboard.build()):
        names = dashboard.metric_names(expression)
        assert names, title
        for name in names:
            base = re.sub(r"_total$", "", name)
            assert name in exported or base in exported, f"{title}: {name} is not exported"


def test_dashboard_file_is_generated_and_structurally_sound():
    built = dashboard.build()
    assert json.loads(dashboard.DASHBOARD_PATH.read_text()) == built, \
        "dashboards/blockserve.json is stale: run `python -m blockserve.controller.dashboard build`"
    ids = [p["id"] for p in built["panels"]]
    assert len(ids) == len(set(ids))
    occupied = set()
    for panel in built["panels"]:
        grid = panel["gridPos"]
        assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24 and grid["h"] > 0
        cells = {(grid["x"] + dx, grid["y"] + dy) for dx in range(grid["w"])
                 for dy in range(grid["h"])}
        assert not cells & occupied, f"panel {panel['title']} overlaps another"
        occupied |= cells
    defined = {v["name"] for v in built["templating"]["list"]}
    used = set(re.findall(r"\$(\w+)", json.dumps(built))) - {"__rate_interval"}
    assert used <= defined, used - defined


@contextlib.contextmanager
def running_prometheus(target_port: int):
    """A real Prometheus scraping 127.0.0.1:`target_port` every second, with
    dashboards/prometheus.yml's job; yields its URL once ready."""
    workdir = Path(tempfile.mkdtemp(prefix="bs-prom-"))
    config = Path("dashboards/prometheus.yml").read_text()
    config = config.replace("127.0.0.1:8000", f"127.0.0.1:{target_port}")
    config = config.replace("scrape_interval: 5s", "scrape_interval: 1s")
    (workdir / "prometheus.yml").write_text(config)
    prom_port = free_port()
    process = subprocess.Popen([PROMETHEUS, f"--config.file={workdir / 'prometheus.yml'}",
                                f"--storage.tsdb.path={workdir / 'data'}",
                                f"--web.listen-address=127.0.0.1:{prom_port}"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{prom_port}"
    try:
        wait_until_answers(f"{url}/-/ready", process, timeout_s=30)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=10)
        shutil.rmtree(workdir, ignore_errors=True)


@needs_prometheus
def test_png_check_sees_panels_where_nothing_was_drawn(tmp_path):
    """The check the live test applies to the rendered dashboard fails every panel of a
    render with no data (a Prometheus that scrapes nothing)."""
    with running_prometheus(free_port()) as url:
        dashboard.render(url, str(tmp_path / "empty.png"), "blockserve", minutes=1)
    titles = [p["title"] for p in dashboard.build()["panels"] if p["type"] != "row"]
    assert undrawn_panels(tmp_path / "empty.png") == titles


# --- against the real deployment -----------------------------------------------------------
@pytest.fixture(scope="module")
def prometheus(deployment_session):
    if PROMETHEUS is None:
        pytest.skip("prometheus is not installed")
    with running_prometheus(httpx.URL(deployment_session.base_url).port) as url:
        yield url


@needs_prometheus
@pytest.mark.deployment
def test_live_exposition_passes_promtool(deployment):
    text = httpx.get(f"{deployment.base_url}/metrics", timeout=10).text
    result = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def variable_values(prometheus: str, name: str, app: str | None = None) -> list[str]:
    """A dashboard variable's values as Grafana resolves its `label_values(metric{sel},
    label)` query: Prometheus's label-values API, matching the variable's own selector."""
    [variable] = [v for v in dashboard.build()["templating"]["list"] if v["name"] == name]
    match = re.fullmatch(r"label_values\((.+), (\w+)\)", variable["query"]["query"])
    assert match, variable["query"]
    selector, label = match.group(1).replace("$app", app or ""), match.group(2)
    result = httpx.get(f"{prometheus}/api/v1/label/{label}/values",
                       params={"match[]": selector}, timeout=10).json()
    assert result["status"] == "success", result
    return sorted(result["data"])


def panel_results(prometheus: str, app: str, replica: str,
                  rate_window: str = "1m") -> dict[tuple[str, str], list]:
    """Every panel query with $app and $replica as Grafana substitutes them (a
    multi-value variable becomes a regex alternation), evaluated now."""
    results = {}
    for title, expression in dashboard.queries(dashboard.build()):
        query = dashboard.substitute(expression.replace("$replica", replica), app, rate_window)
        result = httpx.get(f"{prometheus}/api/v1/query", params={"query": query},
                           timeout=10).json()
        assert result["status"] == "success", (title, query, result)
        results[(title, query)] = result["data"]["result"]
    return results


def problems(results: dict, replicas: set[str]) -> list[str]:
    """Panels with no series, with a series that is not a finite number (NaN from 0/0
    or an empty histogram is not data), or with a replica outside the filter."""
    found = []
    for (title, query), series in results.items():
        if not series:
            found.append(f"{title}: no series ({query})")
        for one in series:
            value = float(one["value"][1])
            if not math.isfinite(value):
                found.append(f"{title}: {one['metric']} = {value} ({query})")
            replica = one["metric"].get("replica")
            if replica is not None and replica not in replicas:
                found.append(f"{title}: replica {replica} passed the filter {replicas}")
    return found


PANEL_GRID = (3, 1440, 256)  # dashboard.render: 3 columns, 6 x 3.2 inch panels at 80 dpi


def undrawn_panels(png_path) -> list[str]:
    """Decode the PNG and find the panels in which nothing was drawn: every series is
    drawn in colour (lines, stacked areas, the heatmap), axes and text in greys."""
    import numpy as np
    from matplotlib import image

    pixels = image.imread(png_path)[..., :3]
    columns, width, panel_height = PANEL_GRID
    titles = [p["title"] for p in dashboard.build()["panels"] if p["type"] != "row"]
    rows = -(-len(titles) // columns)
    assert pixels.shape[:2] == (rows * panel_height, width), pixels.shape
    coloured = (pixels.max(axis=2) - pixels.min(axis=2)) > 0.25
    empty = []
    for i, title in enumerate(titles):
        row, column = divmod(i, columns)
        cell = coloured[row * panel_height:(row + 1) * panel_height,
                        column * width // columns:(column + 1) * width // columns]
        if np.count_nonzero(cell) < 100:
            empty.append(title)
    return empty


@needs_prometheus
@pytest.mark.deployment
def test_prometheus_scrapes_the_deployment_and_every_panel_has_data(deployment, prometheus,
                                                                    tmp_path):
    """Grafana's view, without Grafana: the variables resolve through their own queries,
    and every panel, for all replicas and for each replica alone, has finite values and
    only the replicas its filter selects."""
    client = openai.AsyncOpenAI(base_url=f"{deployment.base_url}/v1", api_key=deployment.api_key,
                                max_retries=0, timeout=120)
    shared = "You are a helpful assistant. " * 12
    decisions = {r: deployment.metric_sum("blockserve_decisions_total", replica=r)
                 for r in deployment.metrics_replicas()}

    async def load():
        async def one(i):
            stream = await client.chat.completions.create(
                model=SHAPE.model_name, max_tokens=48, stream=True,
                messages=[{"role": "system", "content": shared},
                          {"role": "user", "content": f"question {i} " * (5 + i % 20)}],
                extra_body={"ignore_eos": True})
            async for _ in stream:
                pass

        async with client:
            for wave in range(2):  # each wave needs more blocks than one replica has
                await asyncio.gather(*(one(wave * 40 + i) for i in range(40)))

    # Counters must be scraped before the load too, or every rate over it is 0 (NaN).
    deadline = time.time() + 30
    while not httpx.get(f"{prometheus}/api/v1/query", timeout=10, params={
            "query": "blockserve_replica_kv_blocks_capacity"}).json()["data"]["result"]:
        assert time.time() < deadline, "prometheus never scraped the deployment"
        time.sleep(0.2)
    # One rejection, so the rejections panel has a series.
    assert deployment.post("/v1/chat/completions", json=TOO_MANY_BLOCKS).status_code == 400
    load_started = time.time()
    asyncio.run(load())
    replicas = set(decisions)
    assert all(deployment.metric_sum("blockserve_decisions_total", replica=r) > before
               for r, before in decisions.items()), "a replica got no traffic"

    # Rates need two scrapes of a series inside their window: give Prometheus a few. The
    # window spans the whole load, as a dashboard over it would: placement may have sent a
    # replica its last request well before the load ended (CI once saw 0/0 over 1m).
    deadline = time.time() + 30
    while True:
        window = f"{math.ceil(time.time() - load_started) + 10}s"
        apps = variable_values(prometheus, "app")
        found = [] if apps == ["blockserve"] else [f"app variable: {apps}"]
        if not found:
            resolved = variable_values(prometheus, "replica", "blockserve")
            if set(resolved) != replicas:
                found = [f"replica variable: {resolved}, the router has {replicas}"]
        if not found:
            every = "|".join(re.escape(r) for r in sorted(replicas))  # "All" selected
            found = problems(panel_results(prometheus, "blockserve", every, window), replicas)
            for replica in sorted(replicas):
                found += problems(panel_results(prometheus, "blockserve", re.escape(replica),
                                                window), {replica})
        if not found or time.time() > deadline:
            break
        time.sleep(1)
    assert not found, "\n".join(found)
    png = tmp_path / "dashboard.png"
    dashboard.render(prometheus, str(png), "blockserve", minutes=2)
    assert not undrawn_panels(png), undrawn_panels(png)


@pytest.mark.deployment
def test_the_deployed_block_policies_show_in_admin_state_and_metrics(deployment):
    """deploy.yaml's block policies (issue 18): /admin/state and the metrics name them for
    every replica, its engine installed them, and under cache pressure the eviction policy
    acts: blocks of a prefix many requests hit are spared, counted alike in both views."""
    from blockserve.protocol.config import parse_app_config
    from blockserve.protocol.snapshot import BLOCK_POLICY_KINDS
    from blockserve.tools.launch import load_config

    scheduler = parse_app_config(load_config()["applications"][0]["args"]).replica.scheduler
    chosen = {kind: getattr(scheduler, f"block_{kind}").cls for kind in BLOCK_POLICY_KINDS}
    assert chosen["eviction"] != "vllm", "deploy.yaml chooses no eviction policy to see"
    replicas = deployment.get("/admin/state").json()["replicas"]
    for replica in replicas:
        reported = replica["block_policies"]
        assert {kind: reported[kind] for kind in chosen} == chosen and reported["installed"]
        labels = {"app": "blockserve", "replica": replica["replica_id"], **chosen}
        info = "blockserve_replica_block_policies_info{" + ",".join(
            f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"
        assert deployment.metrics().get(info) == 1, info
    spared_before = sum(r["block_policies"]["blocks_spared"] for r in replicas)

    rng = random.Random(19)  # token ids within the tiny model's 4096
    shared = [rng.randrange(100, 4000) for _ in range(320)]  # 10 blocks of 32 tokens

    def complete(prompt):
        response = deployment.post("/v1/completions", json={
            "model": SHAPE.model_name, "prompt": prompt, "max_tokens": 1})
        assert response.status_code == 200, response.text

    for i in range(4):  # the shared prefix is hit three times: protected from eviction
        complete(shared + [rng.randrange(100, 4000) for _ in range(5)])
    # Then distinct prompts of 700 tokens, ~1.6x both caches: the protected blocks reach
    # the front of the free queue, where the eviction policy spares them.
    count = math.ceil(1.6 * 2 * SHAPE.usable_blocks * SHAPE.block_size / 700)  # 24 here
    distinct = [[rng.randrange(100, 4000) for _ in range(700)] for _ in range(count)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(complete, distinct))
    deadline = time.time() + 30
    while True:
        replicas = deployment.get("/admin/state").json()["replicas"]
        spared = sum(r["block_policies"]["blocks_spared"] for r in replicas)
        exported = deployment.metric_sum("blockserve_replica_blocks_spared_total")
        if spared > spared_before and exported == spared or time.time() > deadline:
            break
        time.sleep(0.5)
    assert spared > spared_before, [r["block_policies"] for r in replicas]
    assert exported == spared
    assert sum(r["block_policies"]["cached_blocks_evicted"] for r in replicas) > 0
