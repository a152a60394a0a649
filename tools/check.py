"""`blockserve check CONFIG`: what a deployment of a Serve config would reject, in seconds.

1. The file is a Ray Serve config (Ray's own schema, as `serve run` reads it), and each
   blockserve application names only its two deployments and their real options.
2. Each blockserve application's `args` validate (protocol/config.py): that imports and
   builds every policy. User modules are looked up where the application's
   `runtime_env` (`local://` folders of `working_dir`, `py_modules`) puts them on Ray's
   workers.
3. Every policy runs: vLLM's real scheduler with the replica's seven policies, engine-less
   (tools/engine_less.py), for a few hundred steps of a workload that makes each hook
   fire (prefixes shared across tenants, more blocks asked than the pool holds,
   priorities), with the router's placement, queue order and output predictor deciding
   on each request. A policy that raises is reported with its traceback: a live engine
   survives it by falling back to vLLM's answer (docs/block-policies.md), but it is a bug.
"""

from __future__ import annotations

import contextlib
import random
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import yaml

APP_IMPORT_PATH = "blockserve.controller.app:build_app"
DEPLOYMENTS = ("Router", "Replica")  # what build_app binds (controller/app.py)
LOCAL_URI = "local://"  # Ray's URI of a folder that exists on every node
TINY_MODEL = Path("~/.cache/blockserve/models/tiny-llama").expanduser()
# The engine-less replica's shape where engine_args leave it to the hardware (a GPU
# config): what deploy/deploy.yaml gives one CPU replica.
SHAPE_DEFAULTS = {"num_gpu_blocks_override": 161, "block_size": 32, "max_model_len": 1024,
                  "max_num_seqs": 32}
REQUESTS = 96
MAX_STEPS = 3000
TENANTS = ("a", "b", "c")


@dataclass
class Report:
    """What a check found: lines to print, and the problems that make it fail."""

    lines: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def say(self, line: str) -> None:
        self.lines.append(line)

    def problem(self, message: str) -> None:
        self.problems.append(message)


def check(path: Path, model_dir: str | None = None) -> Report:
    report = Report()
    try:
        serve_config = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        report.problem(f"cannot read {path}: {exc}")
        return report
    try:
        from ray.serve.schema import ServeDeploySchema
        ServeDeploySchema.model_validate(serve_config)
    except Exception as exc:  # pydantic's ValidationError, or a TypeError on odd input
        report.problem(f"{path} is not a Ray Serve config: {exc}")
        return report
    apps = [app for app in serve_config["applications"]
            if app.get("import_path") == APP_IMPORT_PATH]
    if not apps:
        report.problem(f"{path} has no application with import_path {APP_IMPORT_PATH}")
    for app in apps:
        check_app(app, report, model_dir)
    return report


def check_app(app: dict, report: Report, model_dir: str | None) -> None:
    from ray.serve.schema import DeploymentSchema

    from blockserve.protocol.config import parse_app_config

    name = app.get("name", "default")
    for deployment in app.get("deployments") or []:
        if deployment.get("name") not in DEPLOYMENTS:
            report.problem(f"application {name!r}: no deployment {deployment.get('name')!r} "
                           f"(a blockserve application has {list(DEPLOYMENTS)})")
        unknown = sorted(set(deployment) - set(DeploymentSchema.model_fields))
        if unknown:
            report.problem(f"application {name!r}, deployment {deployment.get('name')!r}: "
                           f"unknown options {unknown}")
    with on_path(runtime_env_paths(app.get("runtime_env") or {})):
        try:
            config = parse_app_config(app.get("args") or {})
        except ValueError as exc:
            report.problem(f"application {name!r}: {exc}")
            return
        report.say(f"application {name!r}:")
        for line in chosen_policies(config):
            report.say(f"  {line}")
        try:
            run_policies(config, report, model_dir)
        except Exception:  # the engine-less replica itself could not run this config
            report.problem(f"application {name!r}: the engine-less run failed:\n"
                           f"{traceback.format_exc()}")


def runtime_env_paths(runtime_env: dict) -> list[str]:
    """The folders of a runtime_env's `local://` URIs (`working_dir`, `py_modules`), which
    Ray puts on the workers' Python path as they are. A Serve config accepts no other
    local path (Ray's schema says so above); remote URIs are not fetched here."""
    uris = [runtime_env.get("working_dir"), *(runtime_env.get("py_modules") or [])]
    return [uri.removeprefix(LOCAL_URI) for uri in uris
            if isinstance(uri, str) and uri.startswith(LOCAL_URI)]


@contextlib.contextmanager
def on_path(paths: list[str]):
    sys.path[:0] = paths
    try:
        yield
    finally:
        del sys.path[:len(paths)]


def chosen_policies(config: Any) -> list[str]:
    from blockserve.protocol.config import PolicyRef

    lines = []
    for section, model in (("router", config.router), ("replica.scheduler",
                                                        config.replica.scheduler)):
        for key in type(model).model_fields:
            ref = getattr(model, key)
            if isinstance(ref, PolicyRef):
                kwargs = f" {ref.kwargs}" if ref.kwargs else ""
                lines.append(f"{section}.{key}: {ref.cls} -> {ref.import_path}{kwargs}")
    return lines


class RouterPolicies:
    """The router's policies, asked about each request as the router would ask them;
    the first exception of each is kept."""

    def __init__(self, config: Any, block_size: int, max_model_len: int):
        from blockserve.router.demand import DemandEstimator

        self.placement = config.router.placement.build()
        self.queue_order = config.router.queue_order.build()
        self.estimator = DemandEstimator(None, config.router.output_predictor.build())
        self.block_size, self.max_model_len = block_size, max_model_len
        self.errors: dict[str, str] = {}

    def ask(self, field: str, call: Callable[[], Any]) -> Any:
        try:
            return call()
        except Exception:
            self.errors.setdefault(field, traceback.format_exc())
            return None

    def place(self, prompt: list[int], max_tokens: int, view: Any, snapshot: Any) -> None:
        from blockserve.router.placement import Candidate

        demand = self.ask("router.output_predictor", lambda: self.estimator.of_tokens(
            [prompt], 1, max_tokens, self.block_size, self.max_model_len,
            tenant=view.tenant, priority=view.priority))
        if demand is None:
            return
        busy = Candidate("replica-0", snapshot.total_blocks, snapshot.free_blocks, 0,
                         snapshot.running + snapshot.waiting,
                         snapshot.held_blocks / max(1, snapshot.total_blocks),
                         snapshot.cached_blocks)
        idle = Candidate("replica-1", snapshot.total_blocks, snapshot.total_blocks, 0, 0, 0.0)
        chosen = self.ask("router.placement", lambda: self.placement.choose(demand, [busy, idle]))
        if chosen not in (None, busy.replica_id, idle.replica_id):
            self.errors.setdefault("router.placement", f"choose() returned {chosen!r}, "
                                   "neither None nor a candidate's replica_id")
        self.ask("router.queue_order", lambda: (self.queue_order.key(view, view.arrival),
                                                self.queue_order.on_admitted(view, view.arrival)))

    def finished(self, view: Any, prompt_tokens: int, output_tokens: int, now: float) -> None:
        self.ask("router.queue_order", lambda: self.queue_order.on_finished(
            view, view.demand_blocks, view.arrival, now))
        self.ask("router.output_predictor", lambda: self.estimator.predictor.on_finished(
            prompt_tokens, view.tenant, output_tokens))


def run_policies(config: Any, report: Report, model_dir: str | None) -> None:
    """Drive the replica's and the router's policies engine-less (module docstring)."""
    from blockserve.protocol.hints import Hints
    from blockserve.replica.scheduler import BlockAwareScheduler
    from blockserve.tools.engine_less import EngineLessReplica

    model = model_dir or (config.replica.model if Path(config.replica.model, "config.json")
                          .exists() else str(TINY_MODEL))
    if not Path(model, "config.json").exists():
        report.problem(f"no local model for the engine-less run ({config.replica.model} is "
                       "not a local checkpoint, nor is the tiny model there): pass --model-dir "
                       "or run `make setup`")
        return
    engine = {**SHAPE_DEFAULTS, **config.replica.engine_args}
    defaulted = sorted(set(SHAPE_DEFAULTS) - set(config.replica.engine_args))
    shape = dict(num_blocks=int(engine["num_gpu_blocks_override"]),
                 block_size=int(engine["block_size"]),
                 max_model_len=int(engine["max_model_len"]),
                 max_num_seqs=int(engine["max_num_seqs"]))
    started = time.perf_counter()
    rep = EngineLessReplica(model, BlockAwareScheduler, **shape,
                            scheduler=config.replica.scheduler.model_dump())
    router = RouterPolicies(config, shape["block_size"], shape["max_model_len"])
    scheduler, rng = rep.scheduler, random.Random(0)
    prefixes = {t: [rng.randrange(1, 4000) for _ in range(shape["block_size"] * (3 + i))]
                for i, t in enumerate(TENANTS)}
    shared = [rng.randrange(1, 4000) for _ in range(shape["block_size"] * 2)]
    room = shape["max_model_len"] // 2
    steps = preemptions = 0

    def step() -> None:
        nonlocal steps, preemptions
        record = rep.step()
        steps, preemptions = steps + 1, preemptions + len(record.preempted)
        for request_id in record.finished:
            request = rep.requests[request_id]
            router.finished(scheduler.view(request), request.num_prompt_tokens,
                            request.num_output_tokens, time.time())

    for i in range(REQUESTS):
        tenant = TENANTS[i % len(TENANTS)]
        head = shared + prefixes[tenant] if i % 2 else prefixes[tenant]
        prompt = (head + [rng.randrange(1, 4000)
                          for _ in range(rng.randint(8, room // 2))])[:room]
        max_tokens = rng.randint(4, room // 2)
        request = rep.add(f"check-{i}", prompt, max_tokens,
                          hints=Hints(tenant=tenant, priority=i % 3, admission_seq=i + 1))
        router.place(prompt, max_tokens, scheduler.view(request), scheduler.snapshot)
        if i % 8 == 7:  # arrivals in waves: a queue to order, then a pool to fill
            for _ in range(4):
                step()
    while scheduler.has_unfinished_requests() and steps < MAX_STEPS:
        step()
    seconds = time.perf_counter() - started
    snap = scheduler.snapshot
    report.say(f"  engine-less run ({model}; {shape['num_blocks'] - 1} blocks of "
               f"{shape['block_size']} tokens"
               + (f", {defaulted} not in engine_args: {SHAPE_DEFAULTS}" if defaulted else "")
               + f"): {REQUESTS} requests, {steps} steps in {seconds:.1f} s, "
               f"{preemptions} preemptions, {snap.cached_blocks_evicted_total} cached blocks "
               f"evicted, {snap.blocks_spared_total} spared, {snap.blocks_sent_first_total} "
               f"sent first, {snap.admissions_refused_total} admissions refused")
    if scheduler.has_unfinished_requests():
        report.problem(f"the engine-less replica did not drain in {MAX_STEPS} steps: the "
                       "replica's policies starve requests")
    errors = scheduler.policy_errors
    for policy_field, count in errors.counts.items():
        if count:
            report.problem(f"replica.scheduler.{policy_field} ({errors.names[policy_field]}) "
                           f"raised {count} times; a live engine falls back to vLLM's "
                           f"answer each time. First:\n{errors.first[policy_field]}")
    for policy_field, trace in router.errors.items():
        report.problem(f"{policy_field} failed:\n{trace}")


def main(path: str, model_dir: str | None = None) -> int:
    report = check(Path(path), model_dir)
    print("\n".join(report.lines))
    for message in report.problems:
        print(f"problem: {message}", file=sys.stderr)
    print(f"{path}: " + (f"{len(report.problems)} problem(s)" if report.problems else "ok"))
    return 1 if report.problems else 0
