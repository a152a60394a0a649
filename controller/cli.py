"""`blockserve status`: the cluster's state at a terminal (replicas, then each router); `blockserve check`: a
Serve config checked without deploying it (tools/check.py).

    blockserve status [--url http://127.0.0.1:8000] [--api-key KEY] [--watch SECONDS]
    blockserve check CONFIG [--model-dir DIR]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import httpx


# A replica's `blocks` in /admin/state (protocol/blocks.py's words), and column widths.
COLUMNS = {"held": 6, "cached": 8, "empty": 7, "growth": 8, "waiting": 9, "reserved": 10,
           "available": 11, "total": 7}


def render(state: dict) -> str:
    policies = state["policies"]
    lines = [
        f"placement: {policies['placement']['cls']}   "
        f"queue order: {policies['queue_order']['cls']}",
        f"queue: {state['queue']['requests']} requests, {state['queue']['blocks']} blocks",
        "",
        f"{'replica':<12}" + "".join(f"{key:>{width}}" for key, width in COLUMNS.items())
        + f"{'run':>5}{'wait':>6}{'preempt':>9}{'in-flt':>7}{'age s':>7}",
    ]
    for replica in state["replicas"]:
        snap, blocks = replica["snapshot"], replica["blocks"]
        lines.append(
            f"{replica['replica_id']:<12}"
            + "".join(f"{blocks[key]:>{width}}" for key, width in COLUMNS.items())
            + f"{snap['running']:>5}{snap['waiting']:>6}{snap['preemptions_total']:>9}"
            f"{replica['in_flight_requests']:>7}{replica['heard_from_s_ago']:>7.2f}")
    if not state["replicas"]:
        lines.append("(no replica has reported yet)")
    routers = state.get("routers", [])
    if routers:  # what each router holds of its own (docs/routers.md)
        lines += ["", f"{'router':<12}{'pid':>8}{'queued':>8}{'in-flt':>8}{'reserved':>10}"
                  f"{'switch':>8}  placement"]
        lines += [f"{r['router']:<12}{r['pid']:>8}{r['queue']['requests']:>8}"
                  f"{r['in_flight_requests']:>8}{r['reserved_blocks']:>10}"
                  f"{r['policies_version']:>8}  {r['policies']['placement']['cls']}"
                  for r in routers]
    lines += ["", "held + cached + empty = total; growth, waiting: what the replica's work "
              "will still take; reserved: the router's reservations; available: what "
              "placement may still give out (protocol/blocks.py); run, wait: requests"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="blockserve")
    commands = parser.add_subparsers(dest="command", required=True)
    status = commands.add_parser("status", help="show replicas, blocks, queue and policies")
    status.add_argument("--url", default=os.environ.get("BLOCKSERVE_URL", "http://127.0.0.1:8000"))
    status.add_argument("--api-key", default=os.environ.get("BLOCKSERVE_API_KEY"))
    status.add_argument("--watch", type=float, default=0, metavar="SECONDS")
    check = commands.add_parser("check", help="validate a Serve config and run its policies "
                                "engine-less, without deploying")
    check.add_argument("config", help="a Serve config file, e.g. deploy/deploy.yaml")
    check.add_argument("--model-dir", help="a local model for the engine-less run (default: "
                       "the config's model if local, else the tiny model)")
    args = parser.parse_args(argv)
    if args.command == "check":
        from blockserve.tools import check as checker  # vLLM: only for this command

        return checker.main(args.config, args.model_dir)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    while True:
        try:
            response = httpx.get(f"{args.url}/admin/state", headers=headers, timeout=10)
            response.raise_for_status()
        except httpx.HTTPError as exc:
            print(f"cannot read {args.url}/admin/state: {exc}", file=sys.stderr)
            return 1
        output = render(response.json())
        print(("\033[2J\033[H" if args.watch else "") + output, flush=True)
        if not args.watch:
            return 0
        time.sleep(args.watch)


if __name__ == "__main__":
    sys.exit(main())
