"""Per-generation statistics of DSpark speculative decoding: what was drafted, verified and accepted, and why."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DSparkRoundStats:
    """One draft-and-verify round.

    Attributes:
        confidences: calibrated c_k of the slots the policy looked at (empty without a confidence head).
        verified: drafts sent to the target (the policy's length ℓ).
        accepted: drafts the target accepted (0..verified); the round commits `accepted + 1` tokens.
        confidence_logits: raw (uncalibrated) confidence logits z_k matching `confidences` (for calibration).
        draft_ids: the verified drafts (tells an accepted EOS, which transformers counts as not accepted, from a
            rejection).
        drafted: `False` for a round where the drafter did not run: the policy skipped it (plain decoding: no drafts,
            no confidences), or prompt lookup supplied the drafts.
        source: where the verified drafts came from: `"drafter"`, or `"lookup"` (prompt lookup, see
            `generation/lookup.py`).
    """

    confidences: list[float]
    verified: int
    accepted: int = 0
    confidence_logits: list[float] = field(default_factory=list)
    draft_ids: list[int] = field(default_factory=list)
    drafted: bool = True
    source: str = "drafter"


@dataclass
class DSparkGenerationStats:
    """Statistics of one `generate` call, available afterwards as `drafter.generation_stats`."""

    block_size: int
    rounds: list[DSparkRoundStats] = field(default_factory=list)

    @property
    def num_rounds(self) -> int:
        return len(self.rounds)

    @property
    def skipped_rounds(self) -> int:
        """Rounds decoded without running the drafter (the policy judged drafting not worth its cost, or prompt lookup
        supplied the drafts)."""
        return sum(not r.drafted for r in self.rounds)

    @property
    def lookup_rounds(self) -> int:
        """Rounds that verified prompt-lookup drafts instead of the drafter's."""
        return sum(r.source == "lookup" for r in self.rounds)

    @property
    def drafted(self) -> int:
        """Drafts sampled (equal to `verified`: a draft is only sampled once the policy admits it)."""
        return self.verified

    @property
    def verified(self) -> int:
        return sum(r.verified for r in self.rounds)

    @property
    def accepted(self) -> int:
        return sum(r.accepted for r in self.rounds)

    @property
    def accept_lengths(self) -> list[int]:
        return [r.accepted for r in self.rounds]

    @property
    def tau(self) -> float:
        """Mean tokens committed per verification forward (accepted drafts + the bonus/corrected token)."""
        return (self.accepted + self.num_rounds) / self.num_rounds if self.rounds else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / verified drafts."""
        return self.accepted / self.verified if self.verified else 0.0

    def acceptance_by_position(self) -> list[float]:
        """For each slot k: P(draft k accepted | drafts < k accepted and draft k verified), over the drafter's rounds."""
        rates = []
        for k in range(1, self.block_size + 1):
            reached = [r for r in self.rounds if r.source == "drafter" and r.verified >= k and r.accepted >= k - 1]
            rates.append(sum(r.accepted >= k for r in reached) / len(reached) if reached else float("nan"))
        return rates

    def summary(self) -> dict:
        return {
            "rounds": self.num_rounds,
            "skipped_rounds": self.skipped_rounds,
            "lookup_rounds": self.lookup_rounds,
            "drafted": self.drafted,
            "verified": self.verified,
            "accepted": self.accepted,
            "tau": round(self.tau, 4),
            "acceptance_rate": round(self.acceptance_rate, 4),
            "accept_lengths": self.accept_lengths,
        }

    def __repr__(self) -> str:
        s = self.summary()
        return (
            f"DSparkGenerationStats(rounds={s['rounds']}, verified={s['verified']}, accepted={s['accepted']}, "
            f"tau={s['tau']}, accept_lengths={s['accept_lengths']})"
        )
