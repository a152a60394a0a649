"""Routers SIGKILLed one after another under streamed load, with HAProxy's own account.

    flock /tmp/blockserve-heavy.lock python -m blockserve.bench.router_kill [--kills 10]

deploy.yaml with two routers (`serve run`, as `make serve`). Each kill: once both routers
report, a burst of streams (`load_and_fault`, as the router-kill test sends it), and the
router with the most requests in flight gets SIGKILL; Serve starts its replacement
before the next kill. Every request's outcome is classified from the client (the real
openai client, no retries of its own): one lost before a response (no status, no
headers) is what HAProxy should have sent again; a stream the dead router had started
is cut, which no one can re-send. HAProxy's access log (syslog over UDP, Serve's
RAY_SERVE_HAPROXY_LOG_TARGET) gives each request's termination state and retries, so a
loss is seen from both sides. The JSON in docs/results/ holds the counts per kill.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import re
import signal
import socket
import threading
import time
from pathlib import Path

import httpx

from blockserve.bench.engine_kill import RESULTS, load_and_fault, wait_for
from blockserve.bench.targets import API_KEY
from blockserve.tools.launch import load_config, replica_count, serve_run

ROUTERS = 2
# HAProxy's httplog line: ... termination state, then actconn/feconn/beconn/srv_conn/retries
# (retries prefixed with '+' when the request was redispatched to another server).
ACCESS = re.compile(r'http_frontend \S+ \S+ (-?\d+) \S+ - - (\S{4}) \S+/\S+/\S+/\S+/(\+?\d+)'
                    r' .*"POST ')


class SyslogListener:
    """HAProxy's log lines, received on a UDP port of this process."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.lines: list[str] = []
        threading.Thread(target=self._receive, daemon=True).start()

    def _receive(self) -> None:
        while True:
            self.lines.append(self.sock.recv(65535).decode(errors="replace"))


def routers(base_url: str) -> dict[str, dict]:
    state = httpx.get(f"{base_url}/admin/state", timeout=10,
                      headers={"Authorization": f"Bearer {API_KEY}"}).json()
    return {r["router"]: r for r in state["routers"]}


def haproxy_account(lines: list[str]) -> dict[str, int]:
    """Completions in HAProxy's log: by status and termination state, and redispatched."""
    counts: collections.Counter[str] = collections.Counter()
    for line in lines:
        if match := ACCESS.search(line):
            status, state, retries = match.groups()
            counts[f"{status} {state}"] += 1
            counts["redispatched"] += retries.startswith("+")
    return dict(counts)


def one_kill(base_url: str, log: SyslogListener) -> dict:
    both = wait_for(lambda: len(routers(base_url)) == ROUTERS, 120, 0.5)
    assert both, f"{ROUTERS} routers did not report within 120 s"
    time.sleep(3.0)  # the replacement's first reports reach the other router

    def kill_busiest_router() -> dict:
        name, victim = max(routers(base_url).items(),
                           key=lambda item: item[1]["in_flight_requests"])
        os.kill(victim["pid"], signal.SIGKILL)
        return {"router": name, "in_flight": victim["in_flight_requests"]}

    def a_router_is_busy() -> bool:
        return max(r["in_flight_requests"] for r in routers(base_url).values()) >= 6

    mark = len(log.lines)
    fault_at, info, outcomes, probes = asyncio.run(load_and_fault(
        base_url, kill_busiest_router, burst=24, max_tokens=96, probes=10, fault_by_s=1.5,
        loaded=a_router_is_busy))
    time.sleep(1.0)  # the last log lines
    everything = outcomes + probes
    lost = [o for o in everything if o.kind != "completed" and not o.answered]
    return {**info, "requests": len(everything),
            "outcomes": dict(collections.Counter(o.kind for o in everything)),
            "lost_before_a_response": len(lost),
            "lost": [{"kind": o.kind, "sent_after_kill_s": round(o.sent_at - fault_at, 3),
                      "error": o.error or o.status} for o in lost],
            "started_and_cut": sum(o.answered and o.kind != "completed" for o in everything),
            "haproxy_log": haproxy_account(log.lines[mark:])}


def totals(kills: list[dict]) -> dict:
    """All kills' counts, summed from `one_kill`'s records."""
    return {
        "kills": len(kills),
        "requests": sum(k["requests"] for k in kills),
        "in_flight_at_kill": [k["in_flight"] for k in kills],
        "lost_before_a_response": sum(k["lost_before_a_response"] for k in kills),
        "started_and_cut": sum(k["started_and_cut"] for k in kills),
        "haproxy_log": dict(sum((collections.Counter(k["haproxy_log"]) for k in kills),
                                collections.Counter())),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--haproxy", default=None,
                        help="the HAProxy binary or wrapper Serve starts (default: "
                             "deploy/serve.env's, deploy/haproxy)")
    parser.add_argument("--out", type=Path, default=RESULTS / "router_kill.json")
    args = parser.parse_args()
    config = load_config()
    [router] = [d for d in config["applications"][0]["deployments"] if d["name"] == "Router"]
    router["num_replicas"] = ROUTERS
    log = SyslogListener()
    started = time.time()
    env = {"BLOCKSERVE_API_KEY": API_KEY, "RAY_SERVE_HAPROXY_LOG_TARGET": f"127.0.0.1:{log.port}"}
    if args.haproxy:
        env["RAY_SERVE_HAPROXY_BINARY_PATH"] = str(Path(args.haproxy).resolve())
    with serve_run(config, expected_replicas=replica_count(config), env=env) as run:
        kills = []
        for k in range(args.kills):
            kills.append(one_kill(run.base_url, log))
            print(json.dumps({"kill": k, **kills[-1]}), flush=True)
    result = {
        "what": "routers SIGKILLed one at a time under streamed load, 2 routers behind "
                "Serve's HAProxy (see 'haproxy'); outcomes from the openai client "
                "(max_retries=0), termination states from HAProxy's access log",
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(started)),
        "command": f"python -m blockserve.bench.router_kill --kills {args.kills}"
                   + (f" --haproxy {args.haproxy}" if args.haproxy else ""),
        "haproxy": args.haproxy or "deploy/haproxy",
        **totals(kills),
        "per_kill": kills,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "per_kill"}, indent=1))


if __name__ == "__main__":
    main()
