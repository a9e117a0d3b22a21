"""Helpers of the training tests (no tests here): a tiny learnable target, a character tokenizer, tau."""

from __future__ import annotations

import contextlib
import string

import torch
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from conftest import make_target


SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CHARACTERS = string.ascii_letters + string.digits + " \n.,:;!?'\"()+-*/=<>[]{}_#%&@$^|~\\`"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
END_OF_TURN = 4  # <|im_end|>


@contextlib.contextmanager
def single_thread():
    """Tiny matrices run far faster on one thread, above all on a shared 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def char_tokenizer(with_template: bool = True) -> PreTrainedTokenizerFast:
    """A character tokenizer whose vocabulary (97 ids) fits the tiny targets of conftest."""
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + sorted(set(CHARACTERS)))}
    vocab = {token: i for token, i in vocab.items() if i < 97}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<pad>"))
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>", "</s>"],
    )
    if with_template:
        tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def learnable_target(seed: int = 0, sharpness: float = 10.0):
    """A tiny Llama target with a sharpened LM head: its greedy text is a deterministic, learnable function of the
    context (a plain random tiny model is nearly uniform, so there would be little to learn)."""
    target = make_target("llama", seed=seed, eos_token_id=END_OF_TURN)
    with torch.no_grad():
        target.lm_head.weight.mul_(sharpness)
    return target


@torch.no_grad()
def self_generated_examples(target, num_examples: int, seed: int, prompt_length: int = 6, new_tokens: int = 40):
    """Random prompts continued greedily by the target: ``{"input_ids", "loss_mask", "prompt_length"}`` records."""
    generator = torch.Generator().manual_seed(seed)
    prompts = torch.randint(5, 97, (num_examples, prompt_length), generator=generator)
    output = target.generate(
        prompts, attention_mask=torch.ones_like(prompts), do_sample=False, max_new_tokens=new_tokens,
        min_new_tokens=new_tokens, pad_token_id=0,
    )
    mask = [0] * prompt_length + [1] * new_tokens
    return [{"input_ids": row.tolist(), "loss_mask": mask, "prompt_length": prompt_length} for row in output]


@torch.no_grad()
def greedy_tau(target, assistant, prompts: list[list[int]], max_new_tokens: int = 30) -> tuple[float, list]:
    """Tau over `prompts` (greedy, `assistant` as assistant_model) and the generated sequences."""
    from dspark_hf._transformers_compat import unwrap_drafter

    drafter = unwrap_drafter(assistant)
    accepted = rounds = 0
    outputs = []
    for prompt in prompts:
        input_ids = torch.tensor([prompt])
        outputs.append(target.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), assistant_model=assistant, do_sample=False,
            max_new_tokens=max_new_tokens, pad_token_id=0,
        ))
        accepted += drafter.generation_stats.accepted
        rounds += drafter.generation_stats.num_rounds
    return (accepted + rounds) / rounds, outputs


@torch.no_grad()
def greedy_outputs(target, prompts: list[list[int]], max_new_tokens: int = 30) -> list:
    outputs = []
    for prompt in prompts:
        input_ids = torch.tensor([prompt])
        outputs.append(target.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False, max_new_tokens=max_new_tokens,
            pad_token_id=0,
        ))
    return outputs
