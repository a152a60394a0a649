"""The models and GPUs the step-time presets describe: what their roofline quantities
(weight bytes, FLOPs, KV bytes per token) and vLLM's engine defaults on them are.

Model shapes are the models' published Hugging Face configs. GPU memory is the total
`nvidia-smi` reports for each card (published figures, not measured here). vLLM's
defaults are read in vLLM 0.33.0's sources (cited where used).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

GIB = 2 ** 30
DTYPE_BYTES = 2  # bf16/fp16 weights and KV cache (vLLM's "auto" for these checkpoints)
BLOCK_SIZE = 16  # vLLM 0.33.0 vllm/config/cache.py CacheConfig.DEFAULT_BLOCK_SIZE
# vLLM 0.33.0 vllm/config/cache.py: CacheConfig.gpu_memory_utilization defaults to 0.92
# (not the 0.9 of earlier releases).
GPU_MEMORY_UTILIZATION = 0.92
# Assumed, not measured: per GPU, what vLLM's profile run (activations of one
# max_num_batched_tokens forward pass), CUDA graphs and non-torch allocations (cuBLAS,
# NCCL) take before the KV cache is sized.
ACTIVATION_ALLOWANCE_GIB = 2.0


@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    max_position_embeddings: int

    @property
    def layer_linear_params(self) -> int:
        """QKV, O and the gated MLP of one layer (what vidur's linear ops multiply by)."""
        attention = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        return attention + 3 * self.hidden * self.intermediate

    @property
    def params(self) -> int:
        """Linear layers plus input embedding and LM head (untied); norms are negligible."""
        return self.layers * self.layer_linear_params + 2 * self.vocab * self.hidden

    def weight_bytes(self, tp: int = 1) -> float:
        return self.params * DTYPE_BYTES / tp

    def linear_weight_bytes(self, tp: int = 1) -> float:
        """What one step's linear ops read: every layer's weights, once."""
        return self.layers * self.layer_linear_params * DTYPE_BYTES / tp

    def linear_flops_per_token(self, tp: int = 1) -> float:
        return 2 * self.layers * self.layer_linear_params / tp

    def attention_flops_per_pair(self, tp: int = 1) -> float:
        """QK^T and PV for one query-key pair, every layer and head."""
        return 4 * self.layers * self.heads * self.head_dim / tp

    def kv_bytes_per_token(self, tp: int = 1) -> float:
        """2 (K and V) x layers x KV heads x head dim x dtype bytes, per GPU."""
        return 2 * self.layers * self.kv_heads * self.head_dim * DTYPE_BYTES / tp


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_gib: float
    # vLLM 0.33.0 vllm/engine/arg_utils.py EngineArgs.get_batch_defaults, the
    # OPENAI_API_SERVER context (vLLM's API server, which the replicas run): GPUs of
    # >= 70 GiB other than A100 get 8192 tokens and 1024 sequences; A100 stays on
    # 2048 and 256 (vLLM PR #17885: larger batches cost A100 throughput). Chunked
    # prefill is on: _set_default_chunked_prefill_and_prefix_caching_args enables it
    # wherever the model supports it (every decoder-only model here).
    max_num_batched_tokens: int
    max_num_seqs: int


LLAMA3_8B = ModelShape("meta-llama/Meta-Llama-3-8B", 32, 4096, 32, 8, 128, 14336, 128256, 8192)
LLAMA2_7B = ModelShape("meta-llama/Llama-2-7b-hf", 32, 4096, 32, 32, 128, 11008, 32000, 4096)
LLAMA2_70B = ModelShape("meta-llama/Llama-2-70b-hf", 80, 8192, 64, 8, 128, 28672, 32000, 4096)
# The model of llm-d's precise-prefix benchmark (llm-d-benchmark's KubeCon scenario).
QWEN3_32B = ModelShape("Qwen/Qwen3-32B", 64, 5120, 64, 8, 128, 25600, 151936, 40960)

A100_80GB = Gpu("A100-SXM4-80GB", 81920 / 1024, 2048, 256)
H100_80GB = Gpu("H100-80GB-HBM3", 81559 / 1024, 8192, 1024)
H200 = Gpu("H200", 143771 / 1024, 8192, 1024)


def kv_capacity_tokens(model: ModelShape, gpu: Gpu, tp: int = 1) -> int:
    """KV tokens one replica holds: per GPU, its memory x vLLM's utilisation, less its
    share of the weights and the activation allowance, over its KV bytes per token."""
    free_gib = (gpu.memory_gib * GPU_MEMORY_UTILIZATION - model.weight_bytes(tp) / GIB
                - ACTIVATION_ALLOWANCE_GIB)
    return int(free_gib * GIB // model.kv_bytes_per_token(tp))


def scheduler_model_dir(max_model_len: int, root: Path | None = None) -> str:
    """A config-only model directory for the engine-less replica: vLLM's scheduler needs
    a model config whose context admits `max_model_len`, never weights; a tiny Llama
    config with that many positions (generated, nothing downloaded)."""
    root = root or Path.home() / ".cache" / "blockserve" / "models"
    directory = root / f"scheduler-only-{max_model_len}"
    config = directory / "config.json"
    if not config.exists():
        directory.mkdir(parents=True, exist_ok=True)
        config.write_text(json.dumps({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 32,
            "vocab_size": 4096, "max_position_embeddings": max_model_len,
            "rms_norm_eps": 1e-5, "hidden_act": "silu", "tie_word_embeddings": True,
            "bos_token_id": 0, "eos_token_id": 0, "dtype": "float32"}, indent=1))
    return str(directory)
