"""Where a training step's CPU time goes, and supervised block-slots per CPU-second for each training setting.

One command measures the stage-3 recipe of `scripts/train_smollm2_drafter.sh` (full vocabulary, fp32 target, 128
anchors per sequence, one thread) and each lever on top of it, interleaved in rounds so that machine noise hits all
settings alike. Each (setting, round) runs in its own process (so thread settings do not leak) on the same sequences:
the target's own answers to the first `--num_prompts` prompts of the drafter's training prompt set (gsm8k lines 501+,
standard-library docstrings, /usr/share/doc), regenerated once with `dspark-hf prepare-data` as in the recipe.

A step is what `DSparkTrainer` does for one sequence: target forward (the signals), drafter body, heads and loss
(draft logits, Markov bias, the target's head, confidence, the loss terms), backward, and the optimizer step with
gradient clipping. Phases are timed in CPU seconds of the process (all its threads) and in wall seconds.

`--before REF` adds the stage-3 recipe run by the code at git revision `REF` (the target's head computed for every
supervised slot rather than once per position), so that one command gives both sides of a code change.

    python scripts/profile_training_step.py --before c42c342 \\
        --output_dir benchmarks/results/smollm2-training/step-profile
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
DRAFTER = {"block_size": 7, "num_hidden_layers": 1, "markov_rank": 64, "markov_head_type": "vanilla",
           "target_layer_ids": None, "mask_token_id": 16, "enable_confidence_head": True}
PHASES = ("target", "body", "heads_loss", "backward", "optimizer")


def settings(native_bf16: bool, before: bool) -> list[dict]:
    """The settings compared, each a lever added to the one before it (bf16 only where the CPU computes it natively)."""
    recipe = {"code": "current", "draft_vocab": None, "dtype": "float32", "num_anchors": 128, "threads": 1}
    rows = [{"name": "stage-3 recipe", **recipe}]
    if before:
        rows.insert(0, {**rows[0], "name": "stage-3 recipe, code before", "code": "before"})
    rows.append({**rows[-1], "name": "+ draft vocabulary 8192", "draft_vocab": 8192})
    if native_bf16:
        rows.append({**rows[-1], "name": "+ bf16 target and autocast", "dtype": "bfloat16"})
    rows.append({**rows[-1], "name": "+ all anchors (512)", "num_anchors": 512})
    rows.append({**rows[-1], "name": "+ both cores (2 threads)", "threads": 2})
    return rows


# --- one (setting, round) in its own process ---------------------------------------------------------------------


def run_worker(setting: dict, data_dir: str, num_steps: int, num_warmup: int) -> dict:
    import torch

    torch.set_num_threads(setting["threads"])
    import dspark_hf
    from dspark_hf.models import DEFAULT_TARGET, EMBEDDED_DRAFTERS, load_target
    from dspark_hf.modeling_dspark import DSparkDrafter
    from dspark_hf.training import objective
    from dspark_hf.training.blocks import DSparkBlocks
    from dspark_hf.training.collator import DSparkDataCollator
    from dspark_hf.training.data import load_training_dataset
    from dspark_hf.training.features import TargetSignalProvider

    bf16 = setting["dtype"] == "bfloat16"
    target, tokenizer = load_target(DEFAULT_TARGET, dtype=getattr(torch, setting["dtype"]))
    torch.manual_seed(0)
    drafter = DSparkDrafter.from_target(target, **DRAFTER).to(torch.float32)
    if setting["draft_vocab"]:
        shipped = DSparkDrafter.from_pretrained(EMBEDDED_DRAFTERS[DEFAULT_TARGET], target=target)
        ids = shipped.draft_token_ids
        assert ids.numel() == setting["draft_vocab"], ids.numel()
        drafter.reduce_vocabulary(ids)
    drafter.freeze_vocabulary()
    drafter.train()
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=2e-4)
    provider = TargetSignalProvider(target, drafter.config.target_layer_ids)
    collator = DSparkDataCollator(block_size=7, mask_token_id=16, num_anchors=setting["num_anchors"],
                                  pad_token_id=tokenizer.pad_token_id or 0, max_length=512,
                                  generator=torch.Generator().manual_seed(0))
    dataset = load_training_dataset(data_dir)
    extra = {}
    if "target_lm_head" in inspect.signature(objective.compute_dspark_loss).parameters:
        extra["target_lm_head"] = target.get_output_embeddings().weight

    clock = {}
    untimed_body = objective.drafter_block_states

    def timed_body(*args, **kwargs):  # the drafter body, called inside compute_dspark_loss
        start = (time.process_time(), time.perf_counter())
        out = untimed_body(*args, **kwargs)
        clock["body"] = (time.process_time() - start[0], time.perf_counter() - start[1])
        return out

    objective.drafter_block_states = timed_body

    totals = {phase: [0.0, 0.0] for phase in PHASES}
    slots = tokens = 0
    losses = []
    for step in range(num_warmup + num_steps):
        batch = collator([dataset[step % len(dataset)]])
        blocks = DSparkBlocks.from_dict(batch)
        marks = [(time.process_time(), time.perf_counter())]
        signals = provider(batch["input_ids"], batch["attention_mask"])
        marks.append((time.process_time(), time.perf_counter()))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = objective.compute_dspark_loss(drafter, blocks, signals, forward=drafter, **extra).loss
        marks.append((time.process_time(), time.perf_counter()))
        loss.backward()
        marks.append((time.process_time(), time.perf_counter()))
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        marks.append((time.process_time(), time.perf_counter()))
        if step < num_warmup:
            continue
        target_s, loss_s, backward_s, optimizer_s = [(b[0] - a[0], b[1] - a[1]) for a, b in zip(marks, marks[1:])]
        heads_loss_s = (loss_s[0] - clock["body"][0], loss_s[1] - clock["body"][1])  # the loss minus the body
        for phase, (cpu, wall) in zip(PHASES, (target_s, clock["body"], heads_loss_s, backward_s, optimizer_s)):
            totals[phase][0] += cpu
            totals[phase][1] += wall
        slots += int(blocks.supervised.sum())
        tokens += int(batch["attention_mask"].sum())
        losses.append(round(float(loss), 4))
    cpu = sum(v[0] for v in totals.values())
    wall = sum(v[1] for v in totals.values())
    return {"setting": setting, "module": dspark_hf.__file__, "steps": num_steps, "supervised_slots": slots,
            "tokens": tokens, "cpu_s": cpu, "wall_s": wall, "slots_per_cpu_s": slots / cpu,
            "slots_per_wall_s": slots / wall, "phases_cpu_s": {k: v[0] for k, v in totals.items()},
            "phases_wall_s": {k: v[1] for k, v in totals.items()}, "losses": losses}


# --- the command ----------------------------------------------------------------------------------------------------


def prepare_sequences(work: Path, num_prompts: int, python: str) -> Path:
    """The target's answers to the first prompts of the training prompt set (cached in `work`)."""
    data = work / "data"
    if (data / ".done.json").exists() or list(data.glob("*.parquet")):
        return data
    prompts = work / "prompts.jsonl"
    gsm8k = ROOT.parent / "shared" / "data" / "eval" / "gsm8k.jsonl"
    subprocess.run([python, str(ROOT / "scripts" / "smollm2_prompts.py"), "--gsm8k", str(gsm8k), "--out",
                    str(prompts)], check=True)
    subprocess.run([str(Path(python).parent / "dspark-hf"), "prepare-data", "--prompts", str(prompts), "--output_dir",
                    str(data), "--limit", str(num_prompts), "--batch_size", str(num_prompts), "--max_new_tokens",
                    "192", "--shard_size", str(num_prompts), "--target_dtype", "auto"], check=True)
    return data


def source_at(revision: str, work: Path) -> Path:
    """The package source at a git revision, unpacked under `work` (for `--before`)."""
    folder = work / f"src-{revision}"
    if not folder.exists():
        folder.mkdir(parents=True)
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", revision, "src"], check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    return folder / "src"


def summarize(runs: list[dict], names: list[str]) -> list[dict]:
    rows = []
    base = None
    for name in names:
        mine = [r for r in runs if r["setting"]["name"] == name]
        per_cpu = statistics.median(r["slots_per_cpu_s"] for r in mine)
        per_wall = statistics.median(r["slots_per_wall_s"] for r in mine)
        cpu = sum(r["cpu_s"] for r in mine)
        phases = {p: round(sum(r["phases_cpu_s"][p] for r in mine) / cpu, 3) for p in PHASES}
        base = base or (per_cpu, per_wall)
        rows.append({"setting": name, **{k: mine[0]["setting"][k] for k in ("code", "draft_vocab", "dtype",
                                                                              "num_anchors", "threads")},
                     "slots_per_cpu_s": round(per_cpu, 1), "slots_per_wall_s": round(per_wall, 1),
                     "per_cpu_s_vs_first": round(per_cpu / base[0], 2),
                     "per_wall_s_vs_first": round(per_wall / base[1], 2),
                     "rounds": [round(r["slots_per_cpu_s"], 1) for r in mine], "cpu_share": phases,
                     "mean_step_cpu_s": round(cpu / sum(r["steps"] for r in mine), 3)})
    return rows


def markdown(results: dict) -> str:
    lines = [
        "# Training step profile (SmolLM2-135M-Instruct target, 1-layer drafter, block 7)", "",
        f"Command: `{results['command']}`  ", f"Machine: {results['machine']}  ",
        f"Versions: {results['versions']}  ",
        f"{results['num_sequences']} sequences ({results['mean_tokens']} tokens on average), {results['steps']} "
        f"steps measured per setting and round after {results['warmup']} warm-up steps, {results['rounds']} rounds "
        "interleaved; medians over rounds.", "",
        "| setting | slots / CPU-s | vs first | slots / wall-s | vs first | CPU share: target / body / heads+loss / "
        "backward / optimizer |",
        "|---|---|---|---|---|---|",
    ]
    for row in results["summary"]:
        share = " / ".join(f"{100 * row['cpu_share'][p]:.0f}%" for p in PHASES)
        lines.append(f"| {row['setting']} | {row['slots_per_cpu_s']} | {row['per_cpu_s_vs_first']}x | "
                     f"{row['slots_per_wall_s']} | {row['per_wall_s_vs_first']}x | {share} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", required=True, help="where step-profile.json and step-profile.md go")
    parser.add_argument("--work_dir", default=None, help="cache of the sequences (default: a temporary folder)")
    parser.add_argument("--before", default=None, help="also run the stage-3 recipe with the code at this git ref")
    parser.add_argument("--num_prompts", type=int, default=12)
    parser.add_argument("--steps", type=int, default=8, help="measured steps per setting and round")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        spec = json.loads(args.worker)
        print("RESULT " + json.dumps(run_worker(spec["setting"], spec["data"], spec["steps"], spec["warmup"])))
        return 0

    import torch

    from dspark_hf.benchmarks.bench import machine_info
    from dspark_hf.benchmarks.report import describe_machine
    from dspark_hf.models import target_dtype

    work = Path(args.work_dir or tempfile.mkdtemp(prefix="step-profile-"))
    work.mkdir(parents=True, exist_ok=True)
    data = prepare_sequences(work, args.num_prompts, sys.executable)
    before_src = source_at(args.before, work) if args.before else None
    rows = settings(target_dtype("auto") == torch.bfloat16, before_src is not None)
    runs = []
    for round_index in range(args.rounds):
        for setting in rows:
            env = {**os.environ, "OMP_NUM_THREADS": str(setting["threads"])}
            if setting["code"] == "before":
                env["PYTHONPATH"] = os.pathsep.join([str(before_src), env.get("PYTHONPATH", "")])
            spec = json.dumps({"setting": setting, "data": str(data), "steps": args.steps, "warmup": args.warmup})
            out = subprocess.run([sys.executable, __file__, "--output_dir", args.output_dir, "--worker", spec],
                                 env=env, check=True, capture_output=True, text=True).stdout
            run = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])
            runs.append(run)
            print(f"round {round_index + 1}/{args.rounds} {setting['name']}: {run['slots_per_cpu_s']:.1f} slots/CPU-s,"
                  f" {run['slots_per_wall_s']:.1f} slots/wall-s", flush=True)
    import transformers

    tokens = [r["tokens"] / r["steps"] for r in runs]
    results = {
        "command": "python scripts/profile_training_step.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": describe_machine(machine_info()),
        "versions": f"torch {torch.__version__}, transformers {transformers.__version__}",
        "num_sequences": args.num_prompts, "mean_tokens": round(statistics.mean(tokens)), "steps": args.steps,
        "warmup": args.warmup, "rounds": args.rounds,
        "summary": summarize(runs, [row["name"] for row in rows]), "runs": runs,
    }
    output = Path(args.output_dir)
    output.mkdir(parents=True, exist_ok=True)
    (output / "step-profile.json").write_text(json.dumps(results, indent=1) + "\n")
    (output / "step-profile.md").write_text(markdown(results))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
