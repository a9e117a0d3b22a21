#!/usr/bin/env bash
# Reproduces the embedded default drafter for SmolLM2-135M-Instruct (and its DFlash ablation) on a 2-core CPU.
# Prompts: scripts/smollm2_prompts.py (gsm8k lines 501-1100, stdlib docstrings, /usr/share/doc); responses
# regenerated greedily by the target; never the evaluation prompts (gsm8k 1-500, humaneval, mbpp, mt-bench, math500).
# Stage 1: 512 prompts, 1000 steps from scratch. Stage 2: the rest of the first set plus 1,098 extra prompts
# (2,270 conversations, ~305k response tokens), 800 more steps. Stage 3: 900 code prompts in two more shapes, 1050 more
# steps with 128 anchors per sequence (lr 2e-4). About 5 h on 2 cores.
# Then calibrate on all 219 gsm8k lines after the training ones (a quarter held out for the report):
#   dspark-hf calibrate --drafter WORK_DIR/dspark3 --prompts ../shared/data/eval/gsm8k.jsonl --first_line 1101 \
#       --num_prompts 219 --output_dir WORK_DIR/dspark3_cal
# and scripts/package_embedded_drafter.py (with --draft-vocab-size 8192 --data WORK_DIR/conv*: the reduced draft
# vocabulary, see dspark_hf/vocabulary.py).
# Usage: bash scripts/train_smollm2_drafter.sh WORK_DIR
set -euo pipefail
work=${1:?work dir}
mkdir -p "$work"
gsm8k=${GSM8K:-../shared/data/eval/gsm8k.jsonl}
python scripts/smollm2_prompts.py --gsm8k "$gsm8k" --out "$work/prompts.jsonl"
python scripts/smollm2_prompts.py --gsm8k "$gsm8k" --out "$work/extra.jsonl" --extra "$work/prompts.jsonl"
prepare() {  # prepare FILE OUT START LIMIT, on one core
    OMP_NUM_THREADS=1 dspark-hf prepare-data --prompts "$1" --output_dir "$2" --batch_size 32 --max_new_tokens 192 \
        --shard_size 32 --start "$3" --limit "$4" > "$2.log" 2>&1
}
train_both() {  # train_both OUT_SUFFIX ARGS...: the DSpark drafter and its DFlash ablation, one core each
    local suffix=$1; shift
    OMP_NUM_THREADS=1 dspark-hf train "$@" --markov_rank 64 ${init_dspark:-} --output_dir "$work/dspark$suffix" \
        > "$work/dspark$suffix.log" 2>&1 &
    OMP_NUM_THREADS=1 dspark-hf train "$@" --markov_rank 0 ${init_dflash:-} --output_dir "$work/dflash$suffix" \
        > "$work/dflash$suffix.log" 2>&1 &
    wait
}
common=(--num_anchors 64 --max_length 512 --per_device_train_batch_size 1 --gradient_accumulation_steps 2
        --lr_scheduler_type cosine --save_steps 100 --save_total_limit 2 --logging_steps 20
        --eval_split_size 0 --report_to none)

# Stage 1
prepare "$work/prompts.jsonl" "$work/conv" 0 512
train_both 1 "${common[@]}" --train_data "$work/conv" --block_size 7 --num_hidden_layers 1 --mask_token_id 16 \
    --learning_rate 6e-4 --warmup_steps 0.04 --max_steps 1000 --seed 0

# Stage 2: more regenerated data, continue both drafters
prepare "$work/prompts.jsonl" "$work/conv2a" 512 382 & prepare "$work/prompts.jsonl" "$work/conv2b" 894 382 & wait
prepare "$work/extra.jsonl" "$work/conv3a" 0 549 & prepare "$work/extra.jsonl" "$work/conv3b" 549 549 & wait
init_dspark="--drafter $work/dspark1" init_dflash="--drafter $work/dflash1" train_both "" "${common[@]}" \
    --train_data "$work/conv" "$work/conv2a" "$work/conv2b" "$work/conv3a" "$work/conv3b" \
    --learning_rate 3e-4 --warmup_steps 0.02 --max_steps 800 --seed 1

# Stage 3: code in the shapes users send (stub completion, one-line request), continue both drafters on everything
python scripts/smollm2_prompts.py --gsm8k "$gsm8k" --out "$work/code3.jsonl" --code-shapes "$work/prompts.jsonl" \
    "$work/extra.jsonl"
prepare "$work/code3.jsonl" "$work/conv4a" 0 450 & prepare "$work/code3.jsonl" "$work/conv4b" 450 450 & wait
init_dspark="--drafter $work/dspark" init_dflash="--drafter $work/dflash" train_both 3 "${common[@]}" \
    --train_data "$work/conv" "$work/conv2a" "$work/conv2b" "$work/conv3a" "$work/conv3b" "$work/conv4a" \
    "$work/conv4b" --num_anchors 128 --learning_rate 2e-4 --warmup_steps 0.02 --max_steps ${STAGE3_STEPS:-1050} --seed 2
