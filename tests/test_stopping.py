"""Stop strings, custom stopping criteria and logits processors give what the target's own `generate` gives.

A speculative round commits several tokens at once; transformers' assisted loop asks the stopping criteria once per
round, so a stop string completed inside a round was missed (generation ran on past it). Here rounds are made to
commit whole blocks (a drafter that predicts the target perfectly), so a stop inside a round is certain.
"""

from __future__ import annotations

import random
import string

import pytest
import torch
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast, StoppingCriteria, StoppingCriteriaList
from transformers.generation import BaseStreamer

from conftest import cache_of, imitate_transitions, left_pad, make_drafter, make_target
from test_perfect_drafter import VOCAB, lookup_table_target, perfect_drafter


LETTERS = string.ascii_lowercase + " .,;:!"  # id i is LETTERS[i]; the lookup-table target writes i + 1 after i


def letter_tokenizer() -> PreTrainedTokenizerFast:
    assert len(LETTERS) == VOCAB
    backend = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(LETTERS)}, merges=[]))
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token=" ")


class EndsWith(StoppingCriteria):
    """Stops a row whose last tokens are `tail` (a custom criterion, a function of the tokens)."""

    def __init__(self, tail: list[int]):
        self.tail = tail

    def __call__(self, input_ids, scores, **kwargs):
        n = len(self.tail)
        return torch.tensor([row[-n:].tolist() == self.tail for row in input_ids], device=input_ids.device)


class Recorder(BaseStreamer):
    def __init__(self):
        self.values = []

    def put(self, value):
        self.values.append(value.reshape(-1).clone())

    def end(self):
        self.values.append(None)


@pytest.fixture
def pair():
    target = lookup_table_target()
    return target, perfect_drafter(target, block_size=5)


def ids(text: str) -> list[int]:
    return [LETTERS.index(c) for c in text]


@pytest.mark.parametrize("do_sample", [False, True])
@pytest.mark.parametrize("stop", ["ghi", "jk", "p"])
def test_a_stop_string_inside_a_round_ends_generation_there(pair, stop, do_sample):
    target, drafter = pair
    tokenizer = letter_tokenizer()
    prompt = torch.tensor([ids("abc")])
    kwargs = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=30, do_sample=do_sample, stop_strings=stop,
                  tokenizer=tokenizer, pad_token_id=0)
    expected = target.generate(prompt, **kwargs)
    assert tokenizer.decode(expected[0, 3:]).endswith(stop)  # the target stops at the stop string
    out = target.generate(prompt, assistant_model=drafter, **kwargs)
    assert out.tolist() == expected.tolist()
    assert max(drafter.generation_stats.accept_lengths) == 5  # whole blocks were accepted: the stop fell inside one


def test_a_custom_criterion_stops_at_its_token_and_the_streamer_gets_no_more(pair):
    target, drafter = pair
    prompt = torch.tensor([ids("ab")])
    criteria = StoppingCriteriaList([EndsWith(ids("jkl"))])
    kwargs = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=30, do_sample=False,
                  stopping_criteria=criteria, pad_token_id=0)
    expected = target.generate(prompt, **kwargs)
    assert expected[0].tolist() == ids("abcdefghijkl")
    streamed = Recorder()
    out = target.generate(prompt, assistant_model=drafter, streamer=streamed, **kwargs)
    assert out.tolist() == expected.tolist()
    assert streamed.values[-1] is None and torch.cat(streamed.values[:-1]).tolist() == expected[0].tolist()


def test_per_step_outputs_are_cut_with_the_sequence(pair):
    target, drafter = pair
    prompt = torch.tensor([ids("ab")])
    kwargs = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=30, do_sample=False,
                  stopping_criteria=StoppingCriteriaList([EndsWith(ids("hi"))]),
                  pad_token_id=0, return_dict_in_generate=True, output_scores=True, output_logits=True)
    expected = target.generate(prompt, **kwargs)
    out = target.generate(prompt, assistant_model=drafter, **kwargs)
    assert out.sequences.tolist() == expected.sequences.tolist()
    assert len(out.scores) == len(out.logits) == len(expected.scores) == expected.sequences.shape[1] - 2
    assert cache_of(out).get_seq_length() == out.sequences.shape[1] - 1  # cropped with the cut: resumable


@pytest.mark.parametrize("prompt_lookup_num_tokens", [None, 4])
def test_batched_rows_stop_at_their_own_stop_strings(pair, prompt_lookup_num_tokens):
    target, drafter = pair
    tokenizer = letter_tokenizer()
    input_ids, mask = left_pad([ids("abc"), ids("mn"), ids("wxyz ")])
    # an EOS no row reaches before its stop: transformers pads a stopped row only when there is one (otherwise the
    # row decodes on while others do; the engine always ends it)
    kwargs = dict(attention_mask=mask, max_new_tokens=24, do_sample=False, stop_strings=["ghi", "rs", "c"],
                  tokenizer=tokenizer, pad_token_id=0, eos_token_id=ids("t")[0])
    expected = target.generate(input_ids, **kwargs)
    out = target.generate(input_ids, assistant_model=drafter, prompt_lookup_num_tokens=prompt_lookup_num_tokens,
                          **kwargs)
    assert out.tolist() == expected.tolist()
    assert expected.shape[1] - input_ids.shape[1] < 24  # every row stopped early, at its own string


def test_batched_return_dict_gives_sequences_and_refuses_per_step_outputs(pair):
    target, drafter = pair
    input_ids, mask = left_pad([ids("abc"), ids("mn")])
    kwargs = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    expected = target.generate(input_ids, **kwargs)
    out = target.generate(input_ids, assistant_model=drafter, return_dict_in_generate=True, **kwargs)
    assert out.sequences.tolist() == expected.tolist()
    with pytest.raises(ValueError, match="this call asks for output_scores=True"):
        target.generate(input_ids, assistant_model=drafter, return_dict_in_generate=True, output_scores=True, **kwargs)


def test_batched_max_time_ends_every_row_with_a_prefix_of_its_output(pair):
    target, drafter = pair
    input_ids, mask = left_pad([ids("abc"), ids("mn")])
    kwargs = dict(attention_mask=mask, max_new_tokens=40, do_sample=False, pad_token_id=0)
    full = target.generate(input_ids, **kwargs)
    out = target.generate(input_ids, assistant_model=drafter, max_time=0.0, **kwargs)
    assert input_ids.shape[1] < out.shape[1] < full.shape[1]  # one round, then time is up
    assert out.tolist() == full[:, : out.shape[1]].tolist()


# Processors that read a row's length or its padding, or the row's index in the batch: batched rows are verified one
# at a time, and each must see what transformers' own loop shows it (the padded row, its batch index).
def _allowed(batch_id, sent):
    return list(range(5, 60)) if batch_id == 0 else list(range(40, 97))


PROCESSOR_SETTINGS = {
    "repetition_penalty": dict(repetition_penalty=1.5),
    "min_new_tokens": dict(min_new_tokens=8),
    "min_length": dict(min_length=14),
    "no_repeat_ngram_size": dict(no_repeat_ngram_size=2),
    "prefix_allowed_tokens_fn": dict(prefix_allowed_tokens_fn=_allowed),
    "exponential_decay_length_penalty": dict(exponential_decay_length_penalty=(2, 1.5)),
    "begin_suppress_tokens": dict(begin_suppress_tokens=[3, 71]),
}


@pytest.mark.parametrize("name", PROCESSOR_SETTINGS)
def test_batched_logits_processors_see_each_row_as_generate_does(name):
    target = make_target()
    drafter = make_drafter(target)
    input_ids, mask = left_pad([[5, 9], [3, 8, 1, 6, 22, 40], [7, 7, 30, 2, 11]])
    plain = target.generate(input_ids, attention_mask=mask, do_sample=False, max_new_tokens=12, pad_token_id=0)
    eos = plain[0, input_ids.shape[1] + 3].item()  # an EOS the most padded row reaches early: the length rules bite
    kwargs = dict(attention_mask=mask, do_sample=False, max_new_tokens=12, pad_token_id=0, eos_token_id=eos,
                  **PROCESSOR_SETTINGS[name])
    expected = target.generate(input_ids, **kwargs)
    out = target.generate(input_ids, assistant_model=drafter, **kwargs)
    assert out.tolist() == expected.tolist()


@pytest.mark.parametrize("seed", range(40))
def test_random_settings_give_the_targets_own_output(seed):
    """Random combinations of processors, stopping, EOS, prompt lookup and fixed lengths, at batch 1 to 3 (left
    padded), with a drafter that drafts the target's own transitions after some tokens."""
    rng = random.Random(seed)
    target = make_target(seed=seed)
    drafter = make_drafter(target, seed=seed + 1, markov_rank=97)
    start = torch.tensor([[rng.randrange(3, 97) for _ in range(4)]])
    greedy = target.generate(start, attention_mask=torch.ones_like(start), max_new_tokens=30, min_new_tokens=30,
                             do_sample=False, pad_token_id=0)[0].tolist()
    imitate_transitions(drafter, dict(zip(greedy, greedy[1:])))
    prompts = [[rng.randrange(3, 97) for _ in range(rng.randrange(1, 7))] for _ in range(rng.choice([1, 2, 3]))]
    prompts[0] = greedy[:4] if rng.random() < 0.5 else prompts[0]
    input_ids, mask = left_pad(prompts)
    settings = dict(attention_mask=mask, do_sample=False, max_new_tokens=rng.randrange(4, 24), pad_token_id=0,
                    eos_token_id=greedy[rng.randrange(4, 12)] if rng.random() < 0.4 else 2)
    optional = {
        "repetition_penalty": rng.choice([1.2, 1.5]), "min_new_tokens": rng.randrange(1, 10),
        "no_repeat_ngram_size": rng.choice([2, 3]), "begin_suppress_tokens": [greedy[4]],
        "bad_words_ids": [[greedy[6]]],
        "stopping_criteria": StoppingCriteriaList([EndsWith([greedy[rng.randrange(4, 20)]])]),
    }
    settings.update({name: value for name, value in optional.items() if rng.random() < 0.35})
    speculation = {}
    if rng.random() < 0.4:
        speculation["prompt_lookup_num_tokens"] = rng.choice([2, 5])
    if rng.random() < 0.3:
        speculation["num_assistant_tokens"] = rng.choice([1, 2, 3])
    expected = target.generate(input_ids, **settings)
    out = target.generate(input_ids, assistant_model=drafter, **settings, **speculation)
    assert out.tolist() == expected.tolist(), (sorted(settings), speculation)


def test_engine_requests_bring_their_own_stop_strings(pair):
    from transformers import StopStringCriteria

    from dspark_hf.generation.batched import DSparkBatchEngine

    target, drafter = pair
    tokenizer = letter_tokenizer()
    engine = DSparkBatchEngine(target, drafter, policy="full", pad_token_id=0)
    stops = {"abc": "ghi", "mn": "q", "wxyz ": None}  # the last runs to its budget
    requests = {prompt: engine.add_request(ids(prompt), 20, stopping_criteria=None if stop is None else
                                           StoppingCriteriaList([StopStringCriteria(tokenizer, [stop])]))
                for prompt, stop in stops.items()}
    engine.run()
    for prompt, stop in stops.items():
        text = tokenizer.decode(requests[prompt].output_ids)
        expected = "".join(LETTERS[(LETTERS.index(prompt[-1]) + k) % VOCAB] for k in range(1, 21))
        expected = expected[: expected.index(stop) + len(stop)] if stop else expected[:20]
        assert text == expected
