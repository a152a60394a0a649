"""Cross-check of the block-policy lab against a real vLLM engine (the tiny model, CPU).

    flock /tmp/blockserve-heavy.lock python -m blockserve.bench.block_lab_engine \\
        [--workload shared_prefix] [--requests 120] [--workload-kwargs '{"tenants": 16}']

The same requests go, all at once and in the same order, to (a) the lab's engine-less
replica and (b) vLLM's offline `LLM` with deploy/deploy.yaml's engine arguments and the
block-aware scheduler (`scheduler_cls`) under the same block policy. Output lengths are
known to both (`max_tokens` = the true length, `ignore_eos`), so both see the same
scheduling problem; they differ in that the real model computes (and writes real output
tokens). Printed and saved: vLLM's prefix-cache hit rate from each side (the real one
from the engine's own `vllm:prefix_cache_hits` / `vllm:prefix_cache_queries`).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from blockserve.bench.block_lab import built_in_configs, replay
from blockserve.bench.step_time import PRESETS
from blockserve.bench.workloads import WORKLOADS, LengthMode, Lengths, RequestSpec
from blockserve.protocol.config import ADDITIONAL_CONFIG_KEY, SCHEDULER_CLS, SchedulerConfig
from blockserve.protocol.hints import Hints
from blockserve.tools.launch import EngineShape, load_config

TOLERANCE = 0.02  # absolute difference in hit rate accepted as "the same"


def engine_hit_rate(specs: list[RequestSpec], scheduler: dict, shape: EngineShape) -> float:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    engine_args = dict(load_config()["applications"][0]["args"]["replica"]["engine_args"])
    engine_args.update(
        num_gpu_blocks_override=shape.num_blocks, scheduler_cls=SCHEDULER_CLS,
        additional_config={ADDITIONAL_CONFIG_KEY: SchedulerConfig.model_validate(
            scheduler).model_dump()},
        enable_prefix_caching=True, disable_log_stats=False)
    llm = LLM(model=shape.model, skip_tokenizer_init=True, **engine_args)
    try:
        llm.generate([TokensPrompt(prompt_token_ids=list(s.prompt)) for s in specs],
                     [SamplingParams(max_tokens=s.output_tokens, ignore_eos=True,
                                     detokenize=False,
                                     extra_args=Hints(tenant=s.tenant).to_xargs())
                      for s in specs], use_tqdm=False)
        counters = {m.name: m.value for m in llm.get_metrics()
                    if m.name in ("vllm:prefix_cache_hits", "vllm:prefix_cache_queries")}
    finally:
        llm.llm_engine.engine_core.shutdown()
    return counters["vllm:prefix_cache_hits"] / counters["vllm:prefix_cache_queries"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="shared_prefix", choices=sorted(WORKLOADS))
    parser.add_argument("--requests", type=int, default=120)
    parser.add_argument("--workload-kwargs", type=json.loads, default={})
    parser.add_argument("--configs", nargs="+", default=["vllm (LRU)", "s3fifo"])
    parser.add_argument("--out", default="docs/results/block_lab_engine.json")
    args = parser.parse_args()
    shape = EngineShape.of()
    specs = WORKLOADS[args.workload](n=args.requests, seed=0, **args.workload_kwargs)
    configs = built_in_configs(shape.usable_blocks)
    rows = {}
    for name in args.configs:
        lab = replay(specs, configs[name], shape, PRESETS["cpu-tiny"], time_scale=0.0,
                     lengths=Lengths(LengthMode.KNOWN, shape.max_model_len))
        real = engine_hit_rate(specs, configs[name], shape)
        rows[name] = {"lab_hit_rate": lab.prefix_hit_rate, "engine_hit_rate": real,
                      "within_tolerance": abs(lab.prefix_hit_rate - real) <= TOLERANCE}
        print(f"{name:24} lab {lab.prefix_hit_rate:.4f}  engine {real:.4f}", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "command": "python -m blockserve.bench.block_lab_engine " + shlex.join(sys.argv[1:]),
        "tolerance": TOLERANCE, "engine": shape.__dict__, "results": rows}, indent=2))


if __name__ == "__main__":
    main()
