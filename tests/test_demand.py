"""The router's block demand (router/demand.py) with the model's real tokenizer and vLLM's
own request models; for n > 1, against vLLM's real KV cache manager (engine-less)."""

import copy

import pytest
from transformers import AutoTokenizer
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest

from blockserve.replica.scheduler import BlockAwareScheduler
from blockserve.router.demand import DemandEstimator, MaxTokensPredictor, Rejected
from blockserve.tools.engine_less import EngineLessReplica

BLOCK, MAX_LEN = 32, 1024
MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "the quick brown fox " * 20}]


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def estimator(tokenizer):
    return DemandEstimator(tokenizer, MaxTokensPredictor(default_tokens=100))


def chat(**fields):
    return ChatCompletionRequest.model_validate({"model": "m", "messages": MESSAGES, **fields})


def test_chat_prompt_is_counted_through_the_chat_template(tokenizer, estimator):
    rendered = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True,
                                             tokenize=False)
    assert "<|assistant|>" in rendered  # the tiny model's own template, not a fallback
    expected = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    demand = estimator.chat(chat(max_tokens=40), BLOCK, MAX_LEN, priority=2, tenant="t")
    assert demand.prompt_tokens == len(expected)
    assert demand.expected_output == 40 and demand.sequences == 1
    assert demand.blocks == -(-(len(expected) + 40) // BLOCK)
    assert (demand.priority, demand.tenant) == (2, "t")
    assert len(demand.prefix_hashes) == len(expected) // BLOCK
    # Content given as text parts counts as vLLM renders it: the parts joined by newlines.
    parts = [{**m, "content": [{"type": "text", "text": half} for half in
                               (m["content"][:7], m["content"][7:])]} for m in MESSAGES]
    as_parts = estimator.chat(ChatCompletionRequest.model_validate(
        {"model": "m", "messages": parts, "max_tokens": 40}), BLOCK, MAX_LEN)
    joined = [{**m, "content": f"{m['content'][:7]}\n{m['content'][7:]}"} for m in MESSAGES]
    rendered = tokenizer.apply_chat_template(joined, add_generation_prompt=True,
                                             tokenize=False)
    expected = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert as_parts.prompt_tokens == len(expected) != demand.prompt_tokens


def test_chat_without_a_usable_template_counts_the_text(tokenizer):
    untemplated = copy.deepcopy(tokenizer)
    untemplated.chat_template = None  # transformers refuses to render: the fallback runs
    with pytest.raises(ValueError):
        untemplated.apply_chat_template(MESSAGES, add_generation_prompt=True)
    estimator = DemandEstimator(untemplated, MaxTokensPredictor())
    demand = estimator.chat(chat(max_completion_tokens=8), BLOCK, MAX_LEN)
    text = "\n".join(m["content"] for m in MESSAGES)
    assert demand.prompt_tokens == len(untemplated.encode(text))
    assert demand.expected_output == 8  # max_completion_tokens counts like max_tokens


def test_expected_output_defaults_and_is_bounded_by_the_context(estimator):
    assert estimator.chat(chat(), BLOCK, MAX_LEN).expected_output == 100  # the default
    short = estimator.chat(chat(), BLOCK, 200)  # only room for what the context leaves
    assert short.expected_output == 200 - short.prompt_tokens
    with pytest.raises(Rejected) as too_long:
        estimator.chat(chat(max_tokens=1000), BLOCK, MAX_LEN)
    assert too_long.value.status == 400 and too_long.value.param == "max_tokens"
    with pytest.raises(Rejected) as prompt_too_long:
        estimator.completion(CompletionRequest.model_validate(
            {"model": "m", "prompt": list(range(1, MAX_LEN + 1))}), BLOCK, MAX_LEN)
    assert prompt_too_long.value.param == "messages"


def test_completion_prompts_text_token_ids_and_lists(tokenizer, estimator):
    def completion(prompt, **fields):
        return estimator.completion(CompletionRequest.model_validate(
            {"model": "m", "prompt": prompt, "max_tokens": 10, **fields}), BLOCK, MAX_LEN)

    text = "def main():\n    return 1\n"
    assert completion(text).prompt_tokens == len(tokenizer.encode(text))
    assert completion([5, 6, 7]).prompt_tokens == 3
    # Several prompts: one sequence each (times n), sized by the longest.
    several = completion([[1] * 10, [2] * 70], n=2)
    assert several.sequences == 4 and several.prompt_tokens == 70


@pytest.mark.parametrize("prompt_tokens", [40, 64, 100])
@pytest.mark.parametrize("n", [2, 3])
def test_n_sequences_take_the_blocks_vllm_gives_them(model_dir, estimator, prompt_tokens, n):
    """n > 1: vLLM runs n requests of one prompt that share its cached full blocks (all
    but a last block the prompt fills exactly, which vLLM recomputes). The router's
    demand must equal the most blocks vLLM's own KV cache manager holds for them."""
    prompt = list(range(1, prompt_tokens + 1))
    demand = estimator.completion(CompletionRequest.model_validate(
        {"model": "m", "prompt": prompt, "max_tokens": 50, "n": n}), BLOCK, MAX_LEN)
    replica = EngineLessReplica(model_dir, BlockAwareScheduler, num_blocks=65,
                                block_size=BLOCK)
    for i in range(n):  # how vLLM's serving layer fans out n: one request per sequence
        replica.add(f"seq{i}", prompt, 50)
    peak = 0
    while replica.scheduler.has_unfinished_requests():
        replica.step()
        peak = max(peak, replica.scheduler.snapshot.held_blocks)
    assert demand.sequences == n
    assert demand.blocks == peak
