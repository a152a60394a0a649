"""The deployment launcher of tests and benchmarks (tools/launch.py) leaves nothing behind."""

import subprocess
import sys
import time

from blockserve.tools.launch import kill_leftovers


SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]  # a path after it: argv[1]


def test_what_outlives_a_run_and_names_its_directory_is_killed_and_reported(tmp_path, capsys):
    workdir = tmp_path / "bs-run"
    workdir.mkdir()
    # In their own sessions, as HAProxy ends up when the proxy actor that started it dies.
    leftover = subprocess.Popen([*SLEEPER, str(workdir / "haproxy.cfg")], start_new_session=True)
    unrelated = subprocess.Popen([*SLEEPER, str(tmp_path / "bs-other")], start_new_session=True)
    try:
        killed = kill_leftovers(workdir)
        assert leftover.wait(5) == -9 and len(killed) == 1 and str(workdir) in killed[0]
        assert unrelated.poll() is None
        assert "outlived" in capsys.readouterr().err
        assert kill_leftovers(workdir) == [] and capsys.readouterr().err == ""
    finally:
        leftover.kill()
        unrelated.kill()
