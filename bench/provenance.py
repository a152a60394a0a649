"""Which code and which deploy.yaml a tool runs: printed by the simulator, the lab and the
benchmarks at start, and recorded in their results, so that a fork in a second folder never
reports the original's code (an editable install's finder points to one checkout only)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from blockserve.tools.launch import DEFAULT_CONFIG, REPO


def _checkout(path: Path) -> Path | None:
    """The blockserve checkout `path` lies in (the nearest folder with deploy/deploy.yaml)."""
    for folder in [path, *path.parents]:
        if (folder / "deploy" / "deploy.yaml").is_file() and (folder / "bench").is_dir():
            return folder
    return None


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "-C", str(REPO), "describe", "--always", "--dirty"],
                              capture_output=True, text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def provenance() -> dict:
    """The code directory, its commit and the deploy.yaml a run reads."""
    return {"code_dir": str(REPO), "commit": _commit(), "deploy_yaml": str(DEFAULT_CONFIG)}


def announce(tool: str) -> dict:
    """Print `provenance()` to stderr, loudly where the working directory is another
    checkout than the code's; returned for the results file."""
    facts = provenance()
    print(f"{tool}: code {facts['code_dir']} ({facts['commit']}), "
          f"deploy.yaml {facts['deploy_yaml']}", file=sys.stderr)
    here = _checkout(Path.cwd().resolve())
    if here is not None and here != REPO.resolve():
        print(f"WARNING: run from the checkout {here}, but the blockserve package imported is "
              f"{REPO} and its deploy.yaml is the one read. Install this checkout "
              f"(pip install -e {here}) or run from {REPO}.", file=sys.stderr)
        facts["cwd_checkout"] = str(here)
    return facts
