"""The columns of vidur's profile CSVs that blockserve writes (tools/gpu_profile.py) and
reads (bench/gpu_profiles.py). No imports: the profiler runs on a GPU machine where only
PyTorch and transformers are installed."""

# The operators vidur sums into one layer's "linear ops" (everything but attention).
LINEAR_OPS = ("input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj",
              "post_attention_layernorm", "mlp_up_proj", "mlp_act", "mlp_down_proj", "add")
# The attention extract's columns (data/gpu-profiles/README.md), one layer, ms.
ATTENTION_COLUMNS = ("phase", "prefill_tokens", "kv_cache_size", "batch_size",
                     "attn_prefill_median_ms", "attn_decode_median_ms",
                     "attn_kv_cache_save_median_ms")
