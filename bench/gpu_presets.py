"""GPU step-time presets fitted to measured profiles, and their held-out errors.

    python -m blockserve.bench.gpu_presets --out docs/results/gpu_presets

Each preset is a `StepTimeModel` (bench/step_time.py) and an engine shape. The fit is a
non-negative least-squares fit of the model's terms to whole-model steps composed from
vidur's profiles by vidur's rule (bench/gpu_profiles.py), on relative error, each phase
(prefill rows, decode rows) weighing equally; every 5th row is held out and the preset's
error is reported on those. The prefill knee is chosen on the training rows alone.
The 32B preset is derived, not fitted: the measured H100 7B fit scaled term by term by
the ratio of its roofline quantity (FLOPs, bytes), as llm-d's BLIS does; the same
derivation for Llama-2-70B is checked against Splitwise's measured runs (never fitted
to them). docs/simulator.md says what each preset can be trusted for.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import statistics
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from blockserve.bench import gpu_profiles as profiles
from blockserve.bench.gpu_profiles import Attention, LinearOps, ProfileRow
from blockserve.bench.gpu_shapes import (A100_80GB, BLOCK_SIZE, H100_80GB, H200, LLAMA2_70B,
                                         LLAMA2_7B, LLAMA3_8B, QWEN3_32B, ModelShape,
                                         kv_capacity_tokens, scheduler_model_dir)
from blockserve.bench.step_time import StepBatch, StepTimeModel
from blockserve.tools.launch import EngineShape

HOLD_OUT_EVERY = 5
KNEE_CANDIDATES = range(0, 513, 16)


def features(batch: StepBatch, knee: int) -> list[float]:
    """The model's terms in StepTimeModel's field order."""
    return [1.0, max(0, batch.prefill_tokens - knee), batch.decode_tokens,
            batch.prefill_attention, batch.decode_attention]


def nnls(matrix: np.ndarray, target: np.ndarray) -> tuple[np.ndarray, float]:
    """Non-negative least squares, exactly: the best unconstrained fit over every subset
    of the (five) terms whose coefficients all come out non-negative."""
    best = (np.zeros(matrix.shape[1]), float(target @ target))
    for size in range(1, matrix.shape[1] + 1):
        for subset in itertools.combinations(range(matrix.shape[1]), size):
            coefficients = np.linalg.lstsq(matrix[:, subset], target, rcond=None)[0]
            if (coefficients >= 0).all():
                residual = matrix[:, subset] @ coefficients - target
                if residual @ residual < best[1]:
                    full = np.zeros(matrix.shape[1])
                    full[list(subset)] = coefficients
                    best = (full, float(residual @ residual))
    return best


def fit_rows(rows: list[ProfileRow]) -> StepTimeModel:
    """The model and knee that minimise the rows' squared relative error, each phase's
    rows weighted to count as much as the other's."""
    counts = {phase: sum(row.phase == phase for row in rows) for phase in ("prefill", "decode")}
    weights = np.array([1 / (row.seconds * counts[row.phase] ** 0.5) for row in rows])
    target = np.array([row.seconds for row in rows]) * weights
    best = None
    for knee in KNEE_CANDIDATES:
        matrix = np.array([features(row.batch, knee) for row in rows]) * weights[:, None]
        coefficients, residual = nnls(matrix, target)
        if best is None or residual < best[0]:
            best = (residual, knee, coefficients)
    _, knee, (base, prefill, decode, prefill_attention, decode_attention) = best
    return StepTimeModel(float(base), float(prefill), float(decode),
                         float(prefill_attention), float(decode_attention), knee)


def relative_errors(model: StepTimeModel, rows: list[ProfileRow]) -> list[float]:
    return [abs(model(row.batch) - row.seconds) / row.seconds for row in rows]


def error_summary(model: StepTimeModel, rows: list[ProfileRow]) -> dict:
    """Relative errors on the rows: all of them and each phase's."""
    summary = {}
    for phase in ("all", "prefill", "decode"):
        errors = relative_errors(model, [r for r in rows if phase in ("all", r.phase)])
        if errors:
            summary[phase] = {"rows": len(errors), "median": statistics.median(errors),
                              "p90": float(np.percentile(errors, 90)), "max": max(errors)}
    return summary


def held_out_fit(rows: list[ProfileRow]) -> tuple[StepTimeModel, dict]:
    """Fit on all rows but every HOLD_OUT_EVERY-th; its errors on those and on the rest."""
    held = [row for i, row in enumerate(rows) if i % HOLD_OUT_EVERY == HOLD_OUT_EVERY - 1]
    train = [row for i, row in enumerate(rows) if i % HOLD_OUT_EVERY != HOLD_OUT_EVERY - 1]
    model = fit_rows(train)
    return model, {"held_out": error_summary(model, held),
                   "training": error_summary(model, train)}


def fit_profile(directory: Path, layers: int = 32) -> tuple[StepTimeModel, dict]:
    """A preset from tools/gpu_profile.py's output (its mlp.csv and attention.csv)."""
    return held_out_fit(profiles.compose(LinearOps.read(directory / "mlp.csv"),
                                         Attention.read(directory / "attention.csv"), layers))


@dataclass(frozen=True)
class Efficiency:
    """What a GPU's measured linear ops reach: bytes/s when one token's step reads the
    weights, FLOP/s at the largest profiled batch."""

    bandwidth: float
    flops: float

    @classmethod
    def of(cls, linear: LinearOps, model: ModelShape) -> "Efficiency":
        one, largest = 1, max(linear.layer_ms)
        return cls(model.linear_weight_bytes() / (linear.step_ms(one, model.layers) * 1e-3),
                   model.linear_flops_per_token() * largest
                   / (linear.step_ms(largest, model.layers) * 1e-3))


def h100_attention(a100: Efficiency, h100: Efficiency) -> tuple[Attention, dict]:
    """vidur's A100 Llama-3-8B attention as Llama-2-7B's on H100: prefill attention
    (compute-bound; the same query heads and head dim) by the two GPUs' measured
    FLOP/s; decode attention (memory-bound) by the KV bytes per token (Llama-2-7B has
    4x the KV heads) and the measured bandwidths; KV writes by the bandwidths alone (the
    profiled write moves about 8 GB/s, far below either GPU's bandwidth: its cost is per
    token, not per byte)."""
    bandwidth = a100.bandwidth / h100.bandwidth
    factors = {
        "prefill_attention_factor": (LLAMA2_7B.attention_flops_per_pair()
                                     / LLAMA3_8B.attention_flops_per_pair()
                                     * a100.flops / h100.flops),
        "decode_attention_factor": (LLAMA2_7B.kv_bytes_per_token()
                                    / LLAMA3_8B.kv_bytes_per_token() * bandwidth),
        "kv_save_factor": bandwidth}
    attention = Attention.read(profiles.A100_LLAMA3_8B_ATTENTION).scaled(*factors.values())
    return attention, factors


def derive(measured: StepTimeModel, source: ModelShape, target: ModelShape, tp: int,
           save_per_token_layer_s: float) -> StepTimeModel:
    """Roofline scaling of a measured fit to another model and tensor-parallel degree on
    the same GPU, the fit's efficiencies carried over: the floor by the linear weight
    bytes each GPU reads; token terms by linear FLOPs per token per GPU, less the KV
    write (`save_per_token_layer_s`, per token and layer), which scales by layers;
    prefill attention by its FLOPs per pair per GPU; decode attention by KV bytes per
    token per GPU. The knee (the GPU's ridge point, FLOP/s over bytes/s) stays. Not
    modelled: TP all-reduces, the LM head."""
    flops = target.linear_flops_per_token(tp) / source.linear_flops_per_token()
    linear_per_token = measured.per_prefill_token_s - source.layers * save_per_token_layer_s
    return StepTimeModel(
        measured.base_s * target.linear_weight_bytes(tp) / source.linear_weight_bytes(),
        linear_per_token * flops + target.layers * save_per_token_layer_s,
        measured.per_decode_token_s * flops,
        measured.per_prefill_attention_s
        * target.attention_flops_per_pair(tp) / source.attention_flops_per_pair(),
        measured.per_decode_attention_s
        * target.kv_bytes_per_token(tp) / source.kv_bytes_per_token(),
        measured.prefill_knee_tokens)


# Each preset's model and hardware: (model, GPU, tensor-parallel degree).
ENGINES = {"a100-llama3-8b": (LLAMA3_8B, A100_80GB, 1),
           "h100-llama2-7b": (LLAMA2_7B, H100_80GB, 1),
           "h100x2-qwen3-32b": (QWEN3_32B, H100_80GB, 2),
           "h200-llama3-8b": (LLAMA3_8B, H200, 1)}


def engine_fields(preset: str, max_model_len: int | None = None) -> dict:
    """The replica vLLM would build for the preset's model on its GPUs, with vLLM's
    defaults (bench/gpu_shapes.py); max_model_len defaults to the model's own."""
    model, gpu, tp = ENGINES[preset]
    return dict(model_name=model.name,
                num_blocks=kv_capacity_tokens(model, gpu, tp) // BLOCK_SIZE,
                block_size=BLOCK_SIZE,
                max_model_len=max_model_len or model.max_position_embeddings,
                max_num_seqs=gpu.max_num_seqs, max_num_batched_tokens=gpu.max_num_batched_tokens)


def engine_shape(preset: str, max_model_len: int | None = None) -> EngineShape:
    """The preset's EngineShape, for the simulator's engine-less replicas."""
    fields = engine_fields(preset, max_model_len)
    return EngineShape(model=scheduler_model_dir(fields["max_model_len"]), **fields)


def describe(name: str, model: StepTimeModel, errors: dict | None, sources: list[str],
             assumptions: list[str], **extra) -> dict:
    shape_model, gpu, tp = ENGINES[name]
    engine = engine_fields(name)
    return {"model": dataclasses.asdict(model), "errors": errors, "sources": sources,
            "assumptions": assumptions, "hardware": f"{tp} x {gpu.name}",
            "checkpoint": shape_model.name,
            "engine": {**engine, "watermark": 0.0, "enable_chunked_prefill": True,
                       "kv_tokens": engine["num_blocks"] * BLOCK_SIZE}, **extra}


def kv_write_facts(attention: Attention, rows: list[ProfileRow], model: ModelShape) -> dict:
    """How fast the profile's KV write moves bytes, and its share of the longest prefill."""
    save = attention.save_per_token_s()
    longest = max((row for row in rows if row.phase == "prefill"),
                  key=lambda row: row.batch.prefill_tokens)
    return {"bytes_per_s": model.kv_bytes_per_token() / model.layers / save,
            "share_of_longest_prefill": (model.layers * save * longest.batch.prefill_tokens
                                         / longest.seconds),
            "longest_prefill_tokens": longest.batch.prefill_tokens}


NOT_IN_STEP = "no LM head, sampling or CPU overhead (vidur's composition leaves them out)"


def fit_all(h200_profile: Path | None = None) -> dict:
    """Every preset from the profiles, with its errors, sources and assumptions."""
    a100_linear = LinearOps.read(profiles.A100_LLAMA3_8B_MLP)
    h100_linear = LinearOps.read(profiles.H100_LLAMA2_7B_MLP)
    a100_attention = Attention.read(profiles.A100_LLAMA3_8B_ATTENTION)
    a100_rows = profiles.compose(a100_linear, a100_attention, LLAMA3_8B.layers)
    a100_model, a100_errors = held_out_fit(a100_rows)
    a100, h100 = Efficiency.of(a100_linear, LLAMA3_8B), Efficiency.of(h100_linear, LLAMA2_7B)
    attention, factors = h100_attention(a100, h100)
    h100_model, h100_errors = held_out_fit(profiles.compose(h100_linear, attention,
                                                            LLAMA2_7B.layers))
    save = attention.save_per_token_s()
    llama70 = derive(h100_model, LLAMA2_7B, LLAMA2_70B, 2, save)
    splitwise = profiles.splitwise_rows(profiles.SPLITWISE, "llama2-70b", "h100-80gb", 2)
    results = {
        "a100-llama3-8b": describe("a100-llama3-8b", a100_model, a100_errors, sources=[
            "vidur A100 Meta-Llama-3-8B mlp.csv (TP1 linear ops, measured)",
            "vidur A100 Meta-Llama-3-8B attention.csv, 34-row extract (measured)"], assumptions=[
            "prefill attention between profiled chunk lengths interpolated log-log",
            "prefill attention measured with no context before the chunk only: the "
            "context term is the same per-pair cost (chunk x (context + chunk/2))",
            "the profile's KV write (FlashInfer, about 0.5 us per token and layer, 16% of a "
            "16k-token prefill) is charged as profiled", NOT_IN_STEP],
            kv_write=kv_write_facts(a100_attention, a100_rows, LLAMA3_8B)),
        "h100-llama2-7b": describe("h100-llama2-7b", h100_model, h100_errors, sources=[
            "vidur H100 Llama-2-7b-hf mlp.csv (TP1 linear ops, measured)",
            "vidur A100 Meta-Llama-3-8B attention extract, scaled (NOT measured on H100)"],
            assumptions=[
            f"prefill attention = A100's x {factors['prefill_attention_factor']:.3f}: the "
            "A100/H100 ratio of the FLOP/s each profile's linear ops reach at its largest batch",
            f"decode attention = A100's x {factors['decode_attention_factor']:.3f}: "
            "Llama-2-7B's 4x KV bytes per token times the A100/H100 ratio of the bandwidth "
            "each profile's one-token step reaches reading its weights",
            f"KV writes = A100's x {factors['kv_save_factor']:.3f}, the bandwidth ratio alone "
            "(the profiled write moves ~8 GB/s: a per-token cost, not a per-byte one)",
            "linear ops profiled to 4,096 tokens only: prefill rows stop there", NOT_IN_STEP],
            efficiency={"a100": dataclasses.asdict(a100), "h100": dataclasses.asdict(h100)},
            **factors),
        "h100x2-qwen3-32b": describe(
            "h100x2-qwen3-32b", derive(h100_model, LLAMA2_7B, QWEN3_32B, 2, save), None,
            sources=["derived from the h100-llama2-7b fit (roofline scaling, "
                     "bench.gpu_presets.derive)"], assumptions=[
            "floor by linear weight bytes per GPU; token terms by linear FLOPs per token per "
            "GPU (the KV write by layers); prefill attention by FLOPs per query-key pair per "
            "GPU; decode attention by KV bytes per token per GPU: the 7B's measured "
            "efficiencies carry over",
            "TP2 all-reduces, the LM head, sampling and CPU overhead are not modelled",
            "checked (not fitted) by the same derivation for Llama-2-70B TP2 against "
            "Splitwise's measured H100 runs: llama2_70b_check"]),
        "llama2_70b_check": {
            "model": dataclasses.asdict(llama70),
            "rows": "Splitwise perf_model.csv, llama2-70b, h100-80gb, TP2: prompt_time as one "
                    "prefill step of the batch, token_time as one decode step at prompt + "
                    "half the output (medians of repeats)",
            "errors": error_summary(llama70, splitwise),
            "predictions": [{"phase": row.phase, "requests": len(row.batch.prefill)
                             or row.batch.decode_tokens,
                             "tokens_each": (row.batch.prefill or [(0, 0)])[0][0]
                             or row.batch.decode_contexts[0],
                             "measured_s": row.seconds, "predicted_s": llama70(row.batch)}
                            for row in splitwise]},
    }
    if h200_profile:
        model, errors = fit_profile(h200_profile, LLAMA3_8B.layers)
        results["h200-llama3-8b"] = describe("h200-llama3-8b", model, errors, sources=[
            f"python tools/gpu_profile.py on one H200 ({h200_profile}: measured)"],
            assumptions=["PyTorch SDPA over contiguous K/V and an index_copy_ KV write, "
                         "not vLLM's kernels", NOT_IN_STEP])
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="docs/results/gpu_presets")
    parser.add_argument("--h200-profile", type=Path,
                        help="tools/gpu_profile.py's output folder: adds h200-llama3-8b")
    args = parser.parse_args()
    results = fit_all(args.h200_profile)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(f"{args.out}.json").write_text(json.dumps(results, indent=1) + "\n")
    for name, result in results.items():
        errors = result["errors"]
        if errors:
            errors = errors.get("held_out", errors)["all"]
            print(f"{name}: median {errors['median']:.1%}, p90 {errors['p90']:.1%} "
                  f"({errors['rows']} rows)")
        print(f"  {name} = {StepTimeModel(**result['model'])!r}")


if __name__ == "__main__":
    main()
