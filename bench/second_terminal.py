"""A load client from a second terminal, run in the deployment's own session.

Linux's autogroup scheduler (kernel.sched_autogroup_enabled, on by default) shares the
CPUs between sessions, each terminal being one, before it shares them between the
processes of a session. In the deployment's own session the client runs at nice 0 and
Ray's workers (router, replicas, engines) at nice 15, so the client is served first and
reads every token when it comes; from another terminal it is one session against
another, and on a small machine the figures drop (issue 30: 293-355 tok/s against
1,063-1,153 from the deployment's session). Changing autogroup
nice values was tried but not measured cleanly (docs/benchmarks.md says why).

So `make serve` opens a door into its session (a Unix socket only its user can use), and

    make client [CLIENT='vllm bench serve ...']          # by default bench/replay.py
    python -m blockserve.bench.second_terminal -- COMMAND ...

from any terminal runs COMMAND through it: as a child of the door, in the deployment's
session, with this terminal's stdin, stdout and stderr (passed over the socket) and its
exit status; Ctrl-C here ends it there. Measured (docs/results/second_terminal_alone.json):
0.89x the same-session throughput through the door (one seed equal, one 0.77x), 0.25x
from a plain second terminal; `make serve`'s own terminal is still where to benchmark
from.

    python -m blockserve.bench.second_terminal --measure --out docs/results/second_terminal

checks it: one deployment (deploy.yaml) and the same replay (bench/replay.py) from its own
session, from another session as a second terminal runs it, and from another session
through the door; A B C C B A order, so a slow spell of the machine does not land on one
placement.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

DOOR = Path(os.environ.get("BLOCKSERVE_DOOR") or f"/tmp/blockserve-door-{os.getuid()}.sock")
REPLAY = [sys.executable, "-m", "blockserve.bench.replay"]
SELF = [sys.executable, "-m", "blockserve.bench.second_terminal"]
SUMMARY_KEYS = ("output_tokens_per_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "ok",
                "errors")


def _serve_one(conn: socket.socket) -> None:
    """Run one command sent through the door: JSON (argv, cwd, env) and three fds."""
    with conn:
        message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        while not message.endswith(b"\n"):
            message += conn.recv(1 << 20)
        request = json.loads(message)
        try:
            child = subprocess.Popen(request["argv"], cwd=request["cwd"],
                                     env=request["env"], stdin=fds[0], stdout=fds[1],
                                     stderr=fds[2])
        except OSError as exc:
            os.write(fds[2], f"cannot run {request['argv'][0]}: {exc}\n".encode())
            conn.sendall(b"127")
            return
        finally:
            for fd in fds:
                os.close(fd)

        def end_when_caller_leaves() -> None:
            if not conn.recv(1):  # the caller hung up (Ctrl-C in its terminal)
                child.terminate()

        threading.Thread(target=end_when_caller_leaves, daemon=True).start()
        with contextlib.suppress(OSError):
            conn.sendall(str(child.wait()).encode())


def open_door(path: Path = DOOR, owner: int | None = None) -> None:
    """Serve the door until process `owner` (default: the parent, `serve run` under
    `make serve`) exits."""
    owner = os.getppid() if owner is None else owner
    path.unlink(missing_ok=True)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as door:
        door.bind(str(path))
        path.chmod(0o600)
        door.listen()
        door.settimeout(1.0)
        try:
            while psutil.pid_exists(owner):
                try:
                    conn, _ = door.accept()
                except TimeoutError:
                    continue
                conn.settimeout(None)
                threading.Thread(target=_serve_one, args=(conn,), daemon=True).start()
        finally:
            path.unlink(missing_ok=True)


def through_door(command: list[str], path: Path = DOOR) -> int:
    """`command` run in the deployment's session (module docstring); its exit status."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        try:
            conn.connect(str(path))
        except OSError as exc:
            print(f"no deployment's door at {path} ({exc}): start it with `make serve`",
                  file=sys.stderr)
            return 2
        request = {"argv": command, "cwd": os.getcwd(), "env": dict(os.environ)}
        socket.send_fds(conn, [json.dumps(request).encode() + b"\n"], [0, 1, 2])
        try:
            status = conn.recv(16)
        except KeyboardInterrupt:
            return 130
        return int(status or 1)


def _placements() -> dict[str, list[str]]:
    """How each placement starts the replay; a new session stands for a second terminal."""
    return {"same session": [], "other session": ["setsid", "-w"],
            "other session, make client (through the door)": ["setsid", "-w", *SELF, "--"]}


def measure(out: str, requests: int, rounds: int) -> dict:
    from blockserve.bench.targets import API_KEY
    from blockserve.tools.launch import load_config, replica_count, serve_run

    config = load_config()
    placements = _placements()
    threading.Thread(target=open_door, kwargs={"owner": os.getpid()}, daemon=True).start()
    order = list(placements) + list(reversed(placements))
    runs: dict[str, list[dict]] = {name: [] for name in placements}
    started = time.strftime("%Y-%m-%dT%H:%M:%S")
    with serve_run(config, expected_replicas=replica_count(config),
                   env={"BLOCKSERVE_API_KEY": API_KEY}) as run, \
            tempfile.TemporaryDirectory() as scratch:
        replay = [*REPLAY, "--url", run.base_url, "--api-key", API_KEY,
                  "--requests", str(requests)]
        subprocess.run([*replay, "--requests", "40"], check=True,  # warm-up, not counted
                       stdout=subprocess.DEVNULL)
        for index, name in enumerate(order * rounds):
            result = Path(scratch) / f"{index}.json"
            subprocess.run([*placements[name], *replay, "--seed", str(index % 2),
                            "--out", str(result)], check=True, stdout=subprocess.DEVNULL)
            summary = json.loads(result.read_text())["summary"]
            runs[name].append({"seed": index % 2, **{k: summary[k] for k in SUMMARY_KEYS}})
            print(f"{name:<52} {summary['output_tokens_per_s']:7.0f} tok/s  "
                  f"TTFT p50 {summary['ttft_p50_s']:.3f} s", flush=True)
    report = {
        "command": " ".join(["python -m blockserve.bench.second_terminal --measure",
                             f"--requests {requests} --rounds {rounds} --out {out}"]),
        "started": started, "workload": f"azure_code, {requests} requests, seeds 0 and 1, "
                                        "output lengths unknown",
        "autogroup_enabled": Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip(),
        "cpus": os.cpu_count(), "order": order * rounds, "runs": runs,
        "median": {name: {key: statistics.median(r[key] for r in records)
                          for key in ("output_tokens_per_s", "ttft_p50_s", "ttft_p99_s")}
                   for name, records in runs.items()},
    }
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.json").write_text(json.dumps(report, indent=1) + "\n")
    return report


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" in argv:
        split = argv.index("--")
        argv, command = argv[:split], argv[split + 1:]
    else:
        command = []
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--door", action="store_true",
                        help="open the door into this session (make serve does)")
    parser.add_argument("--measure", action="store_true")
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--out", default="results/second_terminal")
    args = parser.parse_args(argv)
    if args.door:
        open_door()
        return 0
    if args.measure:
        print(json.dumps(measure(args.out, args.requests, args.rounds)["median"], indent=1))
        return 0
    if not command:
        parser.error("give the client's command after --, or --door or --measure")
    return through_door(command)


if __name__ == "__main__":
    sys.exit(main())
