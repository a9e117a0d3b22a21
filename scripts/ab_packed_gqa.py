"""Packed grouped-query attention (`dspark_hf.generation.gqa.packed_gqa`) in the batched engine, A/B under load:
target-only, the hardware-aware engine without packing (its verification forwards on `enable_gqa` alone, as before)
and with it, every closed loop stepped in turn on its own clock as `dspark-hf bench-load` runs them (bf16 where
native, lockstep budgets).

    python scripts/ab_packed_gqa.py --levels 8 16 32 --output benchmarks/results/gqa/packed-load/ab.json
"""

from __future__ import annotations

from ab_engine_min_gain import parser, run_ab

from dspark_hf.generation import gqa
from dspark_hf.generation.batched import DSparkBatchEngine
from dspark_hf.generation.policies import HardwareAwarePolicy


class UnpackedEngine(DSparkBatchEngine):
    """The engine as it was before packing: its target forwards never pack query heads."""

    def _target_forward(self, *args, **kwargs):
        packed_up_to, gqa.MAX_PACKED_TOKENS = gqa.MAX_PACKED_TOKENS, 1
        try:
            return super()._target_forward(*args, **kwargs)
        finally:
            gqa.MAX_PACKED_TOKENS = packed_up_to


def main() -> None:
    args = parser(__doc__).parse_args()
    run_ab({"hardware_aware unpacked": (HardwareAwarePolicy(str(args.sps)), UnpackedEngine),
            "hardware_aware packed": (HardwareAwarePolicy(str(args.sps)), DSparkBatchEngine)}, args)


if __name__ == "__main__":
    main()
