"""Metrics and the dashboard: promtool-clean expositions, a dashboard whose every query
names an exported metric, and (with the deployment) a real Prometheus that scrapes it."""

import asyncio
import json
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import openai
import pytest

from controller import dashboard
from replica.snapshot import BlockSnapshot
from router.admission import AdmissionQueue
from router.ledger import Ledger
from router.metrics import RouterMetrics
from router.ordering import FirstComeFirstServed
from router.placement import BestFitBlocks
from controller.launch import free_port

PROMTOOL = shutil.which("promtool")
PROMETHEUS = shutil.which("prometheus")
needs_prometheus = pytest.mark.skipif(
    PROMETHEUS is None or PROMTOOL is None,
    reason="Debian's prometheus package is not installed (make test installs it)")


def sample_exposition() -> str:
    """The router's exposition with one replica reporting, built from the real classes."""
    ledger = Ledger()
    ledger.report("r1", BlockSnapshot(timestamp=time.time(), total_blocks=160, block_size=32,
                                      free_blocks=100, cached_blocks=20, held_blocks=60,
                                      reserved_blocks=10, running=3, waiting=1),
                  {"vllm_prefix_cache_queries_total": 100, "vllm_prefix_cache_hits_total": 40,
                   "vllm_itl_buckets": [1] * 15, "vllm_itl_sum": 3.0,
                   "vllm_ttft_buckets": [2] * 15, "vllm_ttft_sum": 5.0})
    ledger.reserve("r1", 7)
    queue = AdmissionQueue(ledger, BestFitBlocks(), FirstComeFirstServed(), max_requests=1,
                           max_tokens=1, timeout_s=1)
    metrics = RouterMetrics("blockserve", "BestFitBlocks", queue)
    metrics.admitted("r1", 0.2)
    metrics.rejected("too_large")
    metrics.ttft.labels("blockserve").observe(0.3)
    metrics.e2e.labels("blockserve", "200").observe(1.0)
    return metrics.exposition().decode()


def exported_names(exposition: str) -> set[str]:
    return {m.group(1) for m in re.finditer(r"^# TYPE (\S+) ", exposition, re.MULTILINE)}


@needs_prometheus
def test_router_exposition_passes_promtool():
    result = subprocess.run([PROMTOOL, "check", "metrics"], input=sample_exposition(),
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_block_states_sum_to_capacity():
    samples = [line for line in sample_exposition().splitlines()
               if line.startswith("blockserve_replica_kv_blocks{")]
    assert sum(float(line.rsplit(" ", 1)[1]) for line in samples) == 160


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
        "dashboards/blockserve.json is stale: run `python -m controller.dashboard build`"
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


# --- against the real deployment -----------------------------------------------------------
@pytest.fixture(scope="module")
def prometheus(deployment_session):
    deployment = deployment_session
    if PROMETHEUS is None:
        pytest.skip("prometheus is not installed")
    workdir = Path(tempfile.mkdtemp(prefix="bs-prom-"))
    port = httpx.URL(deployment.base_url).port
    config = Path("dashboards/prometheus.yml").read_text()
    config = config.replace("127.0.0.1:8000", f"127.0.0.1:{port}")
    config = config.replace("scrape_interval: 5s", "scrape_interval: 1s")
    (workdir / "prometheus.yml").write_text(config)
    prom_port = free_port()
    process = subprocess.Popen([PROMETHEUS, f"--config.file={workdir / 'prometheus.yml'}",
                                f"--storage.tsdb.path={workdir / 'data'}",
                                f"--web.listen-address=127.0.0.1:{prom_port}"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{prom_port}"
    try:
        for _ in range(100):
            try:
                if httpx.get(f"{url}/-/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=10)
        shutil.rmtree(workdir, ignore_errors=True)


@needs_prometheus
@pytest.mark.deployment
def test_live_exposition_passes_promtool(deployment):
    text = httpx.get(f"{deployment.base_url}/metrics", timeout=10).text
    result = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@needs_prometheus
@pytest.mark.deployment
def test_prometheus_scrapes_the_deployment_and_every_panel_has_data(deployment, prometheus,
                                                                    tmp_path):
    client = openai.AsyncOpenAI(base_url=f"{deployment.base_url}/v1", api_key=deployment.api_key,
                                max_retries=0, timeout=120)
    shared = "You are a helpful assistant. " * 12

    async def load():
        async def one(i):
            stream = await client.chat.completions.create(
                model="tiny-llama", max_tokens=48, stream=True,
                messages=[{"role": "system", "content": shared},
                          {"role": "user", "content": f"question {i} " * (5 + i % 20)}],
                extra_body={"ignore_eos": True})
            async for _ in stream:
                pass

        for wave in range(3):
            await asyncio.gather(*(one(wave * 24 + i) for i in range(24)))

    # One rejection, so the rejections panel has a series.
    assert deployment.post("/v1/chat/completions", json={
        "model": "tiny-llama", "n": 12, "max_tokens": 900,
        "messages": [{"role": "user", "content": "x"}]}).status_code == 400
    asyncio.run(load())

    def panels_without_data() -> list[tuple[str, str]]:
        empty = []
        for title, expression in dashboard.queries(dashboard.build()):
            query = dashboard.substitute(expression, "blockserve")
            result = httpx.get(f"{prometheus}/api/v1/query", params={"query": query},
                               timeout=10).json()
            assert result["status"] == "success", (title, query, result)
            if not result["data"]["result"]:
                empty.append((title, query))
        return empty

    # Rates need two scrapes of a series inside their window: give Prometheus a few.
    deadline = time.time() + 30
    while (empty := panels_without_data()) and time.time() < deadline:
        time.sleep(1)
    assert not empty, f"panels without data: {empty}"
    png = tmp_path / "dashboard.png"
    dashboard.render(prometheus, str(png), "blockserve", minutes=2)
    assert png.stat().st_size > 20_000
