"""No policy can read the truth: under the unknown length mode a request ends at its true
length through `min_tokens`, a stop id and a logit bias on it (bench/workloads.py), and
nothing in the router or the replica may use them to predict that length.

Two checks: behaviour (the router's demand and the replica scheduler's leases, gates,
snapshots and schedule are identical whether a request carries them or not) and source
(no module under router/ or replica/ names min_tokens, stop ids or logit_bias).
"""

from __future__ import annotations

import ast
import dataclasses
import random
from pathlib import Path

import pytest
from transformers import AutoTokenizer
from vllm.entrypoints.openai.completion.protocol import CompletionRequest

from blockserve.bench.workloads import KNOWN, LengthMode, Lengths, RequestSpec
from blockserve.protocol.config import AppConfig
from blockserve.replica.scheduler import BlockAwareScheduler
from blockserve.router.demand import DemandEstimator
from blockserve.tools.engine_less import EngineLessReplica
from blockserve.tools.launch import load_config

REPO = Path(__file__).resolve().parents[1]
FORBIDDEN = {"min_tokens", "stop_token_ids", "all_stop_token_ids", "_all_stop_token_ids",
             "logit_bias"}
END = 4095


@pytest.fixture(scope="module")
def app() -> AppConfig:
    """deploy/deploy.yaml's policies: the ones every benchmark of ours runs."""
    return AppConfig.model_validate(load_config()["applications"][0]["args"])


def truth(length: int) -> dict:
    """What the unknown mode adds to a request that ends after `length` tokens."""
    unknown = Lengths(LengthMode.UNKNOWN, 1024, END).fields(RequestSpec(0.0, [1], length))
    assert unknown.keys() - KNOWN.fields(RequestSpec(0.0, [1], length)).keys() == {
        "min_tokens", "stop_token_ids", "logit_bias"}  # what this test covers
    return {key: unknown[key] for key in ("min_tokens", "stop_token_ids", "logit_bias")}


def requests(seed: int = 0, n: int = 24) -> list[tuple[list[int], int, int]]:
    """(prompt, loose cap, true length): a burst several times the replica's cache."""
    rng = random.Random(seed)
    specs = []
    for _ in range(n):
        prompt = [rng.randrange(10, 4000) for _ in range(rng.randint(40, 300))]
        specs.append((prompt, 1024 - len(prompt), rng.randint(2, 200)))
    return specs


def test_router_demand_ignores_min_tokens_and_stop_ids(model_dir, app):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    plain = DemandEstimator(tokenizer, app.router.output_predictor.build())
    told = DemandEstimator(tokenizer, app.router.output_predictor.build())
    for prompt, cap, length in requests():
        base = {"model": "m", "prompt": prompt, "max_tokens": cap}
        a = plain.completion(CompletionRequest.model_validate(base), 32, 1024)
        b = told.completion(CompletionRequest.model_validate({**base, **truth(length)}),
                            32, 1024)
        assert a == b and a.blocks == b.blocks
        for estimator in (plain, told):  # both learn the same finished lengths
            estimator.predictor.on_finished(len(prompt), "default", length)


def replay(model_dir: str, scheduler: dict, told: bool) -> list:
    """Every step's schedule, snapshot and per-request lease of one replica running
    deploy/deploy.yaml's scheduler policies under block pressure. The fabricated model
    never samples a stop id, so requests run to their cap either way: whatever differs
    came from reading min_tokens or the stop ids."""
    rng = random.Random(1)
    # A fixed clock: on wall time the snapshot's cached-block count refreshes at moments
    # that differ from run to run, which would differ for reasons other than the lengths.
    replica = EngineLessReplica(
        model_dir, BlockAwareScheduler, num_blocks=65, block_size=32,
        scheduler=scheduler,
        sample=lambda request: rng.randrange(1, END), clock=lambda: 0.0)
    for i, (prompt, cap, length) in enumerate(requests()):
        replica.add(f"r{i}", prompt, min(cap, 64), arrival=float(i), ignore_eos=False,
                    **(truth(min(length, 64)) if told else {}))
    book, trace = replica.scheduler.book, []
    while replica.scheduler.has_unfinished_requests():
        record = replica.step()
        leases = {r.request_id: (book.expected_tokens(r), book.demand(r))
                  for r in [*replica.scheduler.running, *replica.scheduler.waiting]}
        snapshot = dataclasses.replace(replica.scheduler.snapshot, timestamp=0.0)
        trace.append((record, snapshot, leases))
    return trace


def test_replica_scheduling_ignores_min_tokens_and_stop_ids(model_dir, app):
    scheduler = app.replica.scheduler.model_dump()
    plain, told = replay(model_dir, scheduler, False), replay(model_dir, scheduler, True)
    assert any(snapshot.waiting for _, snapshot, _ in plain)  # the gate had to choose
    assert len(plain) == len(told)
    for step, (a, b) in enumerate(zip(plain, told)):
        assert a == b, f"step {step} differs"


def forbidden_reads(root: Path) -> list[str]:
    """Every place under `root` that names min_tokens or the stop ids: an attribute, a
    name, a keyword argument, a string (a dict key, getattr) or an import."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Attribute):
                names = [node.attr]
            elif isinstance(node, ast.Name):
                names = [node.id]
            elif isinstance(node, ast.keyword) and node.arg:
                names = [node.arg]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                names = [node.value]
            elif isinstance(node, ast.alias):
                names = [node.name.rpartition(".")[2], node.asname or ""]
            found += [f"{path.relative_to(root.parent)}:{node.lineno}: {name}"
                      for name in names if name in FORBIDDEN]
    return found


@pytest.mark.parametrize("package", ["router", "replica"])
def test_no_policy_module_names_min_tokens_or_stop_ids(package):
    assert forbidden_reads(REPO / package) == []


@pytest.mark.parametrize("line", [
    "x = request.min_tokens",
    "x = params.all_stop_token_ids",
    "x = request.logit_bias",
    "x = body.get('stop_token_ids')",
    "x = body['min_tokens']",
    "x = getattr(params, 'stop_token_ids')",
    "f(min_tokens=3)",
    "from vllm.sampling_params import min_tokens",
])
def test_the_source_check_finds_each_kind_of_read(tmp_path, line):
    package = tmp_path / "router"
    package.mkdir()
    (package / "clean.py").write_text("x = request.max_tokens\n")
    (package / "leak.py").write_text(f"{line}\n")
    assert forbidden_reads(package) == [f"router/leak.py:1: {line_name(line)}"]


def line_name(line: str) -> str:
    return next(name for name in sorted(FORBIDDEN, key=len, reverse=True) if name in line)
