"""transformers' own generate settings with a DSpark assistant: honoured (a fixed length, a threshold) or refused."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from transformers import GenerationConfig

from conftest import make_drafter, make_target
from dspark_hf import ThresholdPolicy
from dspark_hf.generation import batched

PROMPT = torch.tensor([[5, 9, 14, 2, 7]])


def _drafted_rounds(drafter):
    return [r for r in drafter.generation_stats.rounds if r.drafted]


def test_num_assistant_tokens_is_a_fixed_verification_length(target, drafter):
    expected = target.generate(PROMPT, do_sample=False, max_new_tokens=16)
    out = target.generate(PROMPT, assistant_model=drafter, do_sample=False, max_new_tokens=16, num_assistant_tokens=1)
    assert torch.equal(out, expected)
    rounds = _drafted_rounds(drafter)
    assert rounds and all(r.verified == 1 for r in rounds[:-1])  # the last round may be cut by max_new_tokens
    target.generate(PROMPT, assistant_model=drafter, do_sample=False, max_new_tokens=16)
    assert max(r.verified for r in _drafted_rounds(drafter)) == drafter.config.block_size  # per call, not sticky


def test_assistant_confidence_threshold_is_a_confidence_threshold(target, drafter):
    expected = target.generate(PROMPT, do_sample=False, max_new_tokens=16)
    for threshold in (0.99, 0.45):
        out = target.generate(PROMPT, assistant_model=drafter, do_sample=False, max_new_tokens=16,
                              assistant_confidence_threshold=threshold)
        assert torch.equal(out, expected)
        policy = ThresholdPolicy(threshold)
        rounds = _drafted_rounds(drafter)
        assert rounds
        for r in rounds[:-1]:
            assert r.verified == policy.verification_length(r.confidences)
    assert max(r.verified for r in rounds) > 0  # 0.45 lets some drafts through on this random drafter


def test_batched_generation_honours_the_settings(target, drafter, monkeypatch):
    seen = []
    original = batched.DSparkBatchEngine.__init__
    monkeypatch.setattr(batched.DSparkBatchEngine, "__init__",
                        lambda self, *args, **kwargs: seen.append(kwargs.get("policy")) or original(self, *args, **kwargs))
    prompts = torch.tensor([[0, 5, 9, 14], [3, 8, 1, 6]])
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    expected = target.generate(prompts, attention_mask=mask, do_sample=False, max_new_tokens=8, pad_token_id=0)
    out = target.generate(prompts, attention_mask=mask, assistant_model=drafter, do_sample=False, max_new_tokens=8,
                          pad_token_id=0, num_assistant_tokens=2)
    assert torch.equal(out, expected)
    assert [type(p).__name__ for p in seen] == ["FixedLengthPolicy"] and seen[0].length == 2


def test_num_return_sequences_samples_the_expanded_rows_in_the_batched_engine(target, drafter):
    """transformers' assisted loop refuses `num_return_sequences > 1`; with a DSpark assistant generate expands the
    prompts to that many rows each (in its order: each prompt's copies together), which the batched engine samples
    like any batch (its distribution: tests/test_sampling_exact.py, on copies of one prompt)."""
    prompts = torch.tensor([[0, 5, 9, 14], [3, 8, 1, 6]])
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    settings = dict(do_sample=True, max_new_tokens=12, pad_token_id=0)
    torch.manual_seed(3)
    out = target.generate(prompts, attention_mask=mask, assistant_model=drafter, num_return_sequences=3, **settings)
    torch.manual_seed(3)
    expected = target.generate(prompts.repeat_interleave(3, dim=0), attention_mask=mask.repeat_interleave(3, dim=0),
                               assistant_model=drafter, **settings)
    assert out.shape[0] == 6 and torch.equal(out, expected)
    assert len({tuple(row) for row in out[:3, 4:].tolist()}) > 1  # independent samples, not one sample copied
    assert len(drafter.batch_generation_stats) == 6
    with pytest.raises(ValueError, match="Greedy methods .* do not support `num_return_sequences`"):
        target.generate(prompts[:1], assistant_model=drafter, do_sample=False, num_return_sequences=2, max_new_tokens=4)


def test_text_generation_pipeline_passes_the_assistant(target, drafter):
    """`pipeline("text-generation", ..., assistant_model=drafter)`: one prompt, a batch, n samples of a prompt."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, pipeline

    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(target.config.vocab_size)}, unk_token="t3"))
    words.pre_tokenizer, words.decoder = pre_tokenizers.WhitespaceSplit(), decoders.WordPiece()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, bos_token="t1", eos_token="t2", pad_token="t0",
                                        unk_token="t3", padding_side="left")
    prompts = ["t5 t9 t14 t7", "t8 t1"]
    plain = pipeline("text-generation", model=target, tokenizer=tokenizer)
    assisted = pipeline("text-generation", model=target, tokenizer=tokenizer, assistant_model=drafter)
    settings = dict(max_new_tokens=8, do_sample=False)
    assert assisted(prompts[0], **settings) == plain(prompts[0], **settings)
    assert drafter.generation_stats.rounds
    assert assisted(prompts, batch_size=2, **settings) == plain(prompts, batch_size=2, **settings)
    assert len(drafter.batch_generation_stats) == 2  # the batched engine ran the pipeline's batch
    samples = assisted(prompts[0], max_new_tokens=8, do_sample=True, num_return_sequences=3)
    assert len(samples) == 3 and all(s["generated_text"].startswith(prompts[0]) for s in samples)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_assistant_tokens=2, assistant_confidence_threshold=0.9), "two verification policies; pass one"),
        (dict(num_assistant_tokens_schedule="heuristic"), "does not apply to a DSpark assistant"),
        (dict(num_beams=2), "num_beams=2 cannot use a DSpark assistant"),
        (dict(guidance_scale=1.5), "guidance_scale=1.5 cannot use a DSpark assistant"),
    ],
)
def test_settings_a_dspark_assistant_cannot_honour_are_refused(target, drafter, kwargs, message):
    with pytest.raises(ValueError, match=message):
        target.generate(PROMPT, assistant_model=drafter, max_new_tokens=4, **kwargs)


@pytest.mark.parametrize("output", ["output_hidden_states", "output_attentions"])
def test_per_step_hidden_states_and_attentions_are_the_targets(drafter, output):
    target = make_target(attn_implementation="eager")  # sdpa returns no attention weights
    settings = dict(attention_mask=torch.ones_like(PROMPT), max_new_tokens=8, do_sample=False, pad_token_id=0,
                    return_dict_in_generate=True, **{output: True})
    expected = target.generate(PROMPT, **settings)
    out = target.generate(PROMPT, assistant_model=make_drafter(target), **settings)
    assert torch.equal(out.sequences, expected.sequences)
    name = output.removeprefix("output_")
    steps, expected_steps = getattr(out, name), getattr(expected, name)
    assert len(steps) == len(expected_steps) == 8
    for step, expected_step in zip(steps, expected_steps):  # per token, per layer
        assert [tuple(t.shape) for t in step] == [tuple(t.shape) for t in expected_step]
        for tensor, expected_tensor in zip(step, expected_step):
            torch.testing.assert_close(tensor, expected_tensor, atol=1e-5, rtol=1e-4)


def test_empty_prompts_are_refused(target, drafter):
    with pytest.raises(ValueError, match="The prompt is empty"):
        target.generate(torch.zeros(1, 0, dtype=torch.long), assistant_model=drafter, max_new_tokens=4)
    with pytest.raises(ValueError, match="A prompt of the batch is empty"):
        target.generate(torch.tensor([[0, 0], [4, 5]]), attention_mask=torch.tensor([[0, 0], [1, 1]]),
                        assistant_model=drafter, max_new_tokens=4, pad_token_id=0)


def test_inputs_embeds_need_their_ids(target, drafter):
    """Drafts are token ids at absolute positions: embeddings alone leave the loop no prompt ids to count from."""
    prompt = torch.tensor([[5, 9, 14, 2, 7], [3, 8, 1, 6, 4]])
    embeds = target.get_input_embeddings()(prompt).detach()
    for rows in (1, 2):
        with pytest.raises(ValueError, match="inputs_embeds without input_ids.*pass input_ids="):
            target.generate(inputs_embeds=embeds[:rows], assistant_model=drafter, max_new_tokens=4, pad_token_id=0)
    settings = dict(do_sample=False, max_new_tokens=16, pad_token_id=0)
    torch.manual_seed(0)
    soft = embeds[:1] + 0.5 * torch.randn_like(embeds[:1])  # a soft prompt: not the ids' own embeddings
    expected = target.generate(input_ids=prompt[:1], inputs_embeds=soft, **settings)
    assert expected.tolist() != target.generate(input_ids=prompt[:1], **settings).tolist()
    out = target.generate(input_ids=prompt[:1], inputs_embeds=soft, assistant_model=drafter, num_assistant_tokens=3,
                          **settings)  # fmt: skip
    assert out.tolist() == expected.tolist()
    with pytest.raises(ValueError, match=r"also passes \['inputs_embeds'\], which it would ignore. Use batch size 1"):
        target.generate(input_ids=prompt, inputs_embeds=embeds, assistant_model=drafter, **settings)


def test_batched_calls_refuse_model_inputs_the_engine_would_ignore(target, drafter):
    prompt = torch.tensor([[5, 9, 14, 2, 7], [3, 8, 1, 6, 4]])
    with pytest.raises(ValueError, match=r"also passes \['output_router_logits'\], which it would ignore"):
        target.generate(prompt, assistant_model=drafter, max_new_tokens=4, pad_token_id=0, output_router_logits=True)
    if hasattr(GenerationConfig(), "assistant_ensemble_weight"):  # transformers >= 5.25
        with pytest.raises(ValueError, match="assistant_ensemble_weight .* Use batch size 1 for it"):
            target.generate(prompt, assistant_model=drafter, max_new_tokens=4, pad_token_id=0,
                            assistant_ensemble_weight=0.3)


def test_threshold_needs_a_confidence_head(target):
    drafter = make_drafter(target, enable_confidence_head=False)
    with pytest.raises(ValueError, match="needs confidences"):
        target.generate(PROMPT, assistant_model=drafter, max_new_tokens=4, assistant_confidence_threshold=0.5)


def test_models_module_is_reachable_after_import():
    code = "import dspark_hf; print(dspark_hf.models.DEFAULT_TARGET)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "smollm2-135m-instruct", result.stderr
