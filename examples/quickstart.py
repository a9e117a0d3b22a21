"""Quickstart: DSpark speculative decoding through `model.generate`.

Runs on any decoder-only target. By default it builds a tiny random Llama so it runs anywhere in seconds; pass a
model name or path (e.g. `smollm2-135m-instruct`, the offline embedded default) to use a real one:

    python examples/quickstart.py
    python examples/quickstart.py --target smollm2-135m-instruct --drafter path/to/drafter
"""

import argparse

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import dspark_hf  # registers the classes and the generate integration
from dspark_hf import DSparkDrafter


def tiny_target() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, eos_token_id=None)
    return LlamaForCausalLM(config).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=None, help="target name or path (default: a tiny random Llama)")
    parser.add_argument("--drafter", default=None, help="drafter path or repo id (default: a fresh untrained one)")
    parser.add_argument("--max_new_tokens", "--max-new-tokens", type=int, default=48)
    args = parser.parse_args()

    if args.target is None:
        target, inputs = tiny_target(), {"input_ids": torch.tensor([[1, 17, 42, 99, 7]])}
    else:
        target, tokenizer = dspark_hf.models.load_target(args.target)
        messages = [{"role": "user", "content": "Write a Python function that reverses a string."}]
        inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                               return_dict=True)

    if args.drafter is None:
        drafter = DSparkDrafter.from_target(target, block_size=7, num_hidden_layers=1, markov_rank=64)  # untrained
    else:
        drafter = DSparkDrafter.from_pretrained(args.drafter)

    reference = target.generate(**inputs, do_sample=False, max_new_tokens=args.max_new_tokens)
    out = target.generate(**inputs, assistant_model=drafter, do_sample=False, max_new_tokens=args.max_new_tokens)
    print("identical to target-only greedy:", torch.equal(out, reference))
    print(drafter.generation_stats)          # rounds, verified, accepted, per-round accept lengths, tau

    sampled = target.generate(**inputs, assistant_model=drafter, do_sample=True, max_new_tokens=args.max_new_tokens)
    print("sampled", sampled.shape[1] - inputs["input_ids"].shape[1], "tokens; tau =",
          round(drafter.generation_stats.tau, 2))
    if not torch.equal(out, reference):
        raise SystemExit("greedy DSpark output differs from the target's: please report this bug")


if __name__ == "__main__":
    main()
