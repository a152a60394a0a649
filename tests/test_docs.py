"""Every file, image and heading that README.md and docs/*.md point to is in the repository,
and the README's policy examples do what their names say.

A clean clone is what a reader has: a link to a file that exists only on the machine that
wrote it (an ignored or uncommitted result) is a broken link, so a target must be tracked
by git, not just present. Also checked: `#anchors` name a heading of the linked page; a
repository file named in the text (`replica/scheduler.py`, `docs/results/x.json`) exists,
since a number quoted without its file is not evidence and a guide that names moved code
misleads; every `python -m blockserve...` module the docs tell a reader to run exists. Fast: no
deployment, no engine.
"""

from __future__ import annotations

import importlib.util
import itertools
import re
import subprocess
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", re.M)
HTML_SRC = re.compile(r"<(?:img|a)\b[^>]*?\b(?:src|href)=\"([^\"]+)\"", re.I)
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
INLINE_CODE = re.compile(r"`([^`\n]+)`")
FOLDERS = "controller|router|replica|protocol|bench|tools|tests|deploy|dashboards|docs|data"
# A repository-relative file name in the text: a top-level folder, a name with an extension.
NAMED_FILE = re.compile(rf"(?<![\w./-])((?:{FOLDERS})/[\w./{{}},*-]*\.[\w{{}},]*\w}}?)")
MODULE_RUN = re.compile(r"python -m (blockserve(?:\.\w+)+)")  # vLLM's are vLLM's to keep
DOTTED_NAME = re.compile(r"(?<![\w./-])(blockserve(?:\.\w+)+)")  # module, or module.Class
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)  # http:, https:, mailto:, ...


def tracked_files() -> set[str]:
    """Paths git tracks (or has staged); everything on disk when there is no git checkout."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, check=True,
                                capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return {str(p.relative_to(ROOT)) for p in ROOT.rglob("*") if p.is_file()}
    return {path for path in listed.split("\0") if path}


def _prose(text: str) -> str:
    """The text outside fenced code blocks (a link in a code sample is not a link)."""
    return FENCE.sub("", text)


def link_targets(text: str) -> list[str]:
    prose = _prose(text)
    without_code = INLINE_CODE.sub("", prose)
    return [m.group(1) for pattern in (LINK, REFERENCE, HTML_SRC)
            for m in pattern.finditer(without_code)]


def _expand_braces(path: str) -> list[str]:
    parts = re.split(r"\{([^{}]*)\}", path)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(combo) for combo in itertools.product(*choices)]


def named_files(text: str) -> list[str]:
    """Repository files the prose names outside its links (those are checked as links),
    braces expanded, globs skipped."""
    prose = re.sub(r"\]\([^)]*\)", "]", REFERENCE.sub("", _prose(text)))
    prose = re.sub(r"\b(?:src|href)=\"[^\"]*\"", "", prose)
    return [path for m in NAMED_FILE.finditer(prose) if "*" not in m.group(1)
            for path in _expand_braces(m.group(1))]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    seen: dict[str, int] = {}
    result = set()
    for line in _prose(text).splitlines():
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        base = slug(match.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        result.add(base if count == 0 else f"{base}-{count}")
    return result


def broken_links(page: Path, root: Path, tracked: set[str]) -> list[str]:
    """Each link of `page` that does not resolve to a tracked file, directory or heading."""
    text = page.read_text()
    tracked_dirs = {str(parent) for path in tracked for parent in Path(path).parents}
    problems = []
    for target in link_targets(text):
        if EXTERNAL.match(target):
            continue
        path_part, _, anchor = target.partition("#")
        resolved = (page.parent / path_part).resolve() if path_part else page.resolve()
        try:
            relative = str(resolved.relative_to(root.resolve()))
        except ValueError:
            problems.append(f"{target} (outside the repository)")
            continue
        if relative not in tracked and relative not in tracked_dirs:
            problems.append(f"{target} ({relative} is not in the repository)")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved.read_text()):
            problems.append(f"{target} (no heading #{anchor} in {relative})")
    for named in named_files(text):
        if named not in tracked:
            problems.append(f"`{named}` (named, not in the repository)")
    return problems


@pytest.mark.parametrize("page", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_of_the_docs_resolves_in_the_repository(page):
    assert broken_links(page, ROOT, tracked_files()) == []


@pytest.mark.parametrize("page", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_module_the_docs_run_exists(page):
    missing = [module for module in sorted(set(MODULE_RUN.findall(page.read_text())))
               if importlib.util.find_spec(module) is None]
    assert missing == []


def _resolves(dotted: str) -> bool:
    """A module, or a module and a capitalised name in it (`...ledger.Ledger`), without
    importing the module itself (its parent packages are imported to find it)."""
    try:
        if importlib.util.find_spec(dotted) is not None:
            return True
    except ModuleNotFoundError:
        pass
    parent, _, name = dotted.rpartition(".")
    return name[:1].isupper() and importlib.util.find_spec(parent) is not None


@pytest.mark.parametrize("page", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_blockserve_module_the_docs_name_exists(page):
    names = sorted(set(DOTTED_NAME.findall(page.read_text())))
    assert [name for name in names if not _resolves(name)] == []


def test_the_docs_link_to_their_results():
    """The check has something to check: the README links its plot and benchmarks page."""
    targets = link_targets((ROOT / "README.md").read_text())
    assert "docs/benchmarks.md" in targets
    assert any(t.startswith("docs/results/") and t.endswith(".png") for t in targets)


def test_a_broken_link_image_anchor_or_quoted_result_is_reported(tmp_path):
    (tmp_path / "docs" / "results").mkdir(parents=True)
    (tmp_path / "docs" / "results" / "run.json").write_text("{}")
    (tmp_path / "docs" / "guide.md").write_text("# Guide\n\n## Writing a policy\n")
    page = tmp_path / "README.md"
    page.write_text(
        "# Top\n[ok](docs/guide.md#writing-a-policy) [web](https://example.com)\n"
        "![plot](docs/results/run.json) [here](#top) `docs/results/run.json`\n"
        "```\n[in code](docs/missing-in-code.md)\n```\n"
        "[gone](docs/missing.md) ![lost](docs/results/lost.png) [bad](docs/guide.md#nope)\n"
        "[self](#nowhere) [up](../outside.md) `docs/results/{run,never}.json`\n"
        "<img src=\"docs/results/html.png\">\n[ref]: docs/reference.md\n"
        "The gate lives in replica/gone.py; see docs/guide.md and docs/results/run*.json.\n")
    tracked = {"README.md", "docs/guide.md", "docs/results/run.json"}
    problems = broken_links(page, tmp_path, tracked)
    assert [p.split(" ")[0] for p in problems] == [
        "docs/missing.md", "docs/results/lost.png", "docs/guide.md#nope", "#nowhere",
        "../outside.md", "docs/reference.md", "docs/results/html.png",
        "`docs/results/never.json`", "`replica/gone.py`"]
    # present on disk but not committed is still broken: a clean clone lacks it
    assert broken_links(page, tmp_path, tracked - {"docs/results/run.json"})[0].startswith(
        "docs/results/run.json")


def readme_examples() -> types.ModuleType:
    """The README's Python examples, run as one importable module (as a user's would be)."""
    blocks = re.findall(r"^```python\n(.*?)^```", (ROOT / "README.md").read_text(), re.M | re.S)
    module = types.ModuleType("readme_examples")
    exec(compile("\n\n".join(blocks), "README.md", "exec"), module.__dict__)
    return module


def test_the_readme_policy_examples_build_through_the_config_and_behave(monkeypatch):
    from blockserve.protocol.config import RouterConfig, SchedulerConfig
    from blockserve.router.demand import Demand
    from blockserve.router.placement import Candidate

    examples = readme_examples()
    monkeypatch.setitem(sys.modules, "readme_examples", examples)
    router = RouterConfig(placement="readme_examples:EmptiestFirst",
                          queue_order="readme_examples:GoldTenantFirst",
                          output_predictor="readme_examples:HalfTheCap")
    scheduler = SchedulerConfig(admission_gate="readme_examples:AtMostFourPerStep",
                                preemption="readme_examples:LongestPromptLast")

    order = router.queue_order.build()
    waiting = [SimpleNamespace(seq=i, arrival=float(i), demand_blocks=1, priority=0, tenant=t)
               for i, t in enumerate(["free", "gold", "free", "gold"])]
    assert [w.seq for w in sorted(waiting, key=lambda w: order.key(w, 10.0))] == [1, 3, 0, 2]

    demand = Demand(prompt_tokens=64, expected_output=64, sequences=1, block_size=32)
    full, roomy, roomier = (Candidate(name, 10, free, 0, 0, 0.0)
                            for name, free in (("full", 3), ("roomy", 5), ("roomier", 8)))
    placement = router.placement.build()
    assert placement.choose(demand, [roomy, full, roomier]) == "roomier"
    assert placement.choose(demand, [full]) is None

    assert router.output_predictor.build().predict(100, 40, 900) == 20

    from blockserve.protocol.policies import RequestView
    short, long = (RequestView(f"r{blocks}", blocks, "t", 0, 0.0, blocks, 32, 20, 0)
                   for blocks in (1, 9))
    gate = scheduler.admission_gate.build()
    assert gate.may_admit(short, [long] * 3, pool=None)
    assert not gate.may_admit(short, [long] * 4, pool=None)
    preemption = scheduler.preemption.build()  # the largest key is preempted first
    assert max([long, short], key=lambda r: preemption.key(r, 0.0)) is short


def _is_within(part, whole) -> bool:
    if isinstance(part, dict):
        return isinstance(whole, dict) and all(
            key in whole and _is_within(value, whole[key]) for key, value in part.items())
    return part == whole


def test_the_readme_config_example_validates_and_is_deploy_yamls():
    import yaml

    from blockserve.protocol.config import AppConfig

    (example,) = re.findall(r"^```yaml\n(.*?)^```", (ROOT / "README.md").read_text(), re.M | re.S)
    args = yaml.safe_load(example)["applications"][0]["args"]
    AppConfig(**args)
    deployed = yaml.safe_load((ROOT / "deploy" / "deploy.yaml").read_text())
    assert _is_within(args, deployed["applications"][0]["args"])


def test_the_readme_configuration_table_names_every_built_in_policy():
    """Every short name of the registry, in its field's row (and the default in bold)."""
    from blockserve.protocol.config import RouterConfig, SchedulerConfig
    from blockserve.protocol.registry import KINDS

    rows = {m.group(1): m.group(0) for m in
            re.finditer(r"^\| `([\w.]+)` \|.*$", (ROOT / "README.md").read_text(), re.M)}
    missing = {field: [name for name in kind.names if f"`{name}`" not in rows.get(field, "")]
               for field, kind in KINDS.items()}
    assert {field: names for field, names in missing.items() if names} == {}
    defaults = {f"router.{f}": getattr(RouterConfig(), f).cls
                for f in ("placement", "queue_order", "output_predictor")}
    defaults |= {f"replica.scheduler.{f}": getattr(SchedulerConfig(), f).cls
                 for f in ("queue_order", "admission_gate", "preemption", "block_eviction",
                           "block_retention", "block_budget")}
    assert {field: name for field, name in defaults.items()
            if f"**`{name}`**" not in rows[field]} == {}
