"""The engine's payoff guard (`PlannedWidthPolicy.payoff_guard`) measured A/B under load: target-only and the
hardware-aware engine with and without it, every closed loop stepped in turn on its own clock
(`run_level_interleaved`, as `dspark-hf bench-load` runs), bf16 where native, lockstep budgets of 256 tokens.

The replay (`dspark-hf simulate`) cannot judge it: on its cost model the drafted rounds at 32 rows pay (their plans are
as right as the costs it was fitted to), and the guard never engages there.

    python scripts/ab_payoff_guard.py --levels 8 16 32 --output benchmarks/results/load-interleaved/payoff-guard/ab.json
    # hardware-aware + prompt lookup inside rounds (10 tokens), as `bench-load --methods hardware_aware+lookup`
    python scripts/ab_payoff_guard.py --lookup 10 --levels 16 32 --output .../ab-lookup.json
"""

from __future__ import annotations

from functools import partial

from ab_engine_min_gain import parser, run_ab
from dspark_hf.generation.batched import DSparkBatchEngine
from dspark_hf.generation.policies import HardwareAwarePolicy


def main() -> None:
    arguments = parser(__doc__)
    arguments.add_argument("--lookup", type=int, default=0, help="prompt lookup tokens inside rounds (0: none)")
    args = arguments.parse_args()
    engine = partial(DSparkBatchEngine, prompt_lookup_num_tokens=args.lookup or None)
    name = "hardware_aware+lookup" if args.lookup else "hardware_aware"
    # one policy per variant for the whole run, as bench-load keeps one per method (its step timings carry over)
    run_ab({f"{name} (payoff guard)": (HardwareAwarePolicy(str(args.sps)), engine),
            f"{name} (no guard)": (HardwareAwarePolicy(str(args.sps), payoff_guard=False), engine)}, args)


if __name__ == "__main__":
    main()
