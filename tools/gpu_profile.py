"""Profile one transformer layer of a Llama-3-8B-shaped model (random weights, built from
its config: nothing downloaded) per operator, and write vidur's CSV formats, which
bench/gpu_presets.py fits (`--h200-profile DIR`).

    python tools/gpu_profile.py --out data/gpu-profiles/h200   (on a GPU; minutes)
    python -m blockserve.tools.gpu_profile --tiny --device cpu --out /tmp/p   (the CPU path)

Like vidur it times one layer's operators at each batch size in tokens (mlp.csv: the
linear ops and the embedding) and its attention (attention.csv: prefills of one request,
decode steps of b requests at K tokens of context, and the write of the new K/V into a
cache), median of `--repeats` CUDA-event timings. Attention is PyTorch SDPA over
contiguous K/V (no paged kernel: what this profiles is SDPA, not vLLM's FlashAttention).
QKV and gate/up are one matrix product each, as vLLM fuses them.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

try:
    from blockserve.tools.vidur_format import ATTENTION_COLUMNS
except ImportError:  # `python tools/gpu_profile.py` on a GPU machine without blockserve installed
    from vidur_format import ATTENTION_COLUMNS

# Meta-Llama-3-8B's published config.json (the shape only).
LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                 num_key_value_heads=8, head_dim=128, vocab_size=128256,
                 max_position_embeddings=16384, rope_theta=500000.0, rms_norm_eps=1e-5)
TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=256,
            rms_norm_eps=1e-5)
PREFILL_TOKENS = (128, 256, 512, 1024, 2048, 4096, 8192, 16384)
DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
DECODE_CONTEXTS = (512, 1024, 2048, 4096, 8192, 16384)
MAX_DECODE_KV_TOKENS = 2 ** 21  # b x K cap: 8 GiB of one layer's K and V at Llama-3-8B's shape


class Timer:
    """Median milliseconds of a callable: CUDA events on a GPU, perf_counter on a CPU."""

    def __init__(self, device: torch.device, repeats: int, warmup: int = 3):
        self.device, self.repeats, self.warmup = device, repeats, warmup

    def __call__(self, run: Callable[[], object]) -> float:
        for _ in range(self.warmup):
            run()
        times = []
        for _ in range(self.repeats):
            if self.device.type == "cuda":
                start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                start.record()
                run()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            else:
                started = time.perf_counter()
                run()
                times.append((time.perf_counter() - started) * 1e3)
        return statistics.median(times)


class Layer:
    """One decoder layer's weights, random, in the engine's layout."""

    def __init__(self, config: LlamaConfig, device: torch.device, dtype: torch.dtype):
        def weight(rows: int, cols: int) -> torch.Tensor:
            return torch.randn(rows, cols, device=device, dtype=dtype) * 0.02

        self.config, self.device, self.dtype = config, device, dtype
        hidden, head_dim = config.hidden_size, config.head_dim
        self.q_size = config.num_attention_heads * head_dim
        self.kv_size = config.num_key_value_heads * head_dim
        self.embedding = weight(config.vocab_size, hidden)
        self.qkv = weight(self.q_size + 2 * self.kv_size, hidden)
        self.o = weight(hidden, self.q_size)
        self.gate_up = weight(2 * config.intermediate_size, hidden)
        self.down = weight(hidden, config.intermediate_size)
        self.norm = torch.ones(hidden, device=device, dtype=dtype)
        self.rotary = LlamaRotaryEmbedding(config).to(device)

    def rms_norm(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.float().pow(2).mean(-1, keepdim=True)
        normed = x.float() * torch.rsqrt(variance + self.config.rms_norm_eps)
        return normed.to(x.dtype) * self.norm

    def linear_ops(self, tokens: int, timer: Timer) -> dict[str, float]:
        """Each linear op of one layer, and the embedding, on `tokens` tokens, ms."""
        c = self.config
        ids = torch.randint(0, c.vocab_size, (tokens,), device=self.device)
        x = torch.randn(tokens, c.hidden_size, device=self.device, dtype=self.dtype)
        qkv = x @ self.qkv.T
        q = qkv[:, :self.q_size].view(1, tokens, c.num_attention_heads, c.head_dim).transpose(1, 2)
        k = qkv[:, self.q_size:self.q_size + self.kv_size].view(
            1, tokens, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        cos, sin = self.rotary(x[None], torch.arange(tokens, device=self.device)[None])
        attended = torch.randn(tokens, self.q_size, device=self.device, dtype=self.dtype)
        gate_up = x @ self.gate_up.T
        act = F.silu(gate_up[:, :c.intermediate_size]) * gate_up[:, c.intermediate_size:]
        return {
            "emb": timer(lambda: F.embedding(ids, self.embedding)),
            "input_layernorm": timer(lambda: self.rms_norm(x)),
            "attn_pre_proj": timer(lambda: x @ self.qkv.T),
            "attn_rope": timer(lambda: apply_rotary_pos_emb(q, k, cos, sin)),
            "attn_post_proj": timer(lambda: attended @ self.o.T),
            "post_attention_layernorm": timer(lambda: self.rms_norm(x)),
            "mlp_up_proj": timer(lambda: x @ self.gate_up.T),
            "mlp_act": timer(lambda: F.silu(gate_up[:, :c.intermediate_size])
                             * gate_up[:, c.intermediate_size:]),
            "mlp_down_proj": timer(lambda: act @ self.down.T),
            "add": timer(lambda: x + x),
        }

    def _heads(self, batch: int, length: int, heads: int) -> torch.Tensor:
        return torch.randn(batch, heads, length, self.config.head_dim,
                           device=self.device, dtype=self.dtype)

    def kv_save(self, tokens: int, timer: Timer) -> float:
        """Writing `tokens` tokens' new K and V into a slot-indexed cache, ms."""
        shape = (tokens, self.config.num_key_value_heads, self.config.head_dim)
        cache = torch.zeros((2, tokens * 2) + shape[1:], device=self.device, dtype=self.dtype)
        new = torch.randn((2,) + shape, device=self.device, dtype=self.dtype)
        slots = torch.randperm(tokens * 2, device=self.device)[:tokens]
        return timer(lambda: cache.index_copy_(1, slots, new))

    def prefill_attention(self, tokens: int, timer: Timer) -> float:
        c = self.config
        q = self._heads(1, tokens, c.num_attention_heads)
        k, v = (self._heads(1, tokens, c.num_key_value_heads) for _ in range(2))
        return timer(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                            enable_gqa=True))

    def decode_attention(self, batch: int, context: int, timer: Timer) -> float:
        c = self.config
        q = self._heads(batch, 1, c.num_attention_heads)
        k, v = (self._heads(batch, context, c.num_key_value_heads) for _ in range(2))
        return timer(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))


def profile(layer: Layer, timer: Timer, prefill_tokens, decode_batches, decode_contexts,
            max_kv_tokens: int) -> tuple[list[dict], list[dict]]:
    """vidur's mlp.csv rows (per batch size in tokens) and attention rows."""
    c = layer.config
    shape = {"n_head": c.num_attention_heads, "n_kv_head": c.num_key_value_heads,
             "n_embd": c.hidden_size, "n_expanded_embd": c.intermediate_size,
             "vocab_size": c.vocab_size, "use_gated_mlp": True}
    mlp = [{**{f"time_stats.{op}.median": ms for op, ms in layer.linear_ops(n, timer).items()},
            **shape, "num_tokens": n, "num_tensor_parallel_workers": 1}
           for n in sorted(set(prefill_tokens) | set(decode_batches))]
    attention = [dict(zip(ATTENTION_COLUMNS, ("prefill", n, 0, 1,
                                              layer.prefill_attention(n, timer), 0,
                                              layer.kv_save(n, timer))))
                 for n in prefill_tokens]
    attention += [dict(zip(ATTENTION_COLUMNS, ("decode", 0, context, batch, 0,
                                               layer.decode_attention(batch, context, timer),
                                               layer.kv_save(batch, timer))))
                  for batch in decode_batches for context in decode_contexts
                  if batch * context <= max_kv_tokens]
    return mlp, attention


def write_csv(path: Path, rows: list[dict]) -> None:
    with open(path, "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for mlp.csv and attention.csv")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a tiny config (the CPU test)")
    parser.add_argument("--prefill", type=int, nargs="+", default=PREFILL_TOKENS)
    parser.add_argument("--batches", type=int, nargs="+", default=DECODE_BATCHES)
    parser.add_argument("--contexts", type=int, nargs="+", default=DECODE_CONTEXTS)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = LlamaConfig(num_hidden_layers=1, **(TINY if args.tiny else LLAMA3_8B))
    torch.manual_seed(0)
    with torch.inference_mode():
        mlp, attention = profile(Layer(config, device, dtype), Timer(device, args.repeats),
                                 args.prefill, args.batches, args.contexts, MAX_DECODE_KV_TOKENS)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "mlp.csv", mlp)
    write_csv(out / "attention.csv", attention)
    print(f"{len(mlp)} linear-ops rows, {len(attention)} attention rows -> {out}")


if __name__ == "__main__":
    main()
