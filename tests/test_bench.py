"""`dspark-hf bench`: prompt files, multi-turn chat assembly, round accounting and a tiny end-to-end run."""

from __future__ import annotations

import json

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from conftest import TINY, make_drafter, make_target
from dspark_hf.benchmarks import (
    BenchMethod,
    BenchSettings,
    acceptance_by_position,
    build_methods,
    load_prompts,
    load_steps_per_second,
    read_prompt_file,
    render_conversation,
    rounds_from_forward_calls,
    run_benchmark,
    run_conversation,
)
from dspark_hf.benchmarks import bench as bench_module
from dspark_hf.benchmarks import merge as merge_module
from dspark_hf.benchmarks.methods import measure_generation, generation_kwargs
from dspark_hf.benchmarks.prompts import conversation_messages, select_per_category


CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|> {{ message['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL = ["<pad>", "<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>"]


def make_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer whose vocabulary fills the tiny models' 97 ids, with a chat template."""
    words = [f"w{i}" for i in range(TINY["vocab_size"] - len(SPECIAL))]
    vocab = {token: index for index, token in enumerate(SPECIAL + words)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        additional_special_tokens=["<|user|>", "<|assistant|>"],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


@pytest.fixture
def prompt_files(tmp_path):
    plain = write_jsonl(tmp_path / "chat.jsonl", [
        {"turns": ["w1 w2 w3 w1 w2 w3", "w4 w5"]},
        {"turns": ["w6 w7 w8"]},
        {"turns": ["w9 w10"]},
    ])
    spec_bench = write_jsonl(tmp_path / "question.jsonl", [
        {"question_id": 81, "category": "writing", "turns": ["w11 w12", "w13"]},
        {"question_id": 82, "category": "math", "turns": ["w14 w15 w16"]},
        {"question_id": 83, "category": "writing", "turns": ["w17"]},
    ])
    return plain, spec_bench


# --- prompt files -----------------------------------------------------------------------------------------------


def test_plain_turns_file_takes_category_from_file_stem(prompt_files):
    prompts = read_prompt_file(prompt_files[0])
    assert [p.category for p in prompts] == ["chat"] * 3
    assert [p.prompt_id for p in prompts] == ["chat-1", "chat-2", "chat-3"]
    assert prompts[0].turns == ("w1 w2 w3 w1 w2 w3", "w4 w5")


def test_spec_bench_file_keeps_question_id_and_category(prompt_files):
    prompts = read_prompt_file(prompt_files[1])
    assert [(p.prompt_id, p.category) for p in prompts] == [("81", "writing"), ("82", "math"), ("83", "writing")]


def test_start_and_limit_apply_per_category(prompt_files):
    prompts = load_prompts(prompt_files, start=1, limit=1)
    assert [p.prompt_id for p in prompts] == ["chat-2", "83"]
    assert len(select_per_category(load_prompts(prompt_files), limit=1)) == 3  # chat, writing, math


def test_bad_records_name_the_line(tmp_path):
    with pytest.raises(ValueError, match="bad-1"):
        read_prompt_file(write_jsonl(tmp_path / "bad.jsonl", [{"turns": []}]))
    with pytest.raises(ValueError, match="No prompts selected"):
        load_prompts([write_jsonl(tmp_path / "one.jsonl", [{"turns": ["w1"]}])], start=5)


def test_real_eval_files_parse_if_present():
    from pathlib import Path

    eval_dir = Path("/work/shared/data/eval")
    if not eval_dir.is_dir():
        pytest.skip("shared eval prompts not on this machine")
    prompts = load_prompts(sorted(eval_dir.glob("*.jsonl")), limit=2)
    assert {p.category for p in prompts} >= {"gsm8k", "mt-bench"}
    assert all(len(p.turns) == 2 for p in prompts if p.category == "mt-bench")


# --- multi-turn chat assembly -----------------------------------------------------------------------------------


def test_conversation_messages_interleave_answers():
    messages = conversation_messages(["q1", "q2", "q3"], ["a1", "a2"])
    assert [(m["role"], m["content"]) for m in messages] == [
        ("user", "q1"), ("assistant", "a1"), ("user", "q2"), ("assistant", "a2"), ("user", "q3")]
    with pytest.raises(ValueError, match="no turn left"):
        conversation_messages(["q1"], ["a1"])


def test_render_conversation_uses_chat_template():
    tokenizer = make_tokenizer()
    text = render_conversation(tokenizer, ["w1 w2", "w3"], ["w4 w5"])
    assert text == "<|user|> w1 w2 </s> <|assistant|> w4 w5 </s> <|user|> w3 </s> <|assistant|>"
    assert render_conversation(tokenizer, ["w1", "w3"], ["w4"], use_chat_template=False) == "w1\n\nw4\n\nw3"
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="--no_chat_template"):
        render_conversation(tokenizer, ["w1"], [])


def test_second_turn_prompt_contains_first_generated_answer(prompt_files):
    target, tokenizer = make_target(), make_tokenizer()
    methods, _ = build_methods(prompt_lookup_num_tokens=None)
    prompt = read_prompt_file(prompt_files[0])[0]
    run = run_conversation(target, tokenizer, methods[0], prompt, "greedy", BenchSettings(max_new_tokens=6))
    assert len(run.turns) == 2 and all(run.answers)
    expected = render_conversation(tokenizer, prompt.turns, run.answers[:1])
    assert run.prompt_lengths[1] == len(tokenizer(expected, add_special_tokens=False)["input_ids"])
    assert run.prompt_lengths[1] > run.prompt_lengths[0] + len(tokenizer(run.answers[0])["input_ids"])


# --- round accounting -------------------------------------------------------------------------------------------


def test_rounds_from_forward_calls():
    # prompt of 5: prefill verifies 2 drafts and accepts 1 (commits 2), then one draft accepted (+2),
    # then 3 verified / 0 accepted, and the last round commits 3 (2 accepted) up to length 5 + 2 + 2 + 1 + 3.
    calls = [(0, 7), (6, 2), (8, 4), (9, 4)]
    assert rounds_from_forward_calls(calls, prompt_length=5, final_length=13) == [(2, 1), (1, 1), (3, 0), (3, 2)]
    assert rounds_from_forward_calls([(0, 5), (5, 1), (6, 1)], 5, 8) == [(0, 0)] * 3  # plain decoding
    assert rounds_from_forward_calls([(None, 5)], 5, 6) is None


def test_acceptance_by_position():
    assert acceptance_by_position([(3, 3), (3, 1), (2, 0), (0, 0)]) == [2 / 3, 1 / 2, 1.0]
    assert acceptance_by_position([]) == []


def test_forward_hook_rounds_match_dspark_statistics():
    target = make_target()
    drafter = make_drafter(target, block_size=4)
    methods, _ = build_methods(drafter=drafter, policies=["full"], prompt_lookup_num_tokens=None)
    input_ids = torch.tensor([[5, 17, 33, 8, 5, 17]])
    measurement = measure_generation(target, input_ids, methods[1], generation_kwargs("greedy", 12, 0))
    assert measurement.rounds[0] == (0, 0)  # the prefill drafts nothing
    assert measurement.rounds[1:] == measurement.dspark_rounds
    assert measurement.target_forwards == len(measurement.rounds)


# --- methods ----------------------------------------------------------------------------------------------------


def test_unavailable_policies_are_skipped_with_a_reason():
    target = make_target()
    drafter = make_drafter(target, enable_confidence_head=False)
    methods, skipped = build_methods(
        drafter=drafter, policies=["full", "threshold", "hardware_aware", "nonexistent"], prompt_lookup_num_tokens=None
    )
    assert [m.name for m in methods] == ["target", "dspark_full"]
    assert "--sps" in skipped["dspark_hardware_aware"]
    assert "confidence head" in skipped["dspark_threshold"]
    assert "not available" in skipped["dspark_nonexistent"]


def test_fixed_length_policies_by_spec():
    target = make_target()
    drafter = make_drafter(target)
    methods, skipped = build_methods(drafter=drafter, policies=["fixed:1", "fixed:3"], prompt_lookup_num_tokens=None)
    assert not skipped
    assert [(m.name, m.policy.length) for m in methods[1:]] == [("dspark_fixed1", 1), ("dspark_fixed3", 3)]
    with pytest.raises(ValueError, match="fixed:K"):
        build_methods(drafter=drafter, policies=["fixed"], prompt_lookup_num_tokens=None)
    with pytest.raises(ValueError, match="only fixed:K"):
        build_methods(drafter=drafter, policies=["full:2"], prompt_lookup_num_tokens=None)
    sps = {"hardware_aware": {"steps_per_second": {1: 10.0, 2: 9.0}}}
    methods, skipped = build_methods(drafter=drafter, policies=["hardware_aware", "hardware_aware:0",
                                                                "hardware_aware:1.5"],
                                     policy_kwargs=sps, prompt_lookup_num_tokens=None)
    assert [(m.name, m.policy.plan_smoothing) for m in methods[1:]] == [
        ("dspark_hardware_aware", 0.5), ("dspark_hardware_aware_smooth0", 0.0)]
    assert "plan_smoothing" in skipped["dspark_hardware_aware_smooth1.5"]
    with pytest.raises(ValueError, match="hardware_aware:W"):
        build_methods(drafter=drafter, policies=["hardware_aware:x"], policy_kwargs=sps, prompt_lookup_num_tokens=None)


def test_baseline_drafter_runs_the_same_policies_on_its_own_policy_objects():
    target = make_target()
    drafter, baseline = make_drafter(target), make_drafter(target, seed=5)
    sps = {"hardware_aware": {"steps_per_second": {1: 10.0, 2: 9.0}}}
    methods, skipped = build_methods(drafter=drafter, baseline_drafter=baseline, policies=["full", "hardware_aware"],
                                     policy_kwargs=sps, prompt_lookup_num_tokens=None)
    assert not skipped
    rows = {m.name: m for m in methods}
    assert list(rows) == ["target", "baseline_full", "baseline_hardware_aware", "dspark_full", "dspark_hardware_aware"]
    assert rows["baseline_full"].drafter is baseline and rows["dspark_full"].drafter is drafter
    assert rows["baseline_hardware_aware"].policy is not rows["dspark_hardware_aware"].policy


def test_lookup_suffix_adds_prompt_lookup_inside_dspark_rounds():
    target = make_target()
    drafter = make_drafter(target, block_size=3)
    methods, skipped = build_methods(drafter=drafter, policies=["full", "fixed:1+lookup"], prompt_lookup_num_tokens=6)
    assert not skipped
    rows = {m.name: m for m in methods}
    assert list(rows) == ["target", "prompt_lookup", "dspark_full", "dspark_fixed1_lookup"]
    assert "prompt_lookup_num_tokens" not in rows["dspark_full"].generate_kwargs
    assert rows["dspark_fixed1_lookup"].generate_kwargs["prompt_lookup_num_tokens"] == 6
    input_ids = torch.tensor([[5, 17, 33, 8, 5, 17, 33, 8, 5, 17]])
    expected = measure_generation(target, input_ids, rows["target"], generation_kwargs("greedy", 24, 0))
    measured = measure_generation(target, input_ids, rows["dspark_fixed1_lookup"], generation_kwargs("greedy", 24, 0))
    assert measured.new_token_ids == expected.new_token_ids
    assert measured.rounds[1:] == measured.dspark_rounds  # lookup rounds are counted like drafted ones
    with pytest.raises(ValueError, match=r"only addition to a policy is '\+lookup'"):
        build_methods(drafter=drafter, policies=["full+ngram"], prompt_lookup_num_tokens=None)


def test_steps_per_second_profile_layouts(tmp_path):
    expected = {1: 10.0, 2: 4.0}
    for data in ({"1": 10.0, "2": 4.0}, [10.0, 4.0]):
        (tmp_path / "sps.json").write_text(json.dumps(data))
        assert load_steps_per_second(tmp_path / "sps.json") == expected
    (tmp_path / "sps.json").write_text(json.dumps({"steps_per_second": 3}))
    with pytest.raises(ValueError, match="dspark-hf profile"):
        load_steps_per_second(tmp_path / "sps.json")


# --- end to end -------------------------------------------------------------------------------------------------


def test_in_memory_benchmark_compares_all_methods(prompt_files):
    target, tokenizer = make_target(), make_tokenizer()
    drafter = make_drafter(target)
    methods, skipped = build_methods(
        drafter=drafter, policies=["full", "threshold", "hardware_aware"],
        policy_kwargs={"hardware_aware": {"steps_per_second": {1: 10.0, 2: 9.0, 3: 8.5, 4: 8.0, 5: 7.5}}},
        dflash_drafter=make_drafter(target, seed=3, markov_rank=0),
        assistant=make_target(seed=7, num_hidden_layers=1), num_assistant_tokens=3, prompt_lookup_num_tokens=3,
    )
    assert not skipped
    prompts = load_prompts(prompt_files[:1], limit=2)
    records = run_benchmark(target, tokenizer, methods, prompts, BenchSettings(modes=("greedy", "sample"),
                                                                                max_new_tokens=8))
    assert len(records) == len(prompts) * 2 * len(methods)
    greedy = [r for r in records if r["mode"] == "greedy"]
    assert all(r["identical"] for r in greedy), [(r["method"], r["prompt_id"]) for r in greedy if not r["identical"]]
    assert all(r["identical"] is None for r in records if r["mode"] == "sample")
    for record in records:
        assert record["tau"] >= 1.0 and record["new_tokens"] > 0 and record["speedup"] > 0
    assert {r["tau"] for r in records if r["method"] == "target"} == {1.0}


def test_cli_writes_json_markdown_and_plots(prompt_files, tmp_path, monkeypatch):
    target, tokenizer = make_target(), make_tokenizer()
    monkeypatch.setattr(bench_module, "load_target", lambda *args, **kwargs: (target, tokenizer))
    sps = tmp_path / "sps.json"
    sps.write_text(json.dumps({"1": 10.0, "2": 9.0, "3": 8.0}))
    output_dir = tmp_path / "out"
    argv = ["--target", "tiny", "--drafter", "untrained", "--dflash-drafter", "untrained",
            "--baseline-drafter", "untrained", "--policies", "full,threshold,hardware_aware", "--prompts",
            *map(str, prompt_files), "--limit", "1", "--max-new-tokens", "6", "--sps", str(sps),
            "--prompt-lookup-num-tokens", "3", "--output-dir", str(output_dir), "--no-progress"]
    assert bench_module.main(argv) == 0
    results = json.loads((output_dir / "results.json").read_text())
    assert results["argv"] == argv and results["command"].startswith("dspark-hf bench --target tiny")
    assert {"cpu_model", "cpu_count", "torch_threads"} <= set(results["machine"])
    assert {"torch", "transformers", "dspark_hf", "python"} <= set(results["versions"])
    methods = {m["name"] for m in results["methods"]}
    assert methods == {"target", "prompt_lookup", "dflash", "dspark_full", "dspark_threshold", "dspark_hardware_aware",
                       "baseline_full", "baseline_threshold", "baseline_hardware_aware"}
    assert {r["category"] for r in results["records"]} == {"chat", "writing", "math"}
    assert all(r["identical"] for r in results["records"])
    summary = [row for row in results["summary"] if row["category"] == "all"]
    assert all(row["identical"] == row["identical_of"] == 3 for row in summary)
    markdown = (output_dir / "results.md").read_text()
    assert "| all | dspark_full |" in markdown and "yes (3/3)" in markdown
    for name in ("speedup", "acceptance", "tau"):
        assert (output_dir / f"{name}_greedy.png").stat().st_size > 1000


def test_cli_reports_the_target_dtype_and_where_outputs_diverge(prompt_files, tmp_path, monkeypatch):
    target, tokenizer = make_target(), make_tokenizer()
    monkeypatch.setattr(bench_module, "load_target", lambda *args, **kwargs: (target, tokenizer))
    real_build_methods = bench_module.build_methods

    def with_a_divergent_method(**kwargs):
        # a "method" that cannot write the odd ids: its output parts from target-only's
        methods, skipped = real_build_methods(**kwargs)
        return [*methods, BenchMethod("no_odd_ids", "target", {"suppress_tokens": list(range(3, 97, 2))})], skipped

    monkeypatch.setattr(bench_module, "build_methods", with_a_divergent_method)
    output_dir = tmp_path / "out"
    argv = ["--drafter", "untrained", "--policies", "full", "--prompt-lookup-num-tokens", "0", "--dtype", "float32",
            "--prompts", str(prompt_files[0]), "--max-new-tokens", "6", "--output-dir", str(output_dir),
            "--no-plots", "--no-progress", "--no-warmup"]
    assert bench_module.main(argv) == 0
    results = json.loads((output_dir / "results.json").read_text())
    assert results["settings"]["target_dtype"] == "float32" and "drafter_dtype" in results["settings"]
    records = {(r["method"], r["prompt_id"]): r for r in results["records"]}
    for prompt_id in ("chat-1", "chat-2", "chat-3"):
        assert records[("dspark_full", prompt_id)]["identical"]
        assert records[("dspark_full", prompt_id)]["first_divergence"] is None
    diverged = [r for r in results["records"] if r["method"] == "no_odd_ids" and not r["identical"]]
    assert diverged
    for record in diverged:
        divergence = record["first_divergence"]
        assert {"position", "margin", "top1_logit"} <= set(divergence) and divergence["margin"] >= 0
        assert divergence["target_token"] % 2 == 1 and divergence["token"] % 2 == 0
    summary = {row["method"]: row for row in results["summary"] if row["category"] == "all"}
    assert summary["no_odd_ids"]["divergences"] == len(diverged) == 3 - summary["no_odd_ids"]["identical"]
    assert summary["no_odd_ids"]["divergence_margin_max"] == max(r["first_divergence"]["margin"] for r in diverged)
    assert summary["dspark_full"]["divergences"] == 0
    markdown = (output_dir / "results.md").read_text()
    assert "target dtype: float32" in markdown and "Divergences from target-only (greedy)" in markdown
    assert "| no_odd_ids |" in markdown.split("### Divergences")[1]
    assert "| dspark_full |" not in markdown.split("### Divergences")[1]
    parser = bench_module.build_parser()
    for spelling in ("--target_dtype", "--target-dtype", "--dtype"):  # --dtype: its earlier name
        assert parser.parse_args([spelling, "bfloat16", "--prompts", "p"]).target_dtype == "bfloat16"
    assert parser.parse_args(["--prompts", "p"]).target_dtype == "auto"


def test_speed_profile_must_be_measured_in_the_target_dtype(tmp_path, monkeypatch):
    from dspark_hf.profiling import PROFILE_FILE_NAME, PROFILE_FORMAT

    target = make_target()
    drafter = make_drafter(target)
    folder = tmp_path / "drafter"
    folder.mkdir()
    profile = {"format": PROFILE_FORMAT, "settings": {"dtype": "torch.bfloat16"}, "by_batch_size": {"1": {"1": 9.0}}}
    (folder / PROFILE_FILE_NAME).write_text(json.dumps(profile))
    with pytest.raises(ValueError, match="--sps .*measured with the target in bfloat16.*--target_dtype bfloat16"):
        bench_module.speed_profile(str(folder), None, target, drafter)
    # without --sps, the profile the library's default policy uses: the drafter folder's only if it was measured on
    # this machine in the target's dtype, else one measured here (cached)
    monkeypatch.setenv("DSPARK_HF_CACHE", str(tmp_path / "cache"))
    drafter.name_or_path = str(folder)
    measured_here = bench_module.speed_profile(None, str(folder), target, drafter)
    assert measured_here.startswith(str(tmp_path / "cache"))
    from dspark_hf.profiling import profile_steps_per_second

    profile = profile_steps_per_second(target, max_tokens=drafter.config.block_size + 1, context_length=8, warmup=0,
                                       repeats=1)
    (folder / PROFILE_FILE_NAME).write_text(json.dumps(profile))
    assert bench_module.speed_profile(None, str(folder), target, drafter) == str(folder / PROFILE_FILE_NAME)


def test_bench_load_reports_the_target_dtype_and_identity(prompt_files, tmp_path, monkeypatch):
    from dspark_hf.benchmarks import bench_load

    target, tokenizer = make_target(), make_tokenizer()
    make_drafter(target, block_size=3).save_pretrained(tmp_path / "drafter")
    monkeypatch.setattr(bench_load, "load_target", lambda *args, **kwargs: (target, tokenizer))
    argv = ["--drafter", str(tmp_path / "drafter"), "--prompts", str(prompt_files[0]), "--concurrency", "2",
            "--requests", "3", "--max_new_tokens", "4", "--methods", "target,full,prompt_lookup,full+lookup",
            "--repeats", "1", "--target-dtype", "float32", "--output_dir", str(tmp_path / "out")]
    assert bench_load.main(argv) == 0
    document = json.loads((tmp_path / "out" / "bench_load.json").read_text())
    assert document["settings"]["target_dtype"] == "float32"
    assert document["settings"]["target_dtype_resolved"] == "float32"
    assert document["settings"]["interleave"] == "steps"  # the methods' loops stepped in turn, each on its own clock
    rows = {row["method"]: row for row in document["results"]}
    for method in ("full", "prompt_lookup", "full+lookup"):
        assert rows[method]["identical"] == rows[method]["identical_of"] == 3 and rows[method]["divergences"] == 0
    assert rows["prompt_lookup"]["rounds"] > 0 and "lookup_rounds" in rows["full+lookup"]
    with pytest.raises(SystemExit):  # one-line argparse error
        bench_load.main(argv + ["--random_range_ratio", "1.5"])
    with pytest.raises(ValueError, match=r"--methods full\+eagle: the only addition to a policy is '\+lookup'"):
        bench_load.main(argv[:11] + ["target,full+eagle"] + argv[12:])
    assert "identical" not in rows["target"] and "outputs" not in rows["full"]
    assert "Target in float32" in (tmp_path / "out" / "bench_load.md").read_text()
    for bad in ("-1", "two", "0,-2", "auto,soon"):
        with pytest.raises(SystemExit):  # one-line argparse error
            bench_load.main(argv + ["--admission_wait_rounds", bad])


def test_bench_load_runs_every_method_at_each_admission_wait(prompt_files, tmp_path, monkeypatch):
    from dspark_hf.benchmarks import bench_load

    target, tokenizer = make_target(), make_tokenizer()
    make_drafter(target, block_size=3).save_pretrained(tmp_path / "drafter")
    monkeypatch.setattr(bench_load, "load_target", lambda *args, **kwargs: (target, tokenizer))
    waits = []
    engine_init = bench_load.DSparkBatchEngine.__init__
    monkeypatch.setattr(bench_load.DSparkBatchEngine, "__init__", lambda self, *args, **kwargs: waits.append(
        kwargs["admission_wait_rounds"]) or engine_init(self, *args, **kwargs))
    argv = ["--drafter", str(tmp_path / "drafter"), "--prompts", str(prompt_files[0]), "--concurrency", "3",
            "--requests", "6", "--max_new_tokens", "5", "--random_range_ratio", "0.5", "--methods", "target,full",
            "--repeats", "1", "--target-dtype", "float32", "--admission_wait_rounds", "0,2", "--interleave", "passes",
            "--output_dir", str(tmp_path / "out")]
    assert bench_load.main(argv) == 0
    rows = {row["method"]: row for row in json.loads((tmp_path / "out" / "bench_load.json").read_text())["results"]}
    assert list(rows) == ["target", "full", "target wait=2", "full wait=2"] and set(waits) == {0, 2}
    assert rows["target"]["full_load_vs_target"] == 1.0 and "full_load_vs_target" in rows["full wait=2"]
    for method in ("full", "target wait=2", "full wait=2"):  # float32: every setting decodes the same tokens
        assert rows[method]["identical"] == rows[method]["identical_of"] == 6


def test_bench_load_hardware_aware_plans_on_a_profile_of_its_levels(prompt_files, tmp_path, monkeypatch):
    from dspark_hf import profiling
    from dspark_hf.benchmarks import bench_load

    target, tokenizer = make_target(), make_tokenizer()
    make_drafter(target, block_size=3).save_pretrained(tmp_path / "drafter")
    monkeypatch.setattr(bench_load, "load_target", lambda *args, **kwargs: (target, tokenizer))
    asked = []

    def profile_here(target, drafter, batch_sizes=(1,)):  # what the library measures (once) without --sps
        asked.append(list(batch_sizes))
        path = profiling.save_profile(profiling.profile_steps_per_second(
            target, max_tokens=4, batch_sizes=[1, *batch_sizes], context_length=8, warmup=0, repeats=1),
            tmp_path / "here.json")
        return {}, path

    monkeypatch.setattr(bench_load, "steps_per_second_here", profile_here)
    argv = ["--drafter", str(tmp_path / "drafter"), "--prompts", str(prompt_files[0]), "--concurrency", "1,2",
            "--requests", "2", "--max_new_tokens", "4", "--methods", "target,hardware_aware", "--repeats", "1",
            "--target-dtype", "float32", "--random_range_ratio", "0.5", "--output_dir", str(tmp_path / "out")]
    assert bench_load.main(argv) == 0
    document = json.loads((tmp_path / "out" / "bench_load.json").read_text())
    assert asked == [[1, 2]] and document["speed_profile"] == str(tmp_path / "here.json")
    rows = {(row["method"], row["concurrency"]): row for row in document["results"]}
    assert rows[("hardware_aware", 2)]["identical"] == 2  # budgets drawn per request, the same for both methods


def test_bench_load_exactness_finds_the_first_divergence_per_request():
    from dspark_hf.benchmarks.bench_load import level_exactness

    target = make_target()
    reference = {"prompt_ids": [[5, 6, 7], [8, 9]], "outputs": [[11, 12, 13], [14, 15]]}
    run = {"outputs": [[11, 12, 13], [14, 16]]}
    exactness = level_exactness(target, [reference], [run])
    assert exactness["identical"] == 1 and exactness["identical_of"] == 2 and exactness["divergences"] == 1
    divergence = exactness["first_divergences"][0]
    assert (divergence["pass"], divergence["request"], divergence["position"]) == (0, 1, 1)
    assert exactness["divergence_margin_max"] == divergence["margin"] >= 0


def test_bench_merge_pools_parts_and_refuses_mismatched_ones(prompt_files, tmp_path, monkeypatch):
    target, tokenizer = make_target(), make_tokenizer()
    monkeypatch.setattr(bench_module, "load_target", lambda *args, **kwargs: (target, tokenizer))
    common = ["--target", "tiny", "--drafter", "untrained", "--policies", "full", "--prompt-lookup-num-tokens", "0",
              "--prompts", str(prompt_files[0]), "--limit", "1", "--max-new-tokens", "4", "--no-plots",
              "--no-progress", "--no-warmup"]
    for start in (0, 1):
        assert bench_module.main([*common, "--start", str(start), "--output-dir", str(tmp_path / f"p{start}")]) == 0
    parts = [json.loads((tmp_path / f"p{start}" / "results.json").read_text()) for start in (0, 1)]

    assert merge_module.main([str(tmp_path / "p0"), str(tmp_path / "p1" / "results.json"), "--output-dir",
                              str(tmp_path / "merged"), "--no-plots"]) == 0
    merged = json.loads((tmp_path / "merged" / "results.json").read_text())
    assert [p["prompt_id"] for p in merged["prompts"]] == ["chat-1", "chat-2"]
    assert merged["records"] == parts[0]["records"] + parts[1]["records"]
    assert merged["settings"]["num_prompts"] == 2 and merged["command"].startswith("dspark-hf bench-merge")
    assert [part["command"] for part in merged["parts"]] == [part["command"] for part in parts]
    pooled = {(row["method"], row["category"]): row for row in merged["summary"]}
    target_all = pooled[("target", "all")]
    assert target_all["prompts"] == 2
    assert target_all["new_tokens"] == sum(r["new_tokens"] for r in merged["records"] if r["method"] == "target")
    assert "merged from 2 parts" in (tmp_path / "merged" / "results.md").read_text()

    with pytest.raises(ValueError, match="overlap"):
        merge_module.merge_results([parts[0], parts[0]])
    other = json.loads(json.dumps(parts[1]))
    other["settings"]["max_new_tokens"] = 8
    with pytest.raises(ValueError, match="settings differ"):
        merge_module.merge_results([parts[0], other])
    other = json.loads(json.dumps(parts[1]))
    other["methods"] = other["methods"][:1]
    with pytest.raises(ValueError, match="methods differ"):
        merge_module.merge_results([parts[0], other])
