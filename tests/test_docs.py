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
import json
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
    """...or is a retired script, which the next test finds in the commit the docs name."""
    retired = retired_modules(BENCHMARKS.read_text())
    missing = [module for module in sorted(set(MODULE_RUN.findall(page.read_text())))
               if module not in retired and importlib.util.find_spec(module) is None]
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
    retired = retired_modules(BENCHMARKS.read_text())
    names = sorted(set(DOTTED_NAME.findall(page.read_text())) - set(retired))
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


POLICY_EXAMPLES = [ROOT / "README.md", ROOT / "docs" / "writing-policies.md"]


def readme_examples() -> types.ModuleType:
    """The policy examples of the README and docs/writing-policies.md, run as one importable
    module (as a user's would be)."""
    blocks = [block for page in POLICY_EXAMPLES
              for block in re.findall(r"^```python\n(.*?)^```", page.read_text(), re.M | re.S)]
    module = types.ModuleType("readme_examples")
    exec(compile("\n\n".join(blocks), "README.md", "exec"), module.__dict__)
    return module


def test_the_readme_policy_examples_build_through_the_config_and_behave(monkeypatch):
    from blockserve.protocol.config import RouterConfig, SchedulerConfig
    from blockserve.router.demand import Demand
    from blockserve.protocol.router_policies import Candidate

    examples = readme_examples()
    monkeypatch.setitem(sys.modules, "readme_examples", examples)
    router = RouterConfig(placement="readme_examples:EmptiestFirst",
                          queue_order="readme_examples:GoldTenantFirst",
                          output_predictor="readme_examples:HalfTheCap")
    scheduler = SchedulerConfig(admission_gate="readme_examples:AtMostFourPerStep",
                                preemption="readme_examples:LongestPromptLast",
                                step_tokens="readme_examples:SmallStepsWhileDecoding")

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

    from blockserve.protocol.policies import StepState
    step_tokens = scheduler.step_tokens.build()
    assert step_tokens.tokens(StepState(8192, decoding=3, context_tokens=900)) == 512
    assert step_tokens.tokens(StepState(8192, decoding=0, context_tokens=900)) == 8192


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
                for f in ("placement", "queue_order", "output_predictor", "prefix_index",
                          "transport")}
    defaults |= {f"replica.scheduler.{f}": getattr(SchedulerConfig(), f).cls
                 for f in ("queue_order", "admission_gate", "preemption", "block_eviction",
                           "block_retention", "block_budget", "step_tokens")}
    assert {field: name for field, name in defaults.items()
            if f"**`{name}`**" not in rows[field]} == {}


# --- The docs agree with themselves and with their results --------------------------------

RESULTS_LOG = ROOT / "docs" / "results-log.md"
BENCHMARKS = ROOT / "docs" / "benchmarks.md"
# docs/benchmarks.md's retired scripts: | `blockserve.bench.NAME` | `COMMIT` | ...
RETIRED_ROW = re.compile(r"^\| `(blockserve\.bench\.\w+)` \| `([0-9a-f]{7,40})` \|", re.M)
# "8 of 27 targets met" (also the loose forms of earlier text: "9 of\n27 met",
# "13 of issue 17's 27"); the total is a committed run's number of target checks.
# A count without the word "targets" is checked only where the section's own results have
# that total: elsewhere it may count a subset ("goodput: 0 of 6"), which no JSON lists.
TARGET_CLAIM = re.compile(r"\b(\d+)\s+of\s+(?:issue\s+\d+'s\s+)?(\d+)\b(\s+targets?\b)?")
AS_OURS = re.compile(r"\bwith\s+`([^`]+)`\s+as\s+ours")
ISSUE_MENTION = re.compile(r"\bissues?\s+#?\d+", re.I)
COMMIT = re.compile(r"`([0-9a-f]{7,40})`")
# A figure with its unit: 1.07x, 0.98-1.00x, 47.2 ms, 4.15 GiB, 0.8%, 1,566 tok/s.
FIGURE = re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?(?:-\d[\d,]*(?:\.\d+)?)?"
                    r"(?:x\b| ?ms\b| ?GiB\b|%| tok/s\b)")
LOG_ENTRY = re.compile(r"^## (\d{4}-\d{2}-\d{2} \d{2}:\d{2}): ", re.M)


def retired_modules(benchmarks: str) -> dict[str, str]:
    """module -> the last commit that had it, from docs/benchmarks.md's retired scripts."""
    return dict(RETIRED_ROW.findall(benchmarks))


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)


def sections(text: str) -> list[tuple[str, str]]:
    """(heading, body) for each level-1 or level-2 heading, its subsections included."""
    parts = re.split(r"^(#{1,2} .*)$", _prose(text), flags=re.M)
    return [("", parts[0])] + [(parts[i], parts[i + 1]) for i in range(1, len(parts), 2)]


def _results_json(page: Path, text: str, root: Path) -> list[Path]:
    """The results JSONs a section links or names."""
    paths = [(page.parent / t.partition("#")[0]).resolve() for t in link_targets(text)
             if t.endswith(".json") and not EXTERNAL.match(t)]
    paths += [(root / p).resolve() for p in named_files(text) if p.endswith(".json")]
    return [p for p in dict.fromkeys(paths) if p.exists()]


def target_counts(result: Path, ours: str | None = None) -> set[tuple[int, int]]:
    """(met, checked) per configuration the run's `targets` were checked for; with `ours`,
    the unknown-lengths targets recomputed with that configuration as ours."""
    data = json.loads(result.read_text())
    checks = data.get("targets") if isinstance(data, dict) else None
    if not isinstance(checks, list):
        return set()
    if ours is not None:
        from blockserve.bench import report

        results = {**data["results"], report.OURS: data["results"][ours]}
        checks = [c for workload in data["args"]["workloads"]
                  for c in report.target_checks(results, workload)]
        return {(sum(c["met"] for c in checks), len(checks))}
    groups: dict[str, list[bool]] = {}
    for check in checks:
        groups.setdefault(check.get("ours", ""), []).append(bool(check["met"]))
    return {(sum(met), len(met)) for met in groups.values()}


def target_claim_problems(page: Path, root: Path) -> list[str]:
    """Each "N of M" target count that no results JSON of its section says. The totals
    looked for are the committed runs' numbers of target checks."""
    totals = {total for result in (root / "docs" / "results").glob("*.json")
              for _, total in target_counts(result)}
    problems = []
    for heading, body in sections(page.read_text()):
        results = _results_json(page, body, root)
        own_totals = {total for result in results for _, total in target_counts(result)}
        for match in TARGET_CLAIM.finditer(body):
            met, total = int(match.group(1)), int(match.group(2))
            if total not in totals or not (match.group(3) or total in own_totals):
                continue
            sentence = body[match.start():].split(". ")[0]
            ours = AS_OURS.search(sentence)
            said = {count for result in results
                    for count in target_counts(result, ours.group(1) if ours else None)}
            claim = " ".join(match.group(0).split())
            if not results:
                problems.append(f"{heading or page.name}: '{claim}' with no results JSON")
            elif (met, total) not in said:
                problems.append(f"{heading or page.name}: '{claim}', but its results say "
                                f"{sorted(said)}")
    return problems


@pytest.mark.parametrize("page", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_target_count_is_its_results_count(page):
    """"8 of 27 targets met" is what the JSON of the run its section links says."""
    assert target_claim_problems(page, ROOT) == []


def test_a_target_count_its_results_do_not_say_is_reported(tmp_path):
    (tmp_path / "docs" / "results").mkdir(parents=True)
    checks = [{"workload": "w", "met": i < 3} for i in range(5)]
    (tmp_path / "docs" / "results" / "run.json").write_text(json.dumps({"targets": checks}))
    page = tmp_path / "README.md"
    page.write_text("# Top\n## Results\n[JSON](docs/results/run.json): **3 of 5 targets met**, "
                    "then 4 of\n5 met.\n## Limits\nThe targets are not all met (3 of 5 targets).\n")
    assert target_claim_problems(page, tmp_path) == [
        "## Results: '4 of 5', but its results say [(3, 5)]",
        "## Limits: '3 of 5 targets' with no results JSON"]


def issue_mentions(text: str) -> list[str]:
    """"issue 15" outside a link to a tracker: a reader has no issue 15 to look up."""
    prose = re.sub(r"\[([^\]]*)\]\((?:https?:)[^)]*\)", "", _prose(text))
    return [" ".join(m.group(0).split()) for m in ISSUE_MENTION.finditer(prose)]


@pytest.mark.parametrize("page", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_issue_number_without_a_tracker_link(page):
    assert issue_mentions(page.read_text()) == []


def test_an_issue_number_without_a_tracker_link_is_reported():
    assert issue_mentions("issue 17's targets; Issue\n15; [issue 3](https://x.org/3); "
                          "a non-issue: 15 issues") == ["issue 17", "Issue 15"]


@pytest.mark.parametrize("page", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_commit_the_docs_name_is_in_the_history(page):
    unknown = [c for c in sorted(set(COMMIT.findall(page.read_text())))
               if _git("cat-file", "-e", f"{c}^{{commit}}").returncode != 0]
    assert unknown == []


def figures(text: str) -> set[str]:
    return {m.group(0).replace(",", "").replace(" ", "") for m in FIGURE.finditer(text)}


def unmatched_figures(page: Path) -> list[str]:
    """The figures of each paragraph of `page` that links docs pages which none of those
    pages quotes: a number the README repeats must be the one its source says."""
    problems = []
    for paragraph in re.split(r"\n\s*\n", _prose(page.read_text())):
        linked = {(page.parent / t.partition("#")[0]).resolve() for t in link_targets(paragraph)
                  if t.partition("#")[0].endswith(".md") and not EXTERNAL.match(t)}
        linked.discard(page.resolve())
        if linked:
            quoted = set().union(*(figures(p.read_text()) for p in linked if p.exists()))
            problems += sorted(figures(paragraph) - quoted)
    return problems


def test_the_readme_quotes_what_the_docs_it_links_say():
    """A figure quoted twice agrees: each one in a README paragraph that links docs pages
    is quoted by one of them."""
    assert unmatched_figures(ROOT / "README.md") == []


def test_a_figure_the_linked_page_does_not_quote_is_reported(tmp_path):
    (tmp_path / "log.md").write_text("# Log\npressure 1,566 tok/s, 1.07x, p50 47.2 ms\n")
    page = tmp_path / "README.md"
    page.write_text("# Top\n## Results\n[log](log.md): 1566 tok/s, 1.07x, 47.2 ms, 0.89x.\n\n"
                    "Unlinked: 0.5x.\n")
    assert unmatched_figures(page) == ["0.89x"]


def results_log_problems(text: str, tracked: set[str]) -> list[str]:
    """Each entry dated, newest first, with its commit, its command and committed files;
    every committed result quoted by some entry."""
    problems, named = [], set()
    entries = LOG_ENTRY.split(text)[1:]
    dates = entries[0::2]
    if dates != sorted(dates, reverse=True):
        problems.append("entries not newest first")
    for date, body in zip(dates, entries[1::2]):
        files = {path for path in named_files(body) if path.startswith("docs/results/")}
        files |= {f"docs/{t.partition('#')[0]}" for t in link_targets(body)
                  if t.startswith("results/")}
        named |= files
        for field in ("Commit", "Command", "Files"):
            if not re.search(rf"^- {field}s?: ", body, re.M):
                problems.append(f"{date}: no {field.lower()}")
        if not files & tracked:
            problems.append(f"{date}: no committed result file")
    orphans = sorted(p for p in tracked if p.startswith("docs/results/") and p not in named)
    problems += [f"{p}: in no entry" for p in orphans]
    return problems


def test_the_results_log_dates_and_sources_every_entry():
    assert results_log_problems(RESULTS_LOG.read_text(), tracked_files()) == []


def test_an_undated_unsourced_or_missing_result_is_reported():
    log = ("# Log\n## 2026-12-01 10:00: older\n- Commit: `abc1234`\n- Command: `x`\n"
           "- Files: [run](results/a.json)\n## 2026-12-01 11:00: newer\n- Commit: `abc1234`\n"
           "- Files: [gone](results/gone.json)\n")
    assert results_log_problems(log, {"docs/results/a.json", "docs/results/b.png"}) == [
        "entries not newest first", "2026-12-01 11:00: no command",
        "2026-12-01 11:00: no committed result file", "docs/results/b.png: in no entry"]


def test_each_retired_script_is_gone_and_in_the_commit_the_docs_name():
    """A command of a retired script stays runnable: its file is in the commit named."""
    retired = retired_modules(BENCHMARKS.read_text())
    assert retired, "docs/benchmarks.md lists its retired scripts"
    problems = []
    for module, commit in retired.items():
        path = module.removeprefix("blockserve.").replace(".", "/") + ".py"
        if (ROOT / path).exists():
            problems.append(f"{module} is not retired: {path} exists")
        if _git("cat-file", "-e", f"{commit}:{path}").returncode != 0:
            problems.append(f"{module}: no {path} in {commit}")
    assert problems == []


def test_the_readme_stays_a_guide():
    """At most 300 lines: reference and results live in docs/, which it links."""
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300
