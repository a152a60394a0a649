"""bench/second_terminal.py's door: a command from another session runs in the door's
session, with the caller's stdout and exit status (real processes, no deployment)."""

import os
import subprocess
import sys
import threading
import time

from blockserve.bench.second_terminal import open_door


def test_a_command_from_another_session_runs_in_the_doors_session(tmp_path):
    door = tmp_path / "door.sock"
    threading.Thread(target=open_door, args=(door, os.getpid()), daemon=True).start()
    while not door.exists():
        time.sleep(0.05)
    out = tmp_path / "out.txt"
    with open(out, "w") as stdout:
        caller = subprocess.run(
            [sys.executable, "-m", "blockserve.bench.second_terminal", "--", "sh", "-c",
             "ps -o sess= -p $$; exit 3"],
            env={**os.environ, "BLOCKSERVE_DOOR": str(door)}, stdout=stdout,
            start_new_session=True, timeout=120)  # its own session: a second terminal
    assert caller.returncode == 3
    assert int(out.read_text()) == os.getsid(0)  # the door's session, not the caller's
