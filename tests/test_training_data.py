"""`prepare-data`: prompt sources, target-regenerated responses, loss masks, resumption, the CLI."""

import json
import shutil

import pytest
import torch

from dspark_hf.training import data
from dspark_hf.training.data import (
    PrepareDataArguments,
    load_training_dataset,
    prepare_data,
    record_to_prompt,
    text_chunks,
)
from conftest import END_OF_TURN, char_tokenizer, learnable_target, single_thread


@pytest.fixture(autouse=True)
def _one_thread():
    with single_thread():
        yield


@pytest.fixture(scope="module")
def target():
    return learnable_target()


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _args(tmp_path, sources, **overrides):
    values = dict(prompts=sources, output_dir=str(tmp_path / "out"), max_new_tokens=12, min_loss_tokens=1,
                  batch_size=3, shard_size=2)
    values.update(overrides)
    return PrepareDataArguments(**values)


def test_record_to_prompt_reads_the_common_layouts():
    assert record_to_prompt({"turns": ["a", "b"]})["turns"] == ["a", "b"]
    chat = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Q1"},
                         {"role": "assistant", "content": "old"}, {"role": "user", "content": "Q2"}]}
    assert record_to_prompt(chat) == {"turns": ["Q1", "Q2"], "system": "S"}
    sharegpt = {"conversations": [{"from": "human", "value": "Q"}, {"from": "gpt", "value": "A"}]}
    assert record_to_prompt(sharegpt)["turns"] == ["Q"]
    assert record_to_prompt({"instruction": "Do", "input": "this"})["turns"] == ["Do\n\nthis"]
    assert record_to_prompt({"question": "Why?", "answer": "x"})["turns"] == ["Why?"]
    assert record_to_prompt({"body": "B"}, prompt_field="body")["turns"] == ["B"]
    with pytest.raises(ValueError, match="prompt_field"):
        record_to_prompt({"answer": "x"})


def test_text_chunks_split_at_line_ends():
    text = "".join(f"line {i}\n" for i in range(10))  # 7 characters per line
    chunks = list(text_chunks(text, 15))
    assert "".join(chunks) == text
    assert all(len(c) <= 15 for c in chunks) and len(chunks) == 5


def test_responses_are_the_targets_greedy_continuations_with_masks(tmp_path, target):
    tokenizer = char_tokenizer()
    records = [{"turns": ["skip me"]}] + [{"turns": [f"Question {i}?" + "!" * i]} for i in range(4)]
    args = _args(tmp_path, [_jsonl(tmp_path / "p.jsonl", records)], skip_lines=1, limit=3)
    prepare_data(args, target, tokenizer)
    dataset = load_training_dataset(args.output_dir)
    assert sorted(dataset["prompt_index"]) == [0, 1, 2]
    for example in dataset:
        ids, mask, length = example["input_ids"], example["loss_mask"], example["prompt_length"]
        messages = [{"role": "user", "content": f"Question {example['prompt_index']}?" + "!" * example["prompt_index"]}]
        prompt = tokenizer(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                           add_special_tokens=False)["input_ids"]
        assert ids[:length] == prompt and mask == [0] * length + [1] * (len(ids) - length)
        expected = target.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12, pad_token_id=0)
        response = expected[0, length:].tolist()
        if END_OF_TURN in response:
            response = response[: response.index(END_OF_TURN) + 1]
        assert ids[length:] == response  # batched, left-padded generation == one-by-one greedy
        assert example["num_loss_tokens"] == sum(mask)
        assert json.loads(example["messages"])[-1]["role"] == "assistant"


def test_finished_rows_leave_the_batch_and_every_answer_is_the_one_by_one_greedy_answer(target, monkeypatch):
    monkeypatch.setattr(data, "SEGMENT_TOKENS", 3)
    prompts = [[5, 6, 7], [9, 8, 7, 6, 5], [11, 12], [20, 21, 22, 23]]
    alone = [target.generate(torch.tensor([p]), do_sample=False, max_new_tokens=12, pad_token_id=0)[0, len(p):].tolist()
             for p in prompts]
    stop = alone[0][4]  # a token the first answer reaches after 5 tokens: it ends there, before the others

    def cut(tokens):
        return tokens[: tokens.index(stop) + 1] if stop in tokens else tokens

    batch_rows = []
    generate = target.generate
    monkeypatch.setattr(target, "generate", lambda **kw: batch_rows.append(len(kw["input_ids"])) or generate(**kw))
    responses = data.generate_responses(target, prompts, {stop}, 0, {"max_new_tokens": 12, "do_sample": False})
    assert responses == [cut(tokens) for tokens in alone]
    assert len(batch_rows) >= 2 and batch_rows[-1] < batch_rows[0]  # the first answer's row left the batch


def test_rerun_resumes_and_skips_done_prompts(tmp_path, target, monkeypatch):
    tokenizer = char_tokenizer()
    source = _jsonl(tmp_path / "p.jsonl", [{"prompt": f"P{i}"} for i in range(5)])
    prepare_data(_args(tmp_path, [source], limit=3), target, tokenizer)
    generated = []
    original = data.generate_responses
    monkeypatch.setattr(data, "generate_responses", lambda t, prompts, *a: generated.extend(prompts) or
                        original(t, prompts, *a))
    prepare_data(_args(tmp_path, [source]), target, tokenizer)
    assert len(generated) == 2  # prompts 3 and 4 only
    assert sorted(load_training_dataset(str(tmp_path / "out"))["prompt_index"]) == [0, 1, 2, 3, 4]
    prepare_data(_args(tmp_path, [source], start=1, limit=2), target, tokenizer)
    assert len(generated) == 2


def test_multi_turn_records_regenerate_every_turn(tmp_path, target, monkeypatch):
    tokenizer = char_tokenizer()
    answers = iter([[71, 72, END_OF_TURN], [73, END_OF_TURN]])
    monkeypatch.setattr(data, "generate_responses", lambda t, prompts, *a: [next(answers) for _ in prompts])
    args = _args(tmp_path, [_jsonl(tmp_path / "p.jsonl", [{"turns": ["Hi", "More"], "system": "Be brief"}])])
    prepare_data(args, target, tokenizer)
    (example,) = load_training_dataset(args.output_dir)
    messages = json.loads(example["messages"])
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant"]
    assert messages[2]["content"] == "ab"
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    ids = example["input_ids"]
    assert tokenizer.decode(ids) == rendered[: -1]  # all but the template's trailing newline
    responses = [i for i, m in enumerate(example["loss_mask"]) if m]
    assert [ids[i] for i in responses] == [71, 72, END_OF_TURN, 73, END_OF_TURN]
    assert example["prompt_length"] == responses[0]


def test_unfinished_answer_ends_the_conversation(tmp_path, target, monkeypatch):
    monkeypatch.setattr(data, "generate_responses", lambda t, prompts, *a: [[71, 72, 73] for _ in prompts])
    args = _args(tmp_path, [_jsonl(tmp_path / "p.jsonl", [{"turns": ["Hi", "More"]}])])
    prepare_data(args, target, char_tokenizer())
    (example,) = load_training_dataset(args.output_dir)
    assert sum(example["loss_mask"]) == 3 and len(json.loads(example["messages"])) == 2


def test_text_files_become_continue_prompts_and_short_answers_are_dropped(tmp_path, target):
    code = tmp_path / "lib.py"
    code.write_text("".join(f"x{i} = {i}\n" for i in range(40)))
    args = _args(tmp_path, [str(tmp_path / "*.py")], chunk_chars=100, min_loss_tokens=1)
    prepare_data(args, target, char_tokenizer())
    dataset = load_training_dataset(args.output_dir)
    assert len(dataset) == 4
    assert json.loads(dataset[0]["messages"])[0]["content"].startswith("Continue this code:\n\nx0 = 0\n")
    dropped = _args(tmp_path, [str(code)], output_dir=str(tmp_path / "none"), chunk_chars=100, min_loss_tokens=99)
    prepare_data(dropped, target, char_tokenizer())
    assert not list((tmp_path / "none").glob("*.parquet")) and list((tmp_path / "none").glob("*.done.json"))
    with pytest.raises(ValueError, match="prepare-data folder without conversations"):
        load_training_dataset(str(tmp_path / "none"))


def test_tokenizer_without_chat_template_uses_the_raw_prompt(tmp_path, target):
    tokenizer = char_tokenizer(with_template=False)
    args = _args(tmp_path, [_jsonl(tmp_path / "p.jsonl", [{"prompt": "abc"}])])
    prepare_data(args, target, tokenizer)
    (example,) = load_training_dataset(args.output_dir)
    assert example["input_ids"][: example["prompt_length"]] == tokenizer("abc")["input_ids"]


def test_cli_main(tmp_path, target, capsys):
    target.save_pretrained(tmp_path / "target")
    char_tokenizer().save_pretrained(tmp_path / "target")
    source = _jsonl(tmp_path / "p.jsonl", [{"turns": [f"Q{i}"]} for i in range(3)])
    assert data.main(["--prompts", source, "--output_dir", str(tmp_path / "out"), "--target", str(tmp_path / "target"),
                      "--max_new_tokens", "8", "--min_loss_tokens", "1", "--device", "cpu"]) == 0
    assert "3 conversations" in capsys.readouterr().out
    with pytest.raises(ValueError, match="input_ids"):
        load_training_dataset(source)


def test_dropped_conversations_are_counted_per_reason(tmp_path, target, monkeypatch, capsys):
    tokenizer = char_tokenizer()
    short = tokenizer.convert_tokens_to_ids("!")
    monkeypatch.setattr(data, "generate_responses", lambda t, prompts, *a: [
        [71, END_OF_TURN] if short in prompt else [71, 72, 73, END_OF_TURN] for prompt in prompts
    ])
    records = [{"turns": ["Hello"]}, {"turns": ["Hello!"]}, {"turns": []}, {"prompt": "x" * 120}]
    source = _jsonl(tmp_path / "p.jsonl", records)
    report = prepare_data(_args(tmp_path, [source], max_length=100, min_loss_tokens=3), target, tokenizer)
    assert report.num_written == 1 and report.num_response_tokens == 4
    assert report.dropped == {"no user turn": 1, "prompt of --max_length 100 tokens or more": 1,
                              "fewer than --min_loss_tokens 3 response tokens": 1}

    monkeypatch.setattr(data, "load_target", lambda *a, **k: (target, tokenizer))
    argv = ["--prompts", source, "--output_dir", str(tmp_path / "cli"), "--max_length", "100",
            "--min_loss_tokens", "3"]
    assert data.main(argv) == 0
    assert ("wrote 1 conversations, 4 response tokens; dropped 3 (1 fewer than --min_loss_tokens 3 response tokens, "
            "1 no user turn, 1 prompt of --max_length 100 tokens or more)") in capsys.readouterr().out


def test_workers_write_disjoint_parts_whose_union_is_the_single_run(tmp_path, target):
    tokenizer = char_tokenizer()
    source = _jsonl(tmp_path / "p.jsonl", [{"prompt": f"Prompt {i}" + "?" * i} for i in range(7)])
    prepare_data(_args(tmp_path, [source], output_dir=str(tmp_path / "one")), target, tokenizer)
    for index in (0, 1):
        prepare_data(_args(tmp_path, [source], output_dir=str(tmp_path / "two"), num_shards=2, shard_index=index),
                     target, tokenizer)
    written = [(int(path.name.split("-")[1]), i) for path in (tmp_path / "two").glob("worker-*.parquet")
               for i in load_training_dataset(str(path))["prompt_index"]]
    assert sorted(i for _, i in written) == list(range(7))  # each prompt once, none missed
    assert all(worker == i % 2 for worker, i in written)
    # a shard that a killed worker of an earlier, 4-worker run wrote but did not finish is not read
    stale = tmp_path / "two" / "worker-3-of-4.shard-00000.parquet"
    shutil.copy(next((tmp_path / "two").glob("worker-*.parquet")), stale)
    one, two = (load_training_dataset(str(tmp_path / name)).sort("prompt_index") for name in ("one", "two"))
    assert one.to_list() == two.to_list()


@pytest.mark.parametrize("argv, message", [
    (["--prompts", "/nonexistent.jsonl"], "No prompt source matches '/nonexistent.jsonl'; check --prompts"),
    (["--prompts", "p.jsonl", "--num_shards", "2"], "give both"),
    (["--prompts", "p.jsonl", "--num_shards", "2", "--shard_index", "2"], "--shard_index 2 is not in 0 .. 1"),
])
def test_cli_errors_are_one_line(tmp_path, monkeypatch, capsys, argv, message):
    monkeypatch.chdir(tmp_path)
    _jsonl(tmp_path / "p.jsonl", [{"prompt": "P"}])
    with pytest.raises(SystemExit) as exit_info:
        data.main(argv + ["--output_dir", str(tmp_path / "out")])
    stderr = capsys.readouterr().err
    error = stderr.splitlines()[-1]
    assert exit_info.value.code == 2 and "Traceback" not in stderr, stderr
    assert error.startswith("dspark-hf prepare-data: error: ") and message in error, stderr


def test_training_data_paths_that_are_not_prepared_data_name_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="No training data at '/nonexistent'; make it with `dspark-hf prep"):
        load_training_dataset("/nonexistent")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "readme.txt").write_text("hi")
    with pytest.raises(ValueError, match="no parquet shards .* `dspark-hf prepare-data` output folder"):
        load_training_dataset(str(tmp_path / "notes"))
    with pytest.raises(ValueError, match="is not training data"):
        load_training_dataset(str(tmp_path / "notes" / "readme.txt"))
