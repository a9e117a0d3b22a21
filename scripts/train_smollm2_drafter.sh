#!/usr/bin/env bash
# Reproduces the embedded default drafter for SmolLM2-135M-Instruct (and its DFlash ablation) on a 2-core CPU.
# Prompts: scripts/smollm2_prompts.py (gsm8k lines 501-1100, stdlib docstrings, /usr/share/doc); responses
# regenerated greedily by the target; never the evaluation prompts (gsm8k 1-500, humaneval, mbpp, mt-bench, math500).
# Usage: bash scripts/train_smollm2_drafter.sh WORK_DIR [OPTIMIZER_STEPS]
set -euo pipefail
work=${1:?work dir}; steps=${2:-1200}
mkdir -p "$work"
python scripts/smollm2_prompts.py --gsm8k "${GSM8K:-../shared/data/eval/gsm8k.jsonl}" --out "$work/prompts.jsonl"
dspark-hf prepare-data --prompts "$work/prompts.jsonl" --output_dir "$work/conv" --batch_size 32 \
    --max_new_tokens 192 --shard_size 32 --limit 512
common=(--train_data "$work/conv" --block_size 7 --num_hidden_layers 1 --mask_token_id 16
        --num_anchors 64 --max_length 512 --per_device_train_batch_size 1 --gradient_accumulation_steps 2
        --learning_rate 6e-4 --lr_scheduler_type cosine --warmup_steps 0.04 --max_steps "$steps"
        --save_steps 100 --save_total_limit 2 --logging_steps 20
        --eval_split_size 0 --report_to none --seed 0)
# The DSpark drafter and its DFlash ablation (markov_rank=0, same recipe), one core each, side by side.
OMP_NUM_THREADS=1 dspark-hf train "${common[@]}" --markov_rank 64 --output_dir "$work/dspark" > "$work/dspark.log" 2>&1 &
OMP_NUM_THREADS=1 dspark-hf train "${common[@]}" --markov_rank 0 --output_dir "$work/dflash" > "$work/dflash.log" 2>&1 &
wait
