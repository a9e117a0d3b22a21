"""Reduced draft vocabularies: draft only the tokens the target actually writes.

A drafter's LM head (and the Markov head's ``W2``) span the whole vocabulary, and on a CPU reading those weights is
a large part of every drafting pass. Keeping only the tokens the target produces in practice (FR-Spec, EAGLE-3's
``draft_vocab_size``) makes drafting cheaper at almost no cost in acceptance; verification stays the target's, so
output is unchanged.

```bash
dspark-hf reduce-vocab --drafter DRAFTER_DIR --data PREPARED_DATA_DIR --size 16384 --output_dir OUT
```

The set is ranked by how often each token appears in the responses of the drafter's training data (the target's own
generations, `dspark-hf prepare-data`), topped up with the lowest ids (BPE merge order, a proxy for corpus
frequency) and always including the end-of-sequence and special ids given.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from collections.abc import Iterable, Sequence

from .cli import ArgumentParser



def count_response_tokens(datasets_or_paths) -> Counter:
    """Token frequencies over the supervised (response) positions of prepared training data.

    Args:
        datasets_or_paths: a `datasets.Dataset` with `input_ids` and `loss_mask`, or paths accepted by
            [`dspark_hf.training.data.load_training_dataset`].
    """
    dataset = datasets_or_paths
    if not hasattr(dataset, "column_names"):
        from .training.data import load_training_dataset

        dataset = load_training_dataset(datasets_or_paths)
    counts: Counter = Counter()
    for example in dataset.select_columns(["input_ids", "loss_mask"]).iter(batch_size=256):
        for ids, mask in zip(example["input_ids"], example["loss_mask"]):
            counts.update(token for token, keep in zip(ids, mask) if keep)
    return counts


def select_draft_vocabulary(
    counts: Counter | dict[int, int], size: int, vocab_size: int, always: Iterable[int] = ()
) -> list[int]:
    """The `size` target ids to draft: `always`, then the most frequent in `counts`, then the lowest ids.

    Returns the ids sorted ascending (the draft-id order of the `d2t` convention).
    """
    if not 0 < size <= vocab_size:
        raise ValueError(f"size must be in [1, vocab_size={vocab_size}], got {size}.")
    chosen: dict[int, None] = {}
    for token in always:
        if not 0 <= int(token) < vocab_size:
            raise ValueError(f"always-kept id {token} is outside [0, {vocab_size}).")
        chosen[int(token)] = None
    if len(chosen) > size:
        raise ValueError(f"{len(chosen)} ids must always be kept, more than size={size}.")
    for token, _ in sorted(counts.items(), key=lambda item: (-item[1], item[0])):
        if len(chosen) == size:
            break
        if 0 <= int(token) < vocab_size:
            chosen.setdefault(int(token), None)
    token = 0
    while len(chosen) < size:
        chosen.setdefault(token, None)
        token += 1
    return sorted(chosen)


def special_token_ids(config) -> list[int]:
    """The end-of-sequence (one or several), beginning-of-sequence and padding ids of a drafter config: always kept."""
    eos = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
    return [t for t in [*eos, config.bos_token_id, config.pad_token_id] if t is not None]


def coverage(counts: Counter | dict[int, int], token_ids: Sequence[int]) -> float:
    """Fraction of the counted tokens inside `token_ids` (1.0 when nothing was counted)."""
    total = sum(counts.values())
    kept = set(int(t) for t in token_ids)
    return sum(c for t, c in counts.items() if t in kept) / total if total else 1.0


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(
        prog="dspark-hf reduce-vocab", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--drafter", required=True, help="trained drafter folder (full vocabulary)")
    parser.add_argument("--data", nargs="+", required=True, help="prepared training data (`dspark-hf prepare-data`)")
    parser.add_argument("--size", type=int, default=16384, help="draft vocabulary size (default 16384)")
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--target", default=None,
                        help="target (folder, Hub id or embedded name) whose embedding and LM head a compact drafter "
                             "binds; default: the embedded SmolLM2 target")
    parser.add_argument("--compact", action="store_true",
                        help="save without embed_tokens / lm_head (dspark-hf binds the target's at load time)")
    args = parser.parse_args(argv)

    from .modeling_dspark import DSparkDrafter
    from .models import DEFAULT_TARGET, check_model_path, load_target

    check_model_path(args.drafter)
    try:
        drafter = DSparkDrafter.from_pretrained(args.drafter, dtype="auto")
    except ValueError as error:
        if "compact drafter" not in str(error):
            raise
        target, _ = load_target(args.target or DEFAULT_TARGET, packed_linear="off")  # only its vocabulary is read
        drafter = DSparkDrafter.from_pretrained(args.drafter, target=target, dtype="auto")
    config = drafter.config
    counts = count_response_tokens(args.data)
    ids = select_draft_vocabulary(counts, args.size, config.vocab_size, special_token_ids(config))
    drafter.reduce_vocabulary(ids)
    (drafter.save_compact if args.compact else drafter.save_pretrained)(args.output_dir)
    print(f"draft vocabulary: {len(ids)} of {config.vocab_size} ids; {len(counts)} distinct response tokens counted, "
          f"{coverage(counts, ids):.4f} of response tokens covered; saved to {args.output_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
