"""`blockserve status`: the router's cluster state at a terminal.

    blockserve status [--url http://127.0.0.1:8000] [--api-key KEY] [--watch SECONDS]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import httpx


def render(state: dict) -> str:
    policies = state["policies"]
    lines = [
        f"placement: {policies['placement']['cls']}   "
        f"queue order: {policies['queue_order']['cls']}",
        f"queue: {state['queue']['requests']} requests, {state['queue']['blocks']} blocks",
        "",
        f"{'replica':<12}{'held':>6}{'cached':>8}{'reserved':>10}{'free':>6}{'total':>7}"
        f"{'run':>5}{'wait':>6}{'preempt':>9}{'ledger':>8}{'in-flt':>7}{'age s':>7}",
    ]
    for replica in state["replicas"]:
        snap = replica["snapshot"]
        empty = snap["free_blocks"] - snap["cached_blocks"]
        lines.append(
            f"{replica['replica_id']:<12}{snap['held_blocks']:>6}{snap['cached_blocks']:>8}"
            f"{snap['reserved_blocks']:>10}{empty:>6}{snap['total_blocks']:>7}"
            f"{snap['running']:>5}{snap['waiting']:>6}{snap['preemptions_total']:>9}"
            f"{replica['reserved_blocks']:>8}{replica['in_flight_requests']:>7}"
            f"{replica['heard_from_s_ago']:>7.2f}")
    if not state["replicas"]:
        lines.append("(no replica has reported yet)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="blockserve")
    commands = parser.add_subparsers(dest="command", required=True)
    status = commands.add_parser("status", help="show replicas, blocks, queue and policies")
    status.add_argument("--url", default=os.environ.get("BLOCKSERVE_URL", "http://127.0.0.1:8000"))
    status.add_argument("--api-key", default=os.environ.get("BLOCKSERVE_API_KEY"))
    status.add_argument("--watch", type=float, default=0, metavar="SECONDS")
    args = parser.parse_args(argv)
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
