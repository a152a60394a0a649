"""What one call from a router to another Serve deployment costs: the price of anything the
routers would share on a request's path (issue 28).

    flock /tmp/blockserve-heavy.lock python -m blockserve.bench.board_call --calls 2000 \
        --out docs/results/board_call

The routers share only the router board (router/board.py), and never on a request's path.
A router tier that shared its grants, so that no two routers grant the same blocks (the
`--shared-grants` oracle of bench/routers_sim.py), would have to ask such a service before
every admission: at least one round trip. This serves the real `RouterBoard` and a caller
deployment, as a router is one, with `serve run` on a private Ray instance, and times
`--calls` sequential `board.read` calls through the caller's deployment handle, as
router/peers.py makes them.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
import urllib.request
from pathlib import Path

from ray import serve
from starlette.requests import Request

from blockserve.bench.provenance import announce
from blockserve.bench.report import percentile
from blockserve.router.board import RouterBoard
from blockserve.tools.launch import serve_run

CONFIG = {"applications": [{"name": "board_call", "route_prefix": "/",
                            "import_path": "blockserve.bench.board_call:build_app"}]}
WARM_UP_CALLS = 200


@serve.deployment(num_replicas=1)
class Caller:
    """A router's stand-in: `GET /?calls=N` makes N board calls one after another and
    returns each one's seconds."""

    def __init__(self, board) -> None:
        self.board = board

    async def __call__(self, request: Request) -> list[float]:
        seconds = []
        for _ in range(int(request.query_params["calls"])):
            started = time.perf_counter()
            await self.board.read.remote(1.0)
            seconds.append(time.perf_counter() - started)
        return seconds


def build_app(args: dict | None = None):
    board = serve.deployment(RouterBoard, name="RouterBoard", num_replicas=1).bind()
    return Caller.bind(board)


def timed_calls(base_url: str, calls: int) -> list[float]:
    with urllib.request.urlopen(f"{base_url}/?calls={calls}", timeout=600) as response:
        return json.loads(response.read())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--out", default="docs/results/board_call")
    args = parser.parse_args()
    provenance = announce("board_call")
    with serve_run(CONFIG, expected_replicas=None) as run:
        timed_calls(run.base_url, WARM_UP_CALLS)
        seconds = timed_calls(run.base_url, args.calls)
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
