"""Hub and interop: official checkpoints load, draft and round-trip; model cards; push; custom_generate. No network."""

from __future__ import annotations

import ast
import copy
import hashlib
import inspect
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from huggingface_hub import HfApi, ModelCard
from transformers import AutoModel, BatchEncoding, DynamicCache, StoppingCriteriaList

from conftest import (
    SYNTHETIC_PROMPT as PROMPT,
    assert_round_trip_is_byte_identical,
    char_tokenizer,
    count_forwards,
    imitate_transitions,
    load_generate_module,
    make_drafter,
    make_target,
    predictable_pair,
    with_cache,
)
from dspark_hf import DSparkDrafter, cli, hub, interop, testing
from test_stopping import EndsWith


CARD = {"base_model": "org/tiny-target", "license": "apache-2.0", "datasets": ["org/chat-responses"]}


# --- loading official checkpoints -------------------------------------------------------------------------------------


@pytest.mark.parametrize("spelling, num_shards", [("v5", 1), ("v5", 3), ("v4", 2)])
def test_official_qwen3_checkpoint_loads_and_drafts(tmp_path, spelling, num_shards):
    target = testing.synthetic_target("qwen3", predictable=True)
    path = testing.write_synthetic_checkpoint(tmp_path, variant="qwen3", target=target, spelling=spelling,
                                              num_shards=num_shards, imitate_target=True)  # fmt: skip
    drafter = DSparkDrafter.from_pretrained(path).eval()
    assert drafter.dtype == torch.bfloat16
    assert drafter.config.head_dim == 16 != drafter.config.hidden_size // drafter.config.num_attention_heads
    assert drafter.config.target_layer_ids == [1, 3, 5, 7, 9]
    assert drafter.config.rope_parameters["rope_theta"] == 1000000
    assert isinstance(AutoModel.from_pretrained(path), DSparkDrafter)
    expected = target.generate(PROMPT, max_new_tokens=20, do_sample=False)
    drafted = target.generate(PROMPT, max_new_tokens=20, do_sample=False, assistant_model=drafter.float())
    assert torch.equal(drafted, expected)
    # The imitating Markov head only drafts the target's tokens if its tensors landed in the right modules.
    assert sum(r.accepted for r in drafter.generation_stats.rounds) >= 10


def test_dflash_sibling_loads_without_heads_and_drafts(tmp_path):
    target = testing.synthetic_target("qwen3")
    path = testing.write_synthetic_checkpoint(tmp_path, variant="qwen3", dflash=True, target=target)
    config = json.loads((path / "config.json").read_text())
    assert config["markov_rank"] == 0
    assert "markov_head_type" not in config and "confidence_head_with_markov" not in config
    drafter = DSparkDrafter.from_pretrained(path).float().eval()
    assert drafter.markov_head is None and drafter.confidence_head is None
    expected = target.generate(PROMPT, max_new_tokens=12, do_sample=False)
    assert torch.equal(target.generate(PROMPT, max_new_tokens=12, do_sample=False, assistant_model=drafter), expected)


@pytest.mark.parametrize("dflash", [False, True])
def test_official_qwen3_checkpoint_round_trips_byte_identically(tmp_path, dflash):
    source = testing.write_synthetic_checkpoint(tmp_path / "official", variant="qwen3", dflash=dflash, num_shards=2)
    DSparkDrafter.from_pretrained(source).save_pretrained(tmp_path / "saved")
    assert_round_trip_is_byte_identical(source, tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert saved["num_anchors"] == 512 and ("markov_head_type" in saved) is not dflash


# --- the Hub cache, offline -------------------------------------------------------------------------------------------


def write_hub_cache(cache: Path, repo_id: str, folder: Path, revision: str = "0" * 40) -> None:
    """Lays `folder` out like huggingface_hub's cache: blobs by hash, snapshot symlinks, refs/main."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    snapshot = repo / "snapshots" / revision
    for file in folder.rglob("*"):
        if file.is_file():
            blob = repo / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
            blob.parent.mkdir(exist_ok=True)
            blob.write_bytes(file.read_bytes())
            link = snapshot / file.relative_to(folder)
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(os.path.relpath(blob, link.parent))


HUB_SCRIPT = textwrap.dedent("""
    import json
    import dspark_hf
    from transformers import AutoModel, BatchEncoding
    from dspark_hf import DSparkDrafter, hub
    drafter = DSparkDrafter.from_pretrained("org/dspark-qwen3")
    auto = AutoModel.from_pretrained("org/dspark-qwen3")
    gemma = hub.load_drafter("org/dspark-gemma4")
    print(json.dumps({"drafter": type(drafter).__name__, "auto": type(auto).__name__, "gemma": type(gemma).__name__,
                      "fc": float(drafter.fc.weight.float().sum()), "path": drafter.name_or_path}))
""")


@pytest.fixture(scope="module")
def offline_hub_load(tmp_path_factory):
    """Loads two repos by id from a fake Hub cache in a fresh process with HF_HUB_OFFLINE=1."""
    root = tmp_path_factory.mktemp("hub")
    for variant in ("qwen3", "gemma4"):
        folder = testing.write_synthetic_checkpoint(root / variant, variant=variant, num_shards=2)
        write_hub_cache(root / "cache", f"org/dspark-{variant}", folder)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(root / "cache"), "HF_HOME": str(root / "home"),
           "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}  # fmt: skip
    result = subprocess.run([sys.executable, "-c", HUB_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    expected_fc = float(testing.synthetic_state_dict(testing.synthetic_config("qwen3"))["fc.weight"].float().sum())
    return json.loads(result.stdout.strip().splitlines()[-1]), expected_fc


def test_repo_ids_resolve_from_the_offline_hub_cache(offline_hub_load):
    loaded, expected_fc = offline_hub_load
    assert loaded["drafter"] == "DSparkDrafter" and loaded["gemma"] == "DSparkGemma4Drafter"
    assert loaded["fc"] == pytest.approx(expected_fc)
    assert "models--org--dspark-qwen3/snapshots" in loaded["path"] or loaded["path"] == "org/dspark-qwen3"


def test_auto_model_resolves_a_repo_id_to_the_drafter(offline_hub_load):
    assert offline_hub_load[0]["auto"] == "DSparkDrafter"


# --- model cards -----------------------------------------------------------------------------------------------------


@pytest.fixture
def drafter(tmp_path_factory):
    return DSparkDrafter.from_pretrained(testing.write_synthetic_checkpoint(tmp_path_factory.mktemp("card")))


def test_model_card_has_metadata_usage_training_and_benchmark(tmp_path, drafter):
    benchmark = {"rows": [{"dataset": "gsm8k", "temperature": 0.0, "acceptance_length": 3.21, "speedup": 1.84},
                          {"dataset": "mt-bench", "temperature": 1.0, "acceptance_length": 2.5, "speedup": 1.5}],
                 "machine": "1x H100", "versions": {"torch": "2.13"},
                 "notes": "Speed-ups are over the target alone in the same run."}  # fmt: skip
    (tmp_path / "bench.json").write_text(json.dumps(benchmark))
    training = {"datasets": ["org/chat-responses"], "responses": "regenerated by the target", "epochs": 10}
    card = hub.render_model_card(drafter, repo_id="org/dspark-tiny", card_data=CARD, benchmark=tmp_path / "bench.json",
                                 training=training)  # fmt: skip
    card.save(tmp_path / "README.md")
    data = ModelCard.load(tmp_path / "README.md").data.to_dict()
    for key in ("base_model", "library_name", "license", "pipeline_tag", "tags", "datasets"):
        assert data.get(key), key
    assert data["library_name"] == "transformers" and data["pipeline_tag"] == "text-generation"
    assert {"dspark", "speculative-decoding"} <= set(data["tags"])
    text = card.text
    assert '"method": "dspark", "model": "org/dspark-tiny", "num_speculative_tokens": 7' in text
    assert 'custom_generate="org/dspark-tiny", trust_remote_code=True' in text
    assert 'DSparkDrafter.from_pretrained("org/dspark-tiny")' in text
    assert "pypi.org" not in text and "from its source tree (`pip install -e .`)" in text  # not published on PyPI
    assert "| dataset | temperature | acceptance_length | speedup |" in text and "| gsm8k | 0 | 3.21 | 1.84 |" in text
    assert "Speed-ups are over the target alone in the same run." in text
    assert "1x H100" in text and "- **responses**: regenerated by the target" in text
    assert "[1, 3, 5, 7, 9] (of 12)" in text and "vanilla, rank 8" in text


@pytest.mark.parametrize("missing", ["base_model", "license"])
def test_model_card_requires_target_and_license(drafter, missing):
    with pytest.raises(ValueError, match=missing):
        hub.render_model_card(drafter, repo_id="org/x", card_data={k: v for k, v in CARD.items() if k != missing})


def test_benchmark_must_be_rows():
    with pytest.raises(ValueError, match="list of dicts"):
        hub.format_benchmark({"rows": "fast"})


# --- push_to_hub through a local fake of the upload API -------------------------------------------------------------


@pytest.fixture
def fake_hub(tmp_path, monkeypatch):
    """Replaces HfApi's repo creation and uploads with writes under tmp_path/remote/<repo_id>."""
    remote, calls = tmp_path / "remote", []

    def create_repo(self, repo_id, **kwargs):
        calls.append(("create_repo", repo_id, kwargs))
        (remote / repo_id).mkdir(parents=True, exist_ok=True)
        return f"https://huggingface.co/{repo_id}"

    def upload_folder(self, *, repo_id, folder_path, **kwargs):
        calls.append(("upload_folder", repo_id, kwargs))
        for file in Path(folder_path).rglob("*"):
            if file.is_file():
                destination = remote / repo_id / file.relative_to(folder_path)
                destination.parent.mkdir(parents=True, exist_ok=True)
                destination.write_bytes(file.read_bytes())
        return "commit-url"

    def create_commit(self, repo_id, operations, **kwargs):
        calls.append(("create_commit", repo_id, kwargs))
        for op in operations:
            destination = remote / repo_id / op.path_in_repo
            destination.parent.mkdir(parents=True, exist_ok=True)
            destination.write_bytes(Path(op.path_or_fileobj).read_bytes())
        return "commit-url"

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    monkeypatch.setattr(HfApi, "create_commit", create_commit)
    return remote, calls


def assert_published(folder: Path, repo_id: str) -> None:
    files = {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}
    assert files == {"config.json", "model.safetensors", "README.md", "custom_generate/generate.py",
                     "custom_generate/requirements.txt"}  # fmt: skip
    assert interop.check_checkpoint(folder, for_vllm=True) == []
    data = ModelCard.load(folder / "README.md").data.to_dict()
    assert all(data.get(k) for k in ("base_model", "library_name", "license", "pipeline_tag", "tags", "datasets"))
    assert f"DRAFTER = {json.dumps(repo_id)}" in (folder / "custom_generate" / "generate.py").read_text()
    assert "transformers>=" in (folder / "custom_generate" / "requirements.txt").read_text()


def test_push_drafter_uploads_checkpoint_card_and_recipe(fake_hub, drafter):
    remote, calls = fake_hub
    hub.push_drafter(drafter.float(), "org/dspark-tiny", card_data=CARD, private=True, dtype=torch.bfloat16)
    assert calls[0] == ("create_repo", "org/dspark-tiny", {"private": True, "exist_ok": True, "repo_type": "model"})
    assert [c[0] for c in calls] == ["create_repo", "upload_folder"]
    assert_published(remote / "org/dspark-tiny", "org/dspark-tiny")
    assert interop.read_tensor_headers(remote / "org/dspark-tiny")["fc.weight"][1] == "BF16"
    assert drafter.dtype == torch.float32  # the caller's drafter is not cast


def test_push_refuses_before_creating_the_repo(fake_hub, drafter):
    with pytest.raises(ValueError, match="license"):
        hub.push_drafter(drafter, "org/dspark-tiny", card_data={"base_model": "org/tiny-target"})
    assert fake_hub[1] == []


def test_push_command(fake_hub, tmp_path):
    source = testing.write_synthetic_checkpoint(tmp_path / "trained", variant="qwen3")
    args = ["--drafter", str(source), "--repo_id", "org/cli", "--base_model", "org/tiny-target", "--license", "mit",
            "--datasets", "org/chat-responses", "--tags", "tiny"]  # fmt: skip
    assert cli.main(["push", *args]) == 0
    assert_published(fake_hub[0] / "org/cli", "org/cli")
    assert hub.main([*args, "--output_dir", str(tmp_path / "dry")]) == 0
    assert_published(tmp_path / "dry", "org/cli")
    assert [c[0] for c in fake_hub[1]] == ["create_repo", "upload_folder"]  # the dry run uploaded nothing


def test_push_command_binds_a_compact_drafter_to_target(tmp_path):
    target = make_target("qwen3")
    for name, model in (("target", target), ("other", make_target("qwen3", vocab_size=120))):
        model.save_pretrained(tmp_path / name)
        char_tokenizer().save_pretrained(tmp_path / name)
    make_drafter(target).save_compact(tmp_path / "compact")
    argv = ["--drafter", str(tmp_path / "compact"), "--repo_id", "org/compact", "--base_model", "org/tiny-target",
            "--license", "mit", "--datasets", "org/chat-responses", "--output_dir", str(tmp_path / "out")]  # fmt: skip
    with pytest.raises(SystemExit, match=r"is a compact drafter .* pass --target"):
        hub.main(argv)
    with pytest.raises(SystemExit, match=r"cannot load --drafter .* embedding has shape \(120, 32\)"):
        hub.main([*argv, "--target", str(tmp_path / "other")])
    with pytest.raises(SystemExit, match="cannot load --target .*missing"):
        hub.main([*argv, "--target", str(tmp_path / "missing")])
    assert not (tmp_path / "out").exists()
    assert hub.main([*argv, "--target", str(tmp_path / "target"), "--dtype", "none"]) == 0
    assert_published(tmp_path / "out", "org/compact")
    published = DSparkDrafter.from_pretrained(tmp_path / "out")  # the official layout: no target needed
    assert torch.equal(published.embed_tokens.weight, target.get_input_embeddings().weight)
    assert torch.equal(published.lm_head.weight, target.get_output_embeddings().weight)


# --- custom_generate: DSpark for users without dspark-hf -------------------------------------------------------------


@pytest.mark.usefixtures("modules_cache")
def test_custom_generate_folder_matches_target_and_dspark_hf(tmp_path):
    target, path = predictable_pair(tmp_path, dtype="float32")
    hub.write_custom_generate(path, str(path))
    expected = target.generate(PROMPT, max_new_tokens=24, do_sample=False)
    drafter = DSparkDrafter.from_pretrained(path).eval()
    calls = count_forwards(target)
    assert torch.equal(target.generate(PROMPT, max_new_tokens=24, do_sample=False, assistant_model=drafter), expected)
    with_dspark_hf, rounds = len(calls), drafter.generation_stats.rounds
    calls.clear()
    output = target.generate(PROMPT, max_new_tokens=24, do_sample=False, custom_generate=str(path),
                             trust_remote_code=True)  # fmt: skip
    assert torch.equal(output, expected)
    # Same drafts, same verdicts: as many target forward passes as dspark-hf's own generate, far fewer than tokens.
    assert len(calls) == with_dspark_hf < 24
    assert any(r.accepted < r.verified for r in rounds) and any(r.accepted > 0 for r in rounds)


@pytest.mark.usefixtures("modules_cache")
def test_custom_generate_stops_where_the_target_stops(tmp_path):
    target, path = predictable_pair(tmp_path, dtype="float32", reject=False)
    hub.write_custom_generate(path, str(path))
    full = target.generate(PROMPT, max_new_tokens=24, do_sample=False)[0, PROMPT.shape[1]:].tolist()
    for stop_after in (full[5], full[10]):  # tokens inside the drafted rounds, whose drafts are all accepted
        criteria = StoppingCriteriaList([EndsWith([stop_after])])
        expected = target.generate(PROMPT, max_new_tokens=24, do_sample=False, stopping_criteria=criteria)
        assert expected.shape[1] < PROMPT.shape[1] + 24
        output = target.generate(PROMPT, max_new_tokens=24, do_sample=False, stopping_criteria=criteria,
                                 custom_generate=str(path), trust_remote_code=True)  # fmt: skip
        assert torch.equal(output, expected)
    with pytest.raises(ValueError, match="stop_strings needs the tokenizer"):
        target.generate(PROMPT, max_new_tokens=4, stop_strings=["a"], custom_generate=str(path),
                        trust_remote_code=True)  # fmt: skip


@pytest.mark.usefixtures("modules_cache")
def test_custom_generate_continues_a_cache_of_an_earlier_turn(tmp_path, monkeypatch):
    """A chat through the recipe, each turn continuing one cache in place (as `generate` does with a cache passed to
    it): what target-only decoding gives turn after turn with its own cache (a drafter that drafts the target's own
    transitions, so rounds accept drafts on top of the cached positions); the drafter continues the context it left
    beside the cache, so it drafts from the whole conversation."""
    target = make_target(seed=5)
    drafter = make_drafter(target, seed=6, markov_rank=97, block_size=4)
    start = torch.tensor([[11, 40, 7, 23]])
    greedy = target.generate(start, max_new_tokens=40, min_new_tokens=40, do_sample=False, pad_token_id=0)[0].tolist()
    imitate_transitions(drafter, dict(zip(greedy, greedy[1:])))
    drafter.save_pretrained(tmp_path / "drafter")
    hub.write_custom_generate(tmp_path / "recipe", str(tmp_path / "drafter"))
    settings = dict(do_sample=False, max_new_tokens=10, pad_token_id=0)
    recipe = dict(custom_generate=str(tmp_path / "recipe"), trust_remote_code=True)
    module = sys.modules[target.load_custom_generate(recipe["custom_generate"], trust_remote_code=True).__module__]
    starts, extend = [], module.DSparkStandaloneDrafter.extend_context

    def record(self, features, first):  # the first position extended, and how many positions the context held then
        held = 0 if self.context[0][0] is None else self.context[0][0].shape[1]
        starts.append((first, held))
        return extend(self, features, first)

    monkeypatch.setattr(module.DSparkStandaloneDrafter, "extend_context", record)
    turn, own_cache, recipe_cache = torch.tensor([greedy[:6]]), DynamicCache(), DynamicCache()
    for new_turn in ([31, 8], [44, 3, 9], []):
        mask, cached = torch.ones_like(turn), recipe_cache.get_seq_length()
        own = target.generate(turn, attention_mask=mask, **with_cache(own_cache), **settings)
        starts.clear()
        ours = target.generate(turn, attention_mask=mask, **with_cache(recipe_cache), **recipe, **settings)
        assert ours.tolist() == own.tolist()
        assert recipe_cache.get_seq_length() == own_cache.get_seq_length() == ours.shape[1] - 1
        assert starts[0] == (cached, cached)  # the new positions extend the context of every cached one
        turn = torch.cat([ours, torch.tensor([new_turn], dtype=torch.long)], dim=-1)
    # the context kept for the next turn is what the drafter builds from one forward over the conversation
    standalone, kept, start, length = module._CONTEXTS[recipe_cache]
    assert (start, length) == (0, recipe_cache.get_seq_length())
    with torch.no_grad():
        hidden_states = target(turn[:, :length], output_hidden_states=True).hidden_states
    fresh = copy.copy(standalone)
    fresh.context = [[None, None] for _ in range(fresh.num_layers)]
    extend(fresh, module._features(hidden_states, standalone.config["target_layer_ids"]), 0)
    for (keys, values), (expected_keys, expected_values) in zip(kept, fresh.context):
        torch.testing.assert_close(keys, expected_keys, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(values, expected_values, rtol=1e-4, atol=1e-5)
    cut = turn[:, :9]  # a cropped cache: the context is cut with it
    recipe_cache.crop(8 - recipe_cache.get_seq_length())
    starts.clear()
    target.generate(cut, attention_mask=torch.ones_like(cut), **with_cache(recipe_cache), **recipe, **settings)
    assert starts[0] == (8, 8)
    unseen = DynamicCache()  # a cache the recipe never saw: the context starts after its positions
    target(turn[:, :7], **with_cache(unseen), use_cache=True)
    starts.clear()
    target.generate(turn[:, :9], attention_mask=torch.ones(1, 9, dtype=torch.long), **with_cache(unseen), **recipe,
                    **settings)
    assert starts[0] == (7, 0)
    with pytest.raises(ValueError, match="the whole prompt"):
        target.generate(turn[:, :5], **with_cache(recipe_cache), **recipe, **settings)


RUN_WITHOUT_DSPARK_HF = textwrap.dedent("""
    import json, sys
    sys.modules["dspark_hf"] = None  # as on a machine without dspark-hf: importing it raises ImportError
    import torch
    from transformers import AutoModelForCausalLM
    target = AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()
    prompt = torch.tensor(json.loads(sys.argv[3]))
    output = target.generate(prompt, max_new_tokens=16, do_sample=False, custom_generate=sys.argv[2],
                             trust_remote_code=True)
    print(json.dumps(output[0].tolist()))
""")


def test_written_recipe_inlines_the_drafting_module_and_runs_without_dspark_hf(tmp_path):
    """The recipe is assembled from the package's own policy and drafting modules at write time (nothing to go stale), and what
    is written runs in a process where dspark-hf cannot be imported."""
    from dspark_hf.generation import drafting, verification_policy

    target, path = predictable_pair(tmp_path, dtype="float32")
    target.save_pretrained(tmp_path / "target")
    folder = hub.write_custom_generate(path, str(path))
    source = (folder / "generate.py").read_text()
    for module in (verification_policy, drafting):
        assert inspect.getsource(module).split("from __future__ import annotations\n", 1)[1].strip() in source
    nodes = list(ast.walk(ast.parse(source)))
    imported = {alias.name for node in nodes if isinstance(node, ast.Import) for alias in node.names}
    imported = {name.split(".")[0] for name in imported | {n.module for n in nodes if isinstance(n, ast.ImportFrom)}}
    allowed = {"__future__", "collections", "dataclasses", "inspect", "json", "math", "os", "weakref", "torch",
               "safetensors", "transformers", "huggingface_hub"}  # fmt: skip
    assert imported <= allowed, imported - allowed  # dspark_hf above all
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules")}
    result = subprocess.run([sys.executable, "-c", RUN_WITHOUT_DSPARK_HF, str(tmp_path / "target"), str(path),
                             json.dumps(PROMPT.tolist())], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    expected = target.generate(PROMPT, max_new_tokens=16, do_sample=False)
    assert json.loads(result.stdout.strip().splitlines()[-1]) == expected[0].tolist()


def card_snippet(card_text: str, heading: str) -> str:
    """The first Python block under `heading` of a model card, as a user would copy it."""
    section = card_text.split(heading, 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


@pytest.mark.usefixtures("modules_cache")
def test_card_snippet_without_dspark_hf_runs_as_written(tmp_path):
    target, source = predictable_pair(tmp_path)
    folder = tmp_path / "published"
    # A dry run "published" at a local folder: the card's snippet and the recipe's default drafter both name it, as
    # they name the Hub repository of a real push, so the snippet runs verbatim without the Hub.
    argv = ["--drafter", str(source), "--repo_id", str(folder), "--base_model", "org/tiny-target", "--license", "mit",
            "--output_dir", str(folder)]  # fmt: skip
    assert hub.main(argv) == 0
    snippet = card_snippet(ModelCard.load(folder / "README.md").text, "### transformers, without dspark-hf")
    assert f'custom_generate="{folder}", trust_remote_code=True' in snippet
    # What the card's first snippet builds with the tokenizer: input_ids and attention_mask, passed as **inputs.
    inputs = BatchEncoding({"input_ids": PROMPT, "attention_mask": torch.ones_like(PROMPT)})
    namespace = {"target": target, "inputs": inputs}
    exec(snippet, namespace)
    expected = target.generate(**inputs, max_new_tokens=256, do_sample=False)
    assert expected.shape[1] == PROMPT.shape[1] + 256
    assert torch.equal(namespace["output"], expected)


@torch.no_grad()
def test_standalone_drafter_matches_dspark_drafter(tmp_path):
    path = testing.write_synthetic_checkpoint(tmp_path, variant="qwen3", dtype="float32", attention_bias=True)
    drafter = DSparkDrafter.from_pretrained(path).eval()
    standalone = load_generate_module().DSparkStandaloneDrafter(str(path), "cpu", torch.float32)
    features = torch.randn(1, 9, drafter.config.num_context_features)
    standalone.extend_context(features[0, :6], 0)
    standalone.extend_context(features[0, 6:], 6)  # projected incrementally, like the generation loop does
    hidden, logits = standalone.block(torch.tensor(3), 9)
    reference = drafter(input_ids=torch.tensor([[3] + [290] * 6]), target_hidden_states=features,
                        position_ids=torch.arange(9, 16)[None], context_position_ids=torch.arange(9)[None])  # fmt: skip
    torch.testing.assert_close(hidden, reference.last_hidden_state[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(logits, reference.logits[0], rtol=1e-4, atol=1e-5)
    # The per-slot methods the shared drafting loop calls, on a batch of one row.
    previous = torch.tensor([11])
    corrected, _ = standalone.corrected_logits(logits[1:2], previous, hidden[1:2])
    expected, _ = drafter.corrected_logits(drafter.draft_logits(hidden[1:2]), previous, hidden[1:2])
    torch.testing.assert_close(corrected, expected, rtol=1e-4, atol=1e-5)
    z = standalone.confidence_logits(hidden[2:3], previous)
    torch.testing.assert_close(z, drafter.confidence_logits(hidden[2:3], previous), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(standalone.calibrated_confidence(z, 2), drafter.calibrated_confidence(z, 2))


def test_standalone_rejection_sampling_reproduces_the_target_distribution():
    verify = load_generate_module().verify
    generator = torch.Generator().manual_seed(0)
    target_probs = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.1, 0.2, 0.3, 0.4]])
    draft_probs = torch.tensor([[0.1, 0.1, 0.4, 0.4]])
    counts = torch.zeros(4)
    for _ in range(6000):
        token = int(torch.multinomial(draft_probs[0], 1, generator=generator))
        accepted, next_token = verify([token], draft_probs, target_probs.log(), target_probs, True, generator)
        counts[token if accepted else next_token] += 1
    torch.testing.assert_close(counts / counts.sum(), target_probs[0], atol=0.02, rtol=0)
    assert counts[3] == 0  # a token the target never emits is always rejected


@pytest.mark.usefixtures("modules_cache")
def test_custom_generate_samples_and_stops(tmp_path):
    """Sampling stops at the length budget, and at an EOS: with the same seed and that EOS set, the recipe returns the
    free run's tokens up to the EOS's first occurrence and stops there (inside a verified block or at its end)."""
    target, path = predictable_pair(tmp_path, dtype="float32")
    hub.write_custom_generate(path, str(path))
    sample = dict(max_new_tokens=15, do_sample=True, temperature=0.7, top_k=20, top_p=0.9, custom_generate=str(path),
                  trust_remote_code=True)  # fmt: skip
    torch.manual_seed(0)
    free = target.generate(PROMPT, eos_token_id=None, **sample)
    assert free.shape[1] == PROMPT.shape[1] + 15 and torch.equal(free[:, : PROMPT.shape[1]], PROMPT)
    new = free[0, PROMPT.shape[1]:].tolist()
    assert max(new) < 300
    eos = next(token for token in new[4:] if new.index(token) >= 4)  # first emitted in a later round
    torch.manual_seed(0)
    stopped = target.generate(PROMPT, eos_token_id=eos, **sample)
    assert stopped[0].tolist() == free[0, : PROMPT.shape[1] + new.index(eos) + 1].tolist()


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_beams=2), "num_beams"),
    (dict(repetition_penalty=1.3), "repetition_penalty"),
    (dict(input_ids=torch.cat([PROMPT, PROMPT])), "one prompt at a time"),
    (dict(inputs=PROMPT), "pass the prompt once"),
    (dict(attention_mask=torch.ones(1, 3, dtype=torch.long)), "attention_mask has shape"),
    (dict(attention_mask=torch.tensor([[0, 1, 1, 1, 1, 1, 1]])), "padding"),
])  # fmt: skip
@pytest.mark.usefixtures("modules_cache")
def test_custom_generate_refuses_what_it_cannot_do(tmp_path, kwargs, message):
    target, path = predictable_pair(tmp_path, dtype="float32", reject=False)
    hub.write_custom_generate(path, str(path))
    kwargs.setdefault("input_ids", PROMPT)
    with pytest.raises(ValueError, match=message):
        target.generate(max_new_tokens=4, custom_generate=str(path), trust_remote_code=True, **kwargs)
