"""blockserve installs one import package, `blockserve`, and its code imports only that."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("controller", "router", "replica", "protocol", "bench", "tools")
BARE_IMPORT = re.compile(rf"^\s*(from|import) ({'|'.join(FOLDERS)})(\.|\s|$)", re.M)


def test_a_wheel_installs_only_the_blockserve_package(tmp_path):
    source, target = tmp_path / "source", tmp_path / "site"
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, check=True, capture_output=True,
                             text=True).stdout.split()
    for name in tracked:  # a copy, so the build leaves no build/ in the checkout
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(source)], check=True, capture_output=True)
    (dist_info,) = target.glob("blockserve-*.dist-info")
    assert (dist_info / "top_level.txt").read_text().split() == ["blockserve"]
    # bin/ holds the `blockserve` console script, not an import package
    assert {p.name for p in target.iterdir()} - {dist_info.name, "bin"} == {"blockserve"}
    installed = (dist_info / "RECORD").read_text()
    for folder in FOLDERS:
        assert f"blockserve/{folder}/__init__.py" in installed


def test_no_module_imports_a_folder_by_its_bare_name():
    offenders = [f"{path.relative_to(ROOT)}: {match.group(0).strip()}"
                 for folder in (*FOLDERS, "tests", "docs")
                 for path in (ROOT / folder).rglob("*.py")
                 for match in BARE_IMPORT.finditer(path.read_text())]
    assert offenders == []
