"""The deployment launcher of tests and benchmarks (tools/launch.py) leaves nothing behind."""

import subprocess
import sys
import time

from blockserve.tools.launch import kill_leftovers


SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]  # a path after it: argv[1]


def test_what_outlives_a_run_and_names_its_directory_is_killed_and_reported(tmp_path, capsys):
    """After the grace period; a process that exits within it is no leftover."""
    workdir = tmp_path / "bs-run"
    workdir.mkdir()
    # In their own sessions, as HAProxy ends up when the proxy actor that started it dies.
    leftover = subprocess.Popen([*SLEEPER, str(workdir / "haproxy.cfg")], start_new_session=True)
    unrelated = subprocess.Popen([*SLEEPER, str(tmp_path / "bs-other")], start_new_session=True)
    try:
        killed = kill_leftovers(workdir, grace_s=0.5)
        assert leftover.wait(5) == -9 and len(killed) == 1 and str(workdir) in killed[0]
        assert unrelated.poll() is None
        assert "still running" in capsys.readouterr().err
        assert kill_leftovers(workdir, grace_s=0.5) == [] and capsys.readouterr().err == ""
    finally:
        leftover.kill()
        unrelated.kill()


def test_a_process_that_exits_within_the_grace_period_is_left_alone(tmp_path, capsys):
    workdir = tmp_path / "bs-run"
    slow_exit = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1)",
                                  str(workdir)], start_new_session=True)
    try:
        assert kill_leftovers(workdir, grace_s=5) == [] and slow_exit.wait(5) == 0
        assert capsys.readouterr().err == ""
    finally:
        slow_exit.kill()
