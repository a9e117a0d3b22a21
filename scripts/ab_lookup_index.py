"""The batched engine's prompt lookup with the incremental n-gram index (`PromptLookup.match_sequence`) against the
rescan of every row's sequence each round it replaced, A/B under load: target-only and hardware-aware + lookup (10
tokens) both ways, every closed loop stepped in turn on its own clock as `dspark-hf bench-load` runs them (bf16 where
native, lockstep budgets).

    python scripts/ab_lookup_index.py --levels 16 32 --output benchmarks/results/load-interleaved/lookup-index/ab.json
"""

from __future__ import annotations

import functools

import torch
from ab_engine_min_gain import parser, run_ab

from dspark_hf.generation.batched import DSparkBatchEngine
from dspark_hf.generation.lookup import MIN_NGRAM
from dspark_hf.generation.policies import HardwareAwarePolicy, PlannedWidthPolicy


class RescanningEngine(DSparkBatchEngine):
    """The engine as it was before the index: each row's whole sequence scanned every round."""

    def _lookup_matches(self, budgets):
        min_ngram = 1 if isinstance(self.policy, PlannedWidthPolicy) else MIN_NGRAM
        return [request.lookup.match(torch.tensor(request.sequence), budget, min_ngram)
                for request, budget in zip(self.active, budgets)]


def main() -> None:
    args = parser(__doc__).parse_args()
    lookup = {"prompt_lookup_num_tokens": 10}
    run_ab({"hardware_aware+lookup rescan": (HardwareAwarePolicy(str(args.sps)),
                                             functools.partial(RescanningEngine, **lookup)),
            "hardware_aware+lookup index": (HardwareAwarePolicy(str(args.sps)),
                                            functools.partial(DSparkBatchEngine, **lookup))}, args)


if __name__ == "__main__":
    main()
