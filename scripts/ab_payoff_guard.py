"""The engine's payoff guard (`PlannedWidthPolicy.payoff_guard`) measured A/B under load: target-only and the
hardware-aware engine with and without it, every closed loop stepped in turn on its own clock
(`run_level_interleaved`, as `dspark-hf bench-load` runs), bf16 where native, lockstep budgets of 256 tokens.

The replay (`dspark-hf simulate`) cannot judge it: on its cost model the drafted rounds at 32 rows pay (their plans are
as right as the costs it was fitted to), and the guard never engages there.

    python scripts/ab_payoff_guard.py --levels 8 16 32 --output benchmarks/results/load-interleaved/payoff-guard/ab.json
"""

from __future__ import annotations

from ab_engine_min_gain import parser, run_ab
from dspark_hf.generation.policies import HardwareAwarePolicy


def main() -> None:
    args = parser(__doc__).parse_args()
    # one policy per variant for the whole run, as bench-load keeps one per method (its step timings carry over)
    run_ab({"hardware_aware (payoff guard)": HardwareAwarePolicy(str(args.sps)),
            "hardware_aware (no guard)": HardwareAwarePolicy(str(args.sps), payoff_guard=False)}, args)


if __name__ == "__main__":
    main()
