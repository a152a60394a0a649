"""Configurations side by side: the `--configs` and `--sweep` entries of the simulator and
the block-policy lab, parsed here once for both.

An entry is a configuration the tool names (the simulator's "power of two", the lab's
"s3fifo"), or overrides of the tool's base configuration, or a name, ` + `, overrides:

    scheduler.block_eviction=s3fifo
    power of two + scheduler.block_eviction=my_policies:KeepShared(head_blocks=4)
    router.placement=cache_aware, router.prefix_index=approximate, engine.watermark=0.05

An override is `SECTION.KEY=VALUE`, separated by commas; SECTION is `router` (the router's
settings, protocol/config.py's RouterConfig), `scheduler` (the replica scheduler's,
SchedulerConfig) or `engine` (the engine shape: num_blocks, max_num_seqs,
max_num_batched_tokens, watermark). A value is YAML (`4`, `0.5`, `true`, `[1, 2]`); a
policy is its short name or import string, with keyword arguments in parentheses
(`tenant_quota(default_quota=80)`), and `SECTION.KEY.ARG=VALUE` sets one keyword
argument of the policy already there. `--sweep PATH=V1,V2,...` runs every entry once per
value of one override: a sweep over one kwarg is one flag.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import yaml

SECTIONS = ("router", "scheduler", "engine")
# vLLM's own decision in every replica scheduler field, each one named: a field left out
# takes the registry's default (deploy.yaml's protect_shared eviction), not vLLM's.
VLLM_SCHEDULING = {"queue_order": "fcfs", "admission_gate": "vllm", "preemption": "vllm",
                   "block_eviction": "vllm", "block_retention": "vllm", "block_budget": "vllm",
                   "step_tokens": "vllm"}


@dataclass
class Variant:
    """One configuration: a label and the settings it changes, by section."""

    label: str
    base: str | None = None  # a configuration the tool names, which the overrides change
    overrides: dict[str, dict[str, Any]] = field(
        default_factory=lambda: {section: {} for section in SECTIONS})

    def applied(self, section: str, settings: dict[str, Any]) -> dict[str, Any]:
        """`settings` (one section of the base configuration) with this variant's overrides."""
        merged = copy.deepcopy(settings)
        for path, value in self.overrides[section].items():
            _set(merged, path, value)
        return merged


def split_top(text: str, separator: str = ",") -> list[str]:
    """`text` split at `separator`s outside parentheses and brackets."""
    parts, depth, current = [], 0, []
    for char in text:
        depth += char in "([{"
        depth -= char in ")]}"
        if char == separator and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
    parts.append("".join(current))
    return [part.strip() for part in parts if part.strip()]


def parse_value(text: str) -> Any:
    """A YAML value, or a policy with keyword arguments: name(key=value, ...)."""
    text = text.strip()
    if text.endswith(")") and "(" in text:
        name, _, arguments = text[:-1].partition("(")
        kwargs = {}
        for argument in split_top(arguments):
            key, equals, value = argument.partition("=")
            if not equals:
                raise ValueError(f"{text!r}: keyword arguments are key=value, not {argument!r}")
            kwargs[key.strip()] = parse_value(value)
        return {"cls": name.strip(), "kwargs": kwargs}
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def _set(settings: dict[str, Any], path: str, value: Any) -> None:
    """settings[KEY] = value, or KEY.ARG: one keyword argument of the policy at KEY."""
    key, _, argument = path.partition(".")
    if not argument:
        settings[key] = value
        return
    policy = settings.get(key)
    if policy is None:
        raise ValueError(f"{path}: no policy at {key!r} to give {argument!r} to "
                         f"(set {key}=NAME({argument}=...) instead)")
    if isinstance(policy, str):
        policy = {"cls": policy, "kwargs": {}}
    settings[key] = {**policy, "kwargs": {**policy.get("kwargs", {}), argument: value}}


def parse_override(text: str) -> tuple[str, str, Any]:
    """`SECTION.KEY=VALUE` -> (section, key path, value)."""
    path, equals, value = text.partition("=")
    section, _, key = path.strip().partition(".")
    if not equals or section not in SECTIONS or not key:
        raise ValueError(f"{text!r}: an override is SECTION.KEY=VALUE with SECTION one of "
                         f"{', '.join(SECTIONS)}")
    return section, key, parse_value(value)


def parse_entry(entry: str, named: set[str] | dict) -> Variant:
    """One `--configs` entry (module docstring); `named`: the configurations the tool names."""
    if entry in named:
        return Variant(entry, base=entry)
    base, plus, rest = entry.partition(" + ")
    if plus and base.strip() not in named:
        raise ValueError(f"{entry!r}: {base.strip()!r} is not a configuration of this tool "
                         f"({', '.join(sorted(named))})")
    variant = Variant(entry, base=base.strip() if plus else None)
    for text in split_top(rest if plus else entry):
        if "=" not in text:
            raise ValueError(f"{entry!r}: {text!r} is neither a configuration of this tool "
                             f"({', '.join(sorted(named))}) nor SECTION.KEY=VALUE")
        section, key, value = parse_override(text)
        variant.overrides[section][key] = value
    return variant


def parse_sweep(text: str) -> tuple[str, str, list[Any]]:
    """`--sweep SECTION.KEY=V1,V2,...` -> (section, key path, values)."""
    path, equals, values = text.partition("=")
    section, key, _ = parse_override(f"{path}=0")
    if not equals or not split_top(values):
        raise ValueError(f"--sweep {text!r}: give SECTION.KEY=V1,V2,...")
    return section, key, [parse_value(v) for v in split_top(values)]


def variants(entries: list[str], named: set[str] | dict, sweep: str | None = None
             ) -> list[Variant]:
    """Every `--configs` entry, once per value of `--sweep` where one is given."""
    parsed = [parse_entry(entry, named) for entry in entries]
    if not sweep:
        return parsed
    section, key, values = parse_sweep(sweep)
    swept = []
    for variant in parsed:
        for value in values:
            one = copy.deepcopy(variant)
            one.overrides[section][key] = value
            one.label = f"{variant.label}, {section}.{key}={policy_label(value)}"
            swept.append(one)
    return swept


def policy_label(value: Any) -> str:
    """A setting as an entry writes it: a policy as name(key=value, ...)."""
    if isinstance(value, dict) and "cls" in value:
        arguments = ", ".join(f"{k}={v}" for k, v in value.get("kwargs", {}).items())
        return f"{value['cls']}({arguments})" if arguments else value["cls"]
    return str(value)


BLOCK_POLICIES = ("block_eviction", "block_retention", "block_budget")


def scheduler_policies(scheduler: dict[str, Any], kinds: tuple[str, ...] = BLOCK_POLICIES
                       ) -> dict[str, str]:
    """The policies a scheduler section runs (vLLM's own where it names none)."""
    from blockserve.protocol.config import SchedulerConfig

    full = SchedulerConfig.model_validate(scheduler).model_dump(include=set(kinds))
    return {kind: policy_label(full[kind]) for kind in kinds}


def workload_kwargs(items: list[str], workloads: list[str]) -> dict[str, dict[str, Any]]:
    """`--workload-kwargs` items: `NAME:KEY=VALUE[,KEY=VALUE...]` gives one workload keyword
    arguments; a JSON object gives them to every workload (the lab's older form)."""
    given: dict[str, dict[str, Any]] = {name: {} for name in workloads}
    for item in items:
        if item.lstrip().startswith("{"):
            for name in workloads:
                given[name].update(yaml.safe_load(item))
            continue
        name, colon, rest = item.partition(":")
        if not colon or name not in given:
            raise ValueError(f"--workload-kwargs {item!r}: give NAME:KEY=VALUE with NAME one of "
                             f"this run's workloads ({', '.join(workloads)})")
        for argument in split_top(rest):
            key, equals, value = argument.partition("=")
            if not equals:
                raise ValueError(f"--workload-kwargs {item!r}: {argument!r} is not KEY=VALUE")
            given[name][key.strip()] = parse_value(value)
    return given
