#!/usr/bin/env bash
# The second training campaign of the embedded drafter (issue 19): ten times the data, trained at the CPU levers of
# benchmarks/results/smollm2-training/step-profile (draft vocabulary, bf16 where native, all anchors). Every step
# resumes where it stopped (prepare-data skips finished shards; train resumes from its last checkpoint), so the
# campaign runs over several sessions, on whatever machine each gets: rerun the same step. What must outlive a machine
# is committed under DATA_DIR (default training_data/smollm2-135m-instruct): the prompt files, compressed (the
# material they are built from differs between machines, and the finished shards name prompts by their index), and
# every finished shard of regenerated answers. The table of stages is benchmarks/results/smollm2-training/campaign.md.
#
# Usage: bash scripts/campaign_v2.sh WORK_DIR STEP     (STEP: prompts | data | pack | train | eval | judge)
#   prompts  the v1 prompt files (scripts/smollm2_prompts.py, what stages 1-3 used) and the v2 corpus
#            (scripts/build_training_prompts.py: 30,000 prompts in seven domains, none overlapping the eval sets),
#            built once and committed; later runs unpack the committed files
#   data     regenerates the answers with the target, v2 first (its first 28,000 prompts; the last 2,000 are held back
#            for calibration), then v1 again with 256 new tokens, into WORK_DIR after
#            the shards DATA_DIR holds; two workers of one thread each (more tokens per CPU-second than one process on
#            two threads)
#   pack     copies the finished shards into DATA_DIR, compact (scripts/pack_campaign_shards.py), to commit
#   eval     CANDIDATE=DIR [NAME=stage4]: held-out full-block tau of the shipped drafter and CANDIDATE, teacher-forced
#            over the committed greedy outputs of the held-out sets (scripts/campaign_eval.py; no timing: it can run
#            beside a training job), into benchmarks/results/smollm2-training/heldout-tau/NAME
#   train    [STAGE=4] [FROM=DIR] [GROW_LAYERS=N TAG=T]: trains stage STAGE from the drafter of the stage before it
#            (stage 4: the shipped
#            drafter; later: DATA_DIR/stages/stage<STAGE-1>, committed) over its own 8,192-id draft vocabulary on the
#            committed shards into WORK_DIR/dspark<STAGE>, and saves the result compact in DATA_DIR/stages/stage<STAGE>
#            (commit it); one epoch, or MAX_STEPS optimizer steps (a stage sized to a session: the cosine schedule
#            spans MAX_STEPS, so keep MAX_STEPS when resuming), a checkpoint every 200 steps (rerun to resume);
#            `stage4` is the same step; EVAL_STRATEGY=no skips the in-training evaluation
#            (64-sequence loss and 8 generated prompts every 1000 steps, ~5 min; the eval step judges the result);
#            GROW_LAYERS=N appends N draft layers that start as the identity (the capacity lever, issue 19 item 4),
#            GROW_MARKOV_RANK=R widens the Markov head to rank R (new directions start without effect; the releases'
#            rank is 256), DROP_MARKOV_HEAD=1 removes the Markov head (the DFlash ablation, trained on beside the
#            same drafter with its head), and TAG names the run apart from the stage's 1-layer line
#            (WORK_DIR/dspark<STAGE><TAG>, stage<STAGE><TAG>)
#   judge    CANDIDATE=DIR [NAME=stage4] [BASELINE=DIR]: recalibrates CANDIDATE (STS, 96 of the held-back v2 prompts)
#            into WORK_DIR/NAME-cal, then benchmarks it against the shipped drafter (or BASELINE) in one run (same
#            policies, POLICIES=..., target in bf16 where native, 6 prompts each of gsm8k, humaneval and mt-bench, 256
#            new tokens) into
#            benchmarks/results/smollm2-training/stage-bench/NAME; run it on an otherwise idle machine
set -euo pipefail
work=${1:?work dir}
step=${2:?step: prompts, data, pack, train, eval or judge}
root=$(cd "$(dirname "$0")/.." && pwd)
eval_dir=${EVAL_DIR:-$root/../shared/data/eval}
data=${DATA_DIR:-$root/training_data/smollm2-135m-instruct}
prompt_files=(prompts-v1/prompts prompts-v1/extra prompts-v1/code3 prompts-v2/prompts)
train_prompts=28000
mkdir -p "$work" "$data"

unpack_prompts() {  # the committed prompt files into WORK_DIR
    local name
    for name in "${prompt_files[@]}"; do
        if [[ ! -f "$work/$name.jsonl" ]]; then
            [[ -f "$data/$name.jsonl.xz" ]] || { echo "no $data/$name.jsonl.xz: run the prompts step first" >&2; exit 2; }
            mkdir -p "$(dirname "$work/$name")"
            xz -dc "$data/$name.jsonl.xz" > "$work/$name.jsonl"
        fi
    done
    # The v2 corpus's last 2,000 prompts (shuffled, all seven domains) are never regenerated for training: every 16th
    # of them is the calibration set of each stage (STS, the judge step). Training reads the first 28,000 lines, so a
    # prompt keeps its index (the finished shards name prompts by index).
    head -n "$train_prompts" "$work/prompts-v2/prompts.jsonl" > "$work/prompts-v2/train.jsonl"
    sed -n "$((train_prompts + 1))~16p" "$work/prompts-v2/prompts.jsonl" > "$work/prompts-v2/calibration.jsonl"
}

# Shards of 256 prompts: prompts are sorted by length within a shard before batching, and with 256 (8 batches of 32)
# 81% of the prefill is real tokens rather than left padding (52% with shards of 64), on the v2 prompts (94-700
# tokens). Batches of 64: one decode step of the bf16 target on one thread (AMX Xeon, 300-token prompts;
# scripts/profile_regeneration_batch.py) costs
# 91 / 136 / 231 / 406 ms at 16 / 32 / 64 / 128 rows, 175 / 235 / 277 / 315 tokens/s; 64 rows keep the padding low.
regenerate() {  # regenerate OUT PROMPT_FILE...: two one-thread workers over disjoint shares of the prompts
    local out=$1; shift
    mkdir -p "$out"
    if compgen -G "$data/$(basename "$out")/*.done.json" > /dev/null; then  # committed shards: their prompts are skipped
        cp -n "$data/$(basename "$out")"/* "$out"/
    fi
    for index in 0 1; do
        OMP_NUM_THREADS=1 dspark-hf prepare-data --prompts "$@" --output_dir "$out" --target_dtype auto \
            --batch_size 64 --shard_size 256 --max_new_tokens 256 --num_shards 2 --shard_index $index \
            >> "$work/$(basename "$out").worker$index.log" 2>&1 &
    done
    wait
}

case $step in
prompts)
    if [[ -f "$data/prompts-v2/prompts.jsonl.xz" ]]; then
        unpack_prompts  # built once: the committed corpus stays the corpus
        exit 0
    fi
    mkdir -p "$work/prompts-v1"
    python "$root/scripts/smollm2_prompts.py" --gsm8k "$eval_dir/gsm8k.jsonl" --out "$work/prompts-v1/prompts.jsonl"
    python "$root/scripts/smollm2_prompts.py" --gsm8k "$eval_dir/gsm8k.jsonl" --out "$work/prompts-v1/extra.jsonl" \
        --extra "$work/prompts-v1/prompts.jsonl"
    python "$root/scripts/smollm2_prompts.py" --gsm8k "$eval_dir/gsm8k.jsonl" --out "$work/prompts-v1/code3.jsonl" \
        --code-shapes "$work/prompts-v1/prompts.jsonl" "$work/prompts-v1/extra.jsonl"
    python "$root/scripts/build_training_prompts.py" --out "$work/prompts-v2" --heldout-dir "$root/benchmarks/prompts" \
        --gsm8k "$eval_dir/gsm8k.jsonl" --eval-dir "$eval_dir" --exclude-prompts "$work"/prompts-v1/*.jsonl \
        --tokenizer smollm2-135m-instruct --report "$root/benchmarks/results/smollm2-training/prompts-v2.json"
    for name in "${prompt_files[@]}"; do
        mkdir -p "$(dirname "$data/$name")"
        xz -9 -T1 -c "$work/$name.jsonl" > "$data/$name.jsonl.xz"
    done
    ;;
data)
    unpack_prompts
    regenerate "$work/conv-v2" "$work/prompts-v2/train.jsonl"
    regenerate "$work/conv-v1" "$work"/prompts-v1/{prompts,extra,code3}.jsonl
    ;;
pack)
    for name in conv-v2 conv-v1; do
        if [[ -d "$work/$name" ]]; then python "$root/scripts/pack_campaign_shards.py" "$work/$name" "$data/$name"; fi
    done
    ;;
stage4|train)
    stage=${STAGE:-4}
    from=${FROM:-$root/src/dspark_hf/drafters/dspark-smollm2-135m-instruct}
    if [[ -z ${FROM:-} && $stage -gt 4 ]]; then from=$data/stages/stage$((stage - 1)); fi
    [[ -f "$from/config.json" ]] || { echo "no drafter at $from: set FROM=DIR" >&2; exit 2; }
    tag=${TAG:-}
    out=$work/dspark$stage$tag
    bf16=$(python -c "import torch; from dspark_hf.models import target_dtype; print('--bf16' if target_dtype('auto') == torch.bfloat16 else '')")
    resume=() train_data=() grow=()
    if [[ -n ${GROW_LAYERS:-} ]]; then grow=(--grow_layers "$GROW_LAYERS"); fi
    if [[ -n ${GROW_MARKOV_RANK:-} ]]; then grow+=(--grow_markov_rank "$GROW_MARKOV_RANK"); fi
    if [[ -n ${DROP_MARKOV_HEAD:-} ]]; then grow+=(--drop_markov_head true); fi
    for name in conv-v2 conv-v1; do
        if compgen -G "$data/$name/*.parquet" > /dev/null; then train_data+=("$data/$name"); fi
    done
    if compgen -G "$out/checkpoint-*" > /dev/null; then
        resume=(--resume_from_checkpoint "$(ls -d "$out"/checkpoint-* | sort -t- -k2 -n | tail -1)")
    fi
    OMP_NUM_THREADS=2 dspark-hf train --target smollm2-135m-instruct --target_dtype auto $bf16 \
        --drafter "$from" "${grow[@]}" \
        --train_data "${train_data[@]}" --eval_split_size 64 --tau_eval_prompts 8 \
        --max_length 1024 --num_anchors 512 --per_device_train_batch_size 1 --gradient_accumulation_steps 4 \
        --learning_rate "${LR:-2e-4}" --lr_scheduler_type cosine --warmup_steps 0.02 --num_train_epochs 1 \
        --max_steps "${MAX_STEPS:--1}" \
        --eval_strategy "${EVAL_STRATEGY:-steps}" --eval_steps 1000 --save_strategy steps --save_steps 200 \
        --save_total_limit 2 --logging_steps 20 \
        --report_to none --seed "$stage" --output_dir "$out" "${resume[@]}" >> "$out.log" 2>&1
    # what the next stage starts from, committed: compact bf16 weights (the embedding and LM head come from the target)
    python -c "import sys, torch; from dspark_hf import DSparkDrafter; from dspark_hf.models import load_target
target, _ = load_target()
DSparkDrafter.from_pretrained(sys.argv[1], target=target, dtype=torch.float32).to(torch.bfloat16).save_compact(sys.argv[2])" \
        "$out" "$data/stages/stage$stage$tag"
    ;;
eval)
    candidate=${CANDIDATE:?CANDIDATE=drafter folder to compare with the shipped drafter}
    results=$root/benchmarks/results/smollm2-training/heldout-tau
    outputs=$results/outputs.trace.json.gz
    [[ -f "$outputs" ]] || { echo "no $outputs: trace the held-out sets first (scripts/campaign_eval.py)" >&2; exit 2; }
    # the shipped drafter's trace, cached per shipped weights (a new stage replaces them when it ships)
    shipped_trace=$work/shipped-$(sha256sum "$root/src/dspark_hf/drafters/dspark-smollm2-135m-instruct/model.safetensors" | cut -c1-12).trace.json.gz
    if [[ ! -f "$shipped_trace" ]]; then
        dspark-hf trace --outputs_from "$outputs" --threads "${THREADS:-1}" --output "$shipped_trace"
    fi
    dspark-hf trace --outputs_from "$outputs" --drafter "$candidate" --threads "${THREADS:-1}" \
        --output "$work/${NAME:-stage4}.trace.json.gz"
    python "$root/scripts/campaign_eval.py" shipped="$shipped_trace" \
        "${NAME:-stage4}=$work/${NAME:-stage4}.trace.json.gz" --output "$results/${NAME:-stage4}"
    ;;
judge)
    candidate=${CANDIDATE:?CANDIDATE=drafter folder to compare with the shipped drafter}
    name=${NAME:-stage4}
    shipped=$root/src/dspark_hf/drafters/dspark-smollm2-135m-instruct
    unpack_prompts
    if [[ ! -f "$work/$name-cal/calibration_report.json" ]]; then
        dspark-hf calibrate --drafter "$candidate" --prompts "$work/prompts-v2/calibration.jsonl" \
            --num_prompts "${CALIBRATION_PROMPTS:-96}" --max_new_tokens 128 --output_dir "$work/$name-cal" \
            > "$work/$name-cal.log" 2>&1
    fi
    results=$root/benchmarks/results/smollm2-training/stage-bench/$name
    mkdir -p "$results"
    cp "$work/$name-cal"/calibration_{report.json,reliability.png} "$results"/
    prompts=()
    for set in gsm8k humaneval mt-bench; do prompts+=("$eval_dir/$set.jsonl"); done
    dspark-hf bench --drafter "$work/$name-cal" --baseline_drafter "${BASELINE:-$shipped}" --policies "${POLICIES:-full,hardware_aware}" \
        --target_dtype auto --prompts "${prompts[@]}" --limit "${BENCH_PROMPTS:-6}" --max_new_tokens 256 \
        --output_dir "$results" --no_progress
    ;;
*)
    echo "unknown step '$step': use prompts, data, pack, train, eval or judge" >&2
    exit 2
    ;;
esac
