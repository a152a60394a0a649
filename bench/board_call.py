"""What one call from a router to another Serve deployment costs: the price of anything the
routers would share on a request's path (issue 28).

    flock /tmp/blockserve-heavy.lock python -m blockserve.bench.board_call --calls 2000 \
        --out docs/results/board_call

The routers share only the router board (router/board.py), and never on a request's path.
A router tier that shared its grants, so that no two routers grant the same blocks (the
`--shared-grants` oracle of bench/routers_sim.py), would have to ask such a service before
every admission: at least one round trip. This serves the real `RouterBoard` and a caller
deployment, as a router is one, on a private Ray instance (no HTTP proxy: nothing but the
handles is timed), and times `--calls` sequential `board.read` calls through the caller's
deployment handle, as router/peers.py makes them.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path

import ray
from ray import serve

from blockserve.bench.provenance import announce
from blockserve.bench.report import percentile
from blockserve.router.board import RouterBoard

WARM_UP_CALLS = 200


@serve.deployment(num_replicas=1)
class Caller:
    """A router's stand-in, holding a handle to the board as a router does."""

    def __init__(self, board) -> None:
        self.board = board

    async def __call__(self, calls: int) -> list[float]:
        """`calls` board reads one after another: each one's seconds."""
        seconds = []
        for _ in range(calls):
            started = time.perf_counter()
            await self.board.read.remote(1.0)
            seconds.append(time.perf_counter() - started)
        return seconds


def timed_calls(calls: int) -> list[float]:
    """Deploys the board and the caller on a private Ray instance, warms up, times `calls`
    board reads; stops everything."""
    with tempfile.TemporaryDirectory(prefix="bs-", dir="/tmp") as workdir:
        ray.init(num_cpus=2, include_dashboard=False, _temp_dir=workdir)
        try:
            serve.start(proxy_location="Disabled")
            board = serve.deployment(RouterBoard, name="RouterBoard", num_replicas=1).bind()
            caller = serve.run(Caller.bind(board), name="board_call", route_prefix=None)
            caller.remote(WARM_UP_CALLS).result()
            return caller.remote(calls).result()
        finally:
            serve.shutdown()
            ray.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--out", default="docs/results/board_call")
    args = parser.parse_args()
    provenance = announce("board_call")
    seconds = timed_calls(args.calls)
    figures = {f"round_trip_p{q}_ms": percentile(seconds, q / 100) * 1e3 for q in (50, 90, 99)}
    print(", ".join(f"{k} {v:.3f}" for k, v in figures.items()))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(f"{args.out}.json").write_text(json.dumps({
        "command": "python -m blockserve.bench.board_call " + shlex.join(sys.argv[1:]),
        **provenance, "calls": len(seconds), "warm_up_calls": WARM_UP_CALLS, **figures,
        "round_trip_mean_ms": sum(seconds) / len(seconds) * 1e3}, indent=1))
    print(f"wrote {args.out}.json")


if __name__ == "__main__":
    main()
