"""Shared fixtures: tiny random targets and drafters built in-process (no downloads)."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import string
import sys
import tempfile
import types
from collections import Counter
from pathlib import Path

import pytest
import torch
from hypothesis import settings
from safetensors import safe_open
from tokenizers import Tokenizer, decoders, models
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM
from transformers import PreTrainedTokenizerFast

import dspark_hf  # noqa: F401  (installs the generate integration)
import dspark_hf.hub
from dspark_hf import DSparkDrafter, interop, testing
from dspark_hf._transformers_compat import CACHE_ARGUMENT
from dspark_hf.models import cache_dir


# Property tests draw the same examples on every run, so the suite passes or fails the same way in CI;
# `HYPOTHESIS_PROFILE=explore pytest ...` draws fresh random examples to hunt for new counterexamples.
settings.register_profile("deterministic", derandomize=True, database=None)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "deterministic"))

# Tiny models run ~10x faster single-threaded than fighting over two shared cores.
torch.set_num_threads(1)

# The default policy ("auto": hardware-aware on this machine's measured speeds) makes verification lengths depend on
# timings; tests pin the full block so that every draft is verified, and tests of "auto" unset this
# (tests/test_default_policy.py).
os.environ["DSPARK_HF_VERIFICATION_POLICY"] = "full"

# Speed profiles that tests measure on first use (tiny random targets) go to a temporary dspark-hf cache folder, not
# the user's; the user's converted models are linked into it, so the embedded target is not converted again.
_TEST_CACHE = Path(tempfile.mkdtemp(prefix="dspark-hf-tests-"))
atexit.register(shutil.rmtree, _TEST_CACHE, ignore_errors=True)  # removes the links, not what they point to
if cache_dir().is_dir():
    for _entry in cache_dir().iterdir():
        if _entry.is_dir() and _entry.name != "profiles":
            (_TEST_CACHE / _entry.name).symlink_to(_entry, target_is_directory=True)
os.environ["DSPARK_HF_CACHE"] = str(_TEST_CACHE)

# How many greedy lossless cases the case sweeps run (tests/test_lossless_sweep.py); `make test-long` raises it.
LOSSLESS_CASES = int(os.environ.get("DSPARK_HF_LOSSLESS_CASES", "1000"))
# Lossless cases run this session, by path ("greedy batch 1", ..., "sampling"), printed after the test summary.
_LOSSLESS_COUNTS: Counter = Counter()


TINY = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
TARGET_CLASSES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
}


def make_target(arch: str = "llama", seed: int = 0, **overrides) -> torch.nn.Module:
    """A tiny random decoder-only target in eval mode."""
    config_class, model_class = TARGET_CLASSES[arch]
    kwargs = {**TINY, **overrides}
    if arch == "qwen3":
        kwargs.setdefault("head_dim", kwargs["hidden_size"] // kwargs["num_attention_heads"])
    torch.manual_seed(seed)
    return model_class(config_class(**kwargs)).eval()


def make_drafter(target, seed: int = 1, **overrides) -> DSparkDrafter:
    kwargs = dict(block_size=4, num_hidden_layers=1, markov_rank=8)
    kwargs.update(overrides)
    torch.manual_seed(seed)
    return DSparkDrafter.from_target(target, **kwargs).eval()


@pytest.fixture
def target():
    return make_target()


@pytest.fixture
def drafter(target):
    return make_drafter(target)


@pytest.fixture
def modules_cache(tmp_path, monkeypatch):
    """Keeps transformers' dynamic-module copies of custom_generate/generate.py inside tmp_path."""
    import transformers.dynamic_module_utils as dynamic_module_utils

    monkeypatch.setattr(dynamic_module_utils, "HF_MODULES_CACHE", str(tmp_path / "modules"))
    monkeypatch.setattr(sys, "path", list(sys.path))


def with_cache(cache) -> dict:
    """The keyword argument that passes `cache` to a target's forward or `generate` (`past_key_values` before
    transformers 5.24)."""
    return {CACHE_ARGUMENT: cache}


def cache_of(output):
    """The cache a target's forward or `generate` returned."""
    return getattr(output, CACHE_ARGUMENT)


def left_pad(prompts: list[list[int]]) -> tuple[torch.LongTensor, torch.LongTensor]:
    """`input_ids` and `attention_mask` `(batch, longest)` of left-padded prompts (pad id 0)."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def imitate_transitions(drafter: DSparkDrafter, transitions: dict[int, int], scale: float = 50.0) -> DSparkDrafter:
    """Makes the drafter's Markov head draft `transitions[previous]` after `previous` (its bias dominates the random
    base logits); after any other token the drafter drafts its own random guess. Needs ``markov_rank == vocab_size``
    (one-hot transition codes); works for every Markov head type."""
    head, vocab = drafter.markov_head, drafter.config.vocab_size
    if head is None or drafter.config.markov_rank != vocab:
        raise ValueError(f"imitate_transitions needs markov_rank == vocab_size ({vocab}), got {drafter.config.markov_rank}")
    table = torch.zeros(vocab, vocab)
    for previous, token in transitions.items():
        table[token, previous] = scale
    with torch.no_grad():
        head.markov_w1.weight.copy_(torch.eye(vocab))
        head.markov_w2.weight.copy_(table)
        if head.head_type == "gated":  # gate wide open: bias = W2 · W1[previous]
            head.gate_proj.weight.zero_()
            head.gate_proj.bias.fill_(10.0)
        elif head.head_type == "rnn":  # out = 10 · W1[previous], so tanh(out) is (nearly) the one-hot code
            head.joint_proj.weight.zero_()
            head.joint_proj.bias.zero_()
            head.joint_proj.weight[2 * vocab :, vocab : 2 * vocab] = 10.0 * torch.eye(vocab)
    return drafter


def load_generate_module():
    """The custom_generate recipe as `dspark-hf push` writes it (the drafting module inlined, `DRAFTER` unset: pass
    the drafter explicitly), imported as a module."""
    module = types.ModuleType("dspark_custom_generate")
    sys.modules[module.__name__] = module  # dataclasses resolve the recipe's annotations through it
    exec(compile(dspark_hf.hub.custom_generate_source(), "custom_generate/generate.py", "exec"), module.__dict__)
    return module


@pytest.fixture(scope="session")
def lossless_cases() -> Counter:
    """Counts lossless cases by path: a test adds the cases it checked, e.g. ``lossless_cases["greedy batch 1"] += n``."""
    return _LOSSLESS_COUNTS


def pytest_terminal_summary(terminalreporter):
    if not _LOSSLESS_COUNTS:
        return
    greedy = {k.removeprefix("greedy "): v for k, v in _LOSSLESS_COUNTS.items() if k.startswith("greedy ")}
    parts = ", ".join(f"{path} {count}" for path, count in sorted(greedy.items()))
    terminalreporter.write_line(
        f"lossless cases: greedy {sum(greedy.values())}{f' ({parts})' if parts else ''}, "
        f"sampling {_LOSSLESS_COUNTS['sampling']}"
    )


# --- synthetic official checkpoints (tests/test_hub.py, tests/test_gemma4.py) ----------------------------------------

SYNTHETIC_PROMPT = torch.tensor([[5, 17, 42, 99, 7, 8, 9]])


def predictable_pair(tmp_path, variant="qwen3", dtype="bfloat16", reject=True, **config_kwargs):
    """A bigram target and an official-layout drafter checkpoint that drafts its greedy tokens, except after one
    token of the greedy trajectory (so verification both accepts and rejects)."""
    target = testing.synthetic_target(variant, predictable=True)
    wrong_after = []
    if reject:
        wrong_after = [int(target.generate(SYNTHETIC_PROMPT, max_new_tokens=4, do_sample=False)[0, -1])]
    path = testing.write_synthetic_checkpoint(tmp_path / f"drafter-{variant}", variant=variant, target=target,
                                              imitate_target=True, wrong_after=wrong_after, dtype=dtype,
                                              **config_kwargs)  # fmt: skip
    return target, path


def count_forwards(model):
    calls = []
    model.register_forward_hook(lambda *args: calls.append(1))
    return calls


def assert_round_trip_is_byte_identical(source: Path, saved: Path) -> None:
    """Same tensor names, dtypes and bytes; the same config keys and values (but the writer's version)."""
    original, written = interop.read_tensor_headers(source), interop.read_tensor_headers(saved)
    assert original == written
    for name, tensor in _tensors(source).items():
        assert torch.equal(tensor.view(torch.uint8), _tensors(saved)[name].view(torch.uint8)), name
    config, saved_config = (json.loads((p / "config.json").read_text()) for p in (source, saved))
    assert sorted(config) == sorted(saved_config)
    assert {k: v for k, v in config.items() if k != "transformers_version"} == {
        k: v for k, v in saved_config.items() if k != "transformers_version"
    }


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(file, framework="pt") as handle:
            tensors.update({name: handle.get_tensor(name).contiguous() for name in handle.keys()})
    return tensors


CHAIN_VOCAB = 10


class ChainDrafter:
    """A stand-in drafter for the drafting loop: drafts ``previous + 1`` (mod `CHAIN_VOCAB`) after every token; a
    slot's confidence is the row's hidden value there."""

    def confidence_logits(self, hidden_states, previous_ids):
        return hidden_states[:, 0]

    def calibrated_confidence(self, logits, slot):
        return logits  # already probabilities here

    def corrected_logits(self, draft_logits, previous_ids, hidden_states, state=None):
        return draft_logits + 100.0 * torch.nn.functional.one_hot((previous_ids + 1) % CHAIN_VOCAB, CHAIN_VOCAB), state


def drafts_for(confidences: list[list[float]], budgets, policy=None, **kwargs):
    """`sample_drafts` on a [`ChainDrafter`] whose rows' confidences are `confidences` `(rows, block)`; anchors 3, 7,
    11, ..."""
    from dspark_hf.generation.drafting import sample_drafts

    hidden = torch.tensor(confidences)[:, :, None]  # (rows, block, 1): the confidences, as hidden states
    logits = torch.zeros(len(confidences), len(confidences[0]), CHAIN_VOCAB)
    anchors = torch.arange(len(confidences)) * 4 + 3
    return sample_drafts(ChainDrafter(), hidden, logits, anchors, budgets, policy, **kwargs)


def solo(target, prompt, max_new_tokens, **kwargs):
    """The target's own greedy continuation of one prompt (a list of ids), for comparing batched rows with."""
    out = target.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=0,
                          **kwargs)
    return out[0, len(prompt):].tolist()


# --- training tests: a tiny learnable target, a character tokenizer, tau ---------------------------------------------


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
