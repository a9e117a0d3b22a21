"""A multi-turn chat with DSpark: each turn continues the target's cache of the last one and streams its reply.

On the offline embedded default (SmolLM2-135M-Instruct and its shipped drafter), with three scripted turns, or your own
with `--interactive`:

    python examples/chat.py
    python examples/chat.py --interactive
    python examples/chat.py --check      # also decode each turn target-only from its own cache and compare

Each turn's prompt is the whole conversation in the chat template; the cache of the last turn already holds the
positions this prompt repeats, so only the new user turn is prefilled (the template may write the last reply with other
tokens than were generated: the cache is cropped to the positions the prompt repeats token for token).
"""

import argparse
import inspect

import torch
from transformers import TextStreamer

import dspark_hf  # registers the classes and the generate integration
from dspark_hf import DSparkDrafter

TURNS = ("Write a Python function that checks whether a number is prime.",
         "Now make it faster for large numbers.",
         "Explain in two sentences why that is faster.")


def reusable(cache, previous: torch.Tensor, prompt: torch.Tensor):
    """`cache` cropped to the positions `prompt` repeats from `previous` (the last turn's sequence), or None."""
    if cache is None:
        return None
    width = min(previous.shape[1], prompt.shape[1])
    same = (previous[0, :width] == prompt[0, :width]).long().cumprod(0)
    shared = min(int(same.sum()), prompt.shape[1] - 1)  # the prompt's last token must be uncached
    if cache.get_seq_length() > shared:
        cache.crop(shared - cache.get_seq_length())
    return cache


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m-instruct", help="target name or path")
    parser.add_argument("--drafter", default=None, help="drafter path (default: the one shipped for the target)")
    parser.add_argument("--max_new_tokens", "--max-new-tokens", type=int, default=128)
    parser.add_argument("--interactive", action="store_true", help="type the user turns (an empty line ends)")
    parser.add_argument("--check", action="store_true", help="compare each turn with target-only decoding")
    args = parser.parse_args()

    target, tokenizer = dspark_hf.models.load_target(args.target)
    drafter = DSparkDrafter.from_pretrained(args.drafter or dspark_hf.models.EMBEDDED_DRAFTERS[args.target])
    # the cache's name in forward, generate and their outputs: `cache`, or `past_key_values` before transformers 5.24
    name = "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"
    settings = dict(do_sample=False, max_new_tokens=args.max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                    return_dict_in_generate=True)
    messages, cache, previous = [], None, None
    own_cache, own_previous = None, None  # target-only's, for --check
    turns = iter(lambda: input("\nyou> "), "") if args.interactive else iter(TURNS)
    for turn in turns:
        if not args.interactive:
            print(f"\nyou> {turn}")
        messages.append({"role": "user", "content": turn})
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                               return_dict=True)["input_ids"]
        cache = reusable(cache, previous, prompt)
        print(f"assistant ({prompt.shape[1] - (cache.get_seq_length() if cache else 0)} new prompt tokens)> ",
              end="", flush=True)
        out = target.generate(prompt, attention_mask=torch.ones_like(prompt), **{name: cache}, assistant_model=drafter,
                              streamer=TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True),
                              **settings)
        print(f"[tau {drafter.generation_stats.tau:.2f}]")
        if args.check:
            own = target.generate(prompt, attention_mask=torch.ones_like(prompt),
                                  **{name: reusable(own_cache, own_previous, prompt)}, **settings)
            print("identical to target-only:", torch.equal(own.sequences, out.sequences))
            own_cache, own_previous = getattr(own, name), own.sequences
        cache, previous = getattr(out, name), out.sequences
        reply = tokenizer.decode(out.sequences[0, prompt.shape[1]:], skip_special_tokens=True)
        messages.append({"role": "assistant", "content": reply})


if __name__ == "__main__":
    main()
