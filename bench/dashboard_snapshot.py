"""A real picture of the dashboard: deployment + Prometheus + load, rendered to PNG.

    python -m blockserve.bench.dashboard_snapshot [--out docs/dashboard.png]

Starts `serve run deploy/deploy.yaml` and Debian's Prometheus with the shipped scrape
config (1 s scrapes), replays two pressure bursts and a shared-prefix wave, then draws
every dashboard panel from Prometheus with `controller.dashboard.render`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from blockserve.bench.client import replay
from blockserve.bench.targets import API_KEY
from blockserve.bench.workloads import pressure, shared_prefix
from blockserve.controller.dashboard import render
from blockserve.tools.launch import (app_config, free_port, load_config, replica_count, serve_run,
                                      stop)


@contextlib.contextmanager
def prometheus(target_port: int):
    workdir = Path(tempfile.mkdtemp(prefix="bs-prom-"))
    config = Path("dashboards/prometheus.yml").read_text()
    config = config.replace("127.0.0.1:8000", f"127.0.0.1:{target_port}")
    (workdir / "prometheus.yml").write_text(config.replace("scrape_interval: 5s",
                                                           "scrape_interval: 1s"))
    port = free_port()
    process = subprocess.Popen(
        [shutil.which("prometheus"), f"--config.file={workdir / 'prometheus.yml'}",
         f"--storage.tsdb.path={workdir / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(process, timeout_s=10)
        shutil.rmtree(workdir, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/dashboard.png")
    args = parser.parse_args()
    config = load_config()
    model = app_config(config).replica.model_name
    with serve_run(config, expected_replicas=replica_count(config),
                   env={"BLOCKSERVE_API_KEY": API_KEY}) as run:
        with prometheus(httpx.URL(run.base_url).port) as prom:
            started = time.time()
            for specs in (pressure(n=64, seed=1), shared_prefix(n=64, seed=2),
                          pressure(n=64, seed=3)):
                asyncio.run(replay(specs, [run.base_url], API_KEY, model))
                time.sleep(5)
            render(prom, args.out, "blockserve", minutes=(time.time() - started) / 60 + 0.5)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
