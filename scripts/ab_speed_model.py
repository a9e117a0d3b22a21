"""The speed model's wide steps read relative to plain decoding (`generation/speed_model.py`) against absolute
medians (the model before 2026-12-06), measured A/B under load: target-only and the hardware-aware engine with each
model, every closed loop stepped in turn on its own clock, bf16 where native, lockstep budgets of 256 tokens.

    python scripts/ab_speed_model.py --levels 4 8 16 32 --output benchmarks/results/load-interleaved/speed-model/ab.json
    python scripts/ab_speed_model.py --levels 16 32 --repeats 2 --output .../speed-model-2/ab.json
"""

from __future__ import annotations

import statistics
from collections import deque

from ab_engine_min_gain import parser, run_ab
from dspark_hf.generation import speed_model
from dspark_hf.generation.policies import HardwareAwarePolicy


class AbsoluteSpeedModel(speed_model.SpeedModel):
    """The model as it was: every size's median of its last 5 steps, in seconds, whenever it was timed."""

    def record_step_seconds(self, seconds: float, rows: int, width: int) -> None:
        recent = self._timings.setdefault((rows, width), deque(maxlen=speed_model.WINDOW))
        recent.append(seconds)
        self._step_seconds[(rows, width)] = statistics.median(recent)


def main() -> None:
    args = parser(__doc__).parse_args()
    absolute = HardwareAwarePolicy(str(args.sps))
    absolute.speed_model.__class__ = AbsoluteSpeedModel  # never fills the relative table: absolute medians only
    run_ab({"hardware_aware (relative steps)": HardwareAwarePolicy(str(args.sps)),
            "hardware_aware (absolute steps)": absolute}, args)


if __name__ == "__main__":
    main()
