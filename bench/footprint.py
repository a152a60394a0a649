"""Start-up time to the first answer, and the memory of the whole application.

    python -m blockserve.bench.footprint

Runs `serve run deploy/deploy.yaml` (private Ray instance), times it from launch to the
first chat completion answered, and sums the proportional set size (PSS) of every process
it started (Ray, Serve, the router, both replicas and their vLLM engines).
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import psutil

from blockserve.bench.targets import API_KEY
from blockserve.tools.launch import app_config, load_config, replica_count, serve_run


def tree_pss_mb(root_pid: int) -> tuple[float, int]:
    """PSS of `serve run` and every process it started (Ray, Serve, the router, the
    replicas, their vLLM engines, HAProxy). The deployment runs in the caller's session
    (tools/launch.py), so its processes are found by ancestry, not by session."""
    root = psutil.Process(root_pid)
    total_kb, count = 0, 0
    for proc in [root, *root.children(recursive=True)]:
        try:
            for line in Path(f"/proc/{proc.pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total_kb += int(line.split()[1])
                    count += 1
        except (OSError, ProcessLookupError):
            continue
    return total_kb / 1024, count


def main() -> None:
    launched = time.time()
    config = load_config()
    with serve_run(config, expected_replicas=replica_count(config),
                   env={"BLOCKSERVE_API_KEY": API_KEY}) as run:
        response = httpx.post(f"{run.base_url}/v1/chat/completions", timeout=60,
                              headers={"Authorization": f"Bearer {API_KEY}"},
                              json={"model": app_config(config).replica.model_name,
                                    "max_tokens": 8,
                                    "messages": [{"role": "user", "content": "hello"}]})
        response.raise_for_status()
        first_answer_s = time.time() - launched
        pss_mb, processes = tree_pss_mb(run.process.pid)
    print(f"start-up to first answer: {first_answer_s:.1f}s "
          f"(healthy with both replicas reporting at {run.startup_s:.1f}s)")
    print(f"memory of the whole application: {pss_mb / 1024:.2f} GiB PSS "
          f"over {processes} processes")


if __name__ == "__main__":
    main()
