"""Build the embedded default model: a tiny random-weight Llama and a local BPE tokenizer.

Nothing is downloaded. The tokenizer is trained on the Python standard library's own
sources, the weights are random (seeded), so the model loads and runs in vLLM like any
Hugging Face checkpoint but its text is gibberish. It exists so that the whole serving
stack (scheduler, KV blocks, routing) runs for real on a CPU-only machine. Point
`model:` in the deployment config at a real checkpoint for meaningful output.

    python -m blockserve.tools.tiny_model [OUT_DIR]   (default: deploy/deploy.yaml's model)
"""

from __future__ import annotations

import argparse
import glob
import os
import sysconfig
import time

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]


def _corpus(max_bytes: int = 8_000_000) -> list[str]:
    """Local training text that exists wherever Python does: the stdlib sources."""
    files, total = [], 0
    for path in sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py"))):
        files.append(path)
        total += os.path.getsize(path)
        if total >= max_bytes:
            break
    return files


def build_tokenizer(out_dir: str, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train(_corpus(), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        unk_token="<|endoftext|>",
        pad_token="<|pad|>",
        additional_special_tokens=SPECIAL_TOKENS[2:],
        model_max_length=4096,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return fast


def build_model(out_dir: str, tokenizer, hidden: int, layers: int, heads: int) -> int:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=hidden // heads,  # vLLM's CPU attention needs 32, 64, 80, 96, 112 or 128+
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(out_dir, safe_serialization=True)
    GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    ).save_pretrained(out_dir)
    return sum(p.numel() for p in model.parameters())


def deployed_model_dir() -> str:
    from blockserve.tools.launch import app_config  # reads deploy/deploy.yaml

    return app_config().replica.model


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", nargs="?", help="default: deploy/deploy.yaml's model")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    args = parser.parse_args(argv)
    out_dir = os.path.expanduser(args.out_dir or deployed_model_dir())
    start = time.time()
    staging = out_dir + ".partial"
    os.makedirs(staging, exist_ok=True)
    tokenizer = build_tokenizer(staging, args.vocab)
    params = build_model(staging, tokenizer, args.hidden, args.layers, args.heads)
    if os.path.isdir(out_dir):
        import shutil

        shutil.rmtree(out_dir)
    os.replace(staging, out_dir)  # a half-built model never looks finished
    print(f"tiny model: {params / 1e6:.2f}M params, vocab {len(tokenizer)}, "
          f"{time.time() - start:.1f}s -> {out_dir}")


if __name__ == "__main__":
    main()
