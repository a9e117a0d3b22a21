"""Sequential Temperature Scaling (STS) of the confidence head, its metrics, and `dspark-hf calibrate`.

The scheduler needs *absolute* prefix survival probabilities ``a_k = Π_{i<=k} c_i`` (docs/design.md, "Calibration"), so
the confidence logits ``z_k`` get one temperature per position: ``c_k = σ(z_k / T_k)``. STS fits them left to right on
rounds verified at full length, each minimizing the ECE of ``a_k`` against the accept-prefix label ``y_k = 1[drafts 1..k
all accepted]`` with the earlier temperatures fixed. Temperature scaling preserves the order of confidences, so it
changes what the scheduler believes, never how the head ranks drafts.

```bash
dspark-hf calibrate --drafter path/to/drafter --target smollm2-135m-instruct \
    --prompts /work/shared/data/eval/gsm8k.jsonl --first_line 501 --num_prompts 64
```

The metric functions and `fit_sequential_temperatures` are pure (arrays in, numbers out).
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from transformers.utils import logging


logger = logging.get_logger(__name__)

NUM_BINS = 20
# 49 log-spaced temperatures from 1/8 to 8 (ratio 2^(1/8) ~ 1.09 between neighbours); includes 1.
DEFAULT_TEMPERATURE_GRID = tuple(2.0 ** (i / 8) for i in range(-24, 25))


def _to_numpy(values, dtype=np.float64) -> np.ndarray:
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().double() if dtype != bool else values.detach().cpu()
        values = values.numpy()
    return np.asarray(values, dtype=dtype)


def _probabilities_and_labels(probabilities, labels) -> tuple[np.ndarray, np.ndarray]:
    p, y = _to_numpy(probabilities).ravel(), _to_numpy(labels).ravel()
    if p.shape != y.shape:
        raise ValueError(f"probabilities and labels differ in size: {p.size} vs {y.size}.")
    if p.size and (np.isnan(p).any() or p.min() < 0 or p.max() > 1):
        raise ValueError(f"probabilities must lie in [0, 1]; got values in [{p.min()}, {p.max()}].")
    if not np.isin(y, (0.0, 1.0)).all():
        raise ValueError(f"labels must be 0 or 1; got {np.unique(y)[:10]}.")
    return p, y


def reliability_table(probabilities, labels, num_bins: int = NUM_BINS) -> dict[str, list]:
    """Per equal-width bin of [0, 1]: sample count, mean predicted probability, empirical frequency (NaN if empty).

    Bin b holds ``b / num_bins <= p < (b + 1) / num_bins``; p = 1 goes to the last bin.
    """
    p, y = _probabilities_and_labels(probabilities, labels)
    bins = np.minimum((p * num_bins).astype(np.int64), num_bins - 1)
    counts = np.bincount(bins, minlength=num_bins)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_p = np.bincount(bins, weights=p, minlength=num_bins) / counts
        freq = np.bincount(bins, weights=y, minlength=num_bins) / counts
    return {"counts": counts.tolist(), "mean_probability": mean_p.tolist(), "frequency": freq.tolist()}


def expected_calibration_error(probabilities, labels, num_bins: int = NUM_BINS) -> float:
    """ECE with `num_bins` equal-width bins: ``Σ_b (n_b / N) · |mean p_b − mean y_b|`` (NaN without samples).

    Example:

    ```python
    >>> from dspark_hf.calibration import expected_calibration_error
    >>> round(expected_calibration_error([0.9, 0.9, 0.2, 0.2], [1, 0, 0, 0]), 4)
    0.3

    ```
    """
    p, y = _probabilities_and_labels(probabilities, labels)
    if p.size == 0:
        return float("nan")
    bins = np.minimum((p * num_bins).astype(np.int64), num_bins - 1)
    gap = np.bincount(bins, weights=p - y, minlength=num_bins)  # n_b · (mean p_b − mean y_b)
    return float(np.abs(gap).sum() / p.size)


def auroc(scores, labels) -> float:
    """Area under the ROC curve: P(score of a positive > score of a negative), ties counted half (Mann-Whitney U).

    NaN when the labels hold a single class.
    """
    s, y = _to_numpy(scores).ravel(), _to_numpy(labels).ravel()
    if s.shape != y.shape:
        raise ValueError(f"scores and labels differ in size: {s.size} vs {y.size}.")
    num_pos, num_neg = int((y == 1).sum()), int((y == 0).sum())
    if num_pos == 0 or num_neg == 0:
        return float("nan")
    _, inverse, tie_counts = np.unique(s, return_inverse=True, return_counts=True)
    # 1-based average rank of each distinct score: ties share the mean of the ranks they span.
    average_rank = np.cumsum(tie_counts) - (tie_counts - 1) / 2.0
    rank_sum = average_rank[inverse][y == 1].sum()
    return float((rank_sum - num_pos * (num_pos + 1) / 2.0) / (num_pos * num_neg))


def brier(probabilities, labels) -> float:
    """Brier score: mean of ``(p − y)²`` (NaN without samples)."""
    p, y = _probabilities_and_labels(probabilities, labels)
    return float(np.mean((p - y) ** 2)) if p.size else float("nan")


def _check_round_arrays(logits, labels, valid) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    z, y = _to_numpy(logits), _to_numpy(labels)
    mask = np.ones_like(z, dtype=bool) if valid is None else _to_numpy(valid, dtype=bool)
    if z.ndim != 2 or z.shape != y.shape or z.shape != mask.shape:
        raise ValueError(
            f"logits, labels and valid must share one (rounds, positions) shape; got {z.shape}, {y.shape}, "
            f"{mask.shape}."
        )
    if (mask[:, 1:] & ~mask[:, :-1]).any():
        raise ValueError("valid must be a prefix in every round (position k valid => positions < k valid).")
    if not np.isfinite(z[mask]).all() or not np.isin(y[mask], (0.0, 1.0)).all():
        raise ValueError("valid logits must be finite and valid labels must be 0 or 1.")
    return z, y, mask


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))  # overflow-free σ


def cumulative_confidences(logits, temperatures: Sequence[float] | None = None) -> np.ndarray:
    """``a[n, k] = Π_{i<=k} σ(z[n, i] / T_i)`` for confidence logits `(rounds, positions)` (T = 1 if not given)."""
    z = _to_numpy(logits)
    temps = np.ones(z.shape[-1]) if temperatures is None else _to_numpy(temperatures)
    if temps.shape != (z.shape[-1],) or (temps <= 0).any():
        raise ValueError(f"Need {z.shape[-1]} positive temperatures, got {list(temps)}.")
    return np.cumprod(_sigmoid(z / temps), axis=-1)


def fit_sequential_temperatures(
    logits, labels, valid=None, grid: Sequence[float] = DEFAULT_TEMPERATURE_GRID, num_bins: int = NUM_BINS
) -> list[float]:
    """Sequential Temperature Scaling (docs/design.md, "Calibration"): one temperature per position, fitted left to
    right.

    For k = 1..B, ``T_k`` is the grid value minimizing the ECE of ``Π_{i<k} σ(z_i / T_i) · σ(z_k / T)`` against
    ``y_k`` over the rounds where position k is valid, with ``T_1..T_{k-1}`` already fixed. Ties go to the
    temperature closest to 1; a position without samples keeps T = 1.

    Args:
        logits (`array` of shape `(rounds, positions)`): raw confidence logits ``z``.
        labels (`array` of shape `(rounds, positions)`): ``y[n, k] = 1`` iff drafts 1..k of round n were accepted.
        valid (`array` of shape `(rounds, positions)`, *optional*): which entries were observed (a prefix per
            round: the slots drafted and verified, cut after an accepted EOS). Defaults to all.
        grid (`Sequence[float]`): candidate temperatures (default: 49 log-spaced values in [1/8, 8]).
        num_bins (`int`): ECE bins.

    Returns:
        `list[float]`: ``T_1..T_B``.
    """
    z, y, mask = _check_round_arrays(logits, labels, valid)
    grid = np.asarray(sorted(set(float(t) for t in grid)))
    if grid.size == 0 or (grid <= 0).any():
        raise ValueError(f"grid must hold positive temperatures, got {list(grid)}.")
    prefix = np.ones(z.shape[0])  # Π_{i<k} σ(z_i / T_i) with the temperatures fitted so far
    temperatures = []
    for k in range(z.shape[1]):
        rows = mask[:, k]
        if not rows.any():
            temperatures.append(1.0)
            continue
        errors = np.array([
            expected_calibration_error(prefix[rows] * _sigmoid(z[rows, k] / t), y[rows, k], num_bins) for t in grid
        ])
        best = np.flatnonzero(errors <= errors.min() + 1e-12)
        temperature = float(grid[best[np.argmin(np.abs(np.log(grid[best])))]])
        temperatures.append(temperature)
        prefix = prefix * _sigmoid(z[:, k] / temperature)
    return temperatures


def calibration_metrics(logits, labels, valid=None, temperatures=None, num_bins: int = NUM_BINS) -> dict:
    """ECE / AUROC / Brier of the cumulative confidences ``a_k`` against ``y_k``, pooled over valid (round,
    position) pairs as DeepSpec's evaluator reports them, plus per-position figures and the reliability table."""
    z, y, mask = _check_round_arrays(logits, labels, valid)
    a = cumulative_confidences(z, temperatures)
    p, t = a[mask], y[mask]
    per_position = []
    for k in range(z.shape[1]):
        rows = mask[:, k]
        per_position.append({
            "position": k + 1,
            "num_samples": int(rows.sum()),
            "ece": expected_calibration_error(a[rows, k], y[rows, k], num_bins),
            "mean_survival": float(a[rows, k].mean()) if rows.any() else float("nan"),
            "accept_rate": float(y[rows, k].mean()) if rows.any() else float("nan"),
        })
    return {
        "num_samples": int(mask.sum()),
        "ece": expected_calibration_error(p, t, num_bins),
        "auroc": auroc(p, t),
        "brier": brier(p, t),
        "mean_survival": float(p.mean()) if p.size else float("nan"),
        "accept_rate": float(t.mean()) if t.size else float("nan"),
        "per_position": per_position,
        "reliability": reliability_table(p, t, num_bins),
    }


# ----------------------------------------------------------------------------------------------------------------------
# Recording rounds verified at full length
# ----------------------------------------------------------------------------------------------------------------------


@dataclass
class CalibrationData:
    """Confidence logits and accept-prefix labels of full-length rounds, `(rounds, block_size)` each."""

    logits: np.ndarray
    labels: np.ndarray
    valid: np.ndarray

    @classmethod
    def concatenate(cls, parts: Sequence["CalibrationData"], block_size: int) -> "CalibrationData":
        parts = [p for p in parts if len(p.logits)]
        if not parts:
            empty = np.zeros((0, block_size))
            return cls(empty, empty.copy(), empty.astype(bool))
        return cls(*(np.concatenate([getattr(p, name) for p in parts]) for name in ("logits", "labels", "valid")))


def calibration_data_from_stats(stats, output_ids: Sequence[int] = (), eos_token_ids: Sequence[int] = ()):
    """Turns one `generate` call's round statistics (recorded with the full policy) into `CalibrationData`.

    Slot k of a round is valid if it was drafted and verified; its label is ``accepted >= k``. When the output ends
    with an EOS token, transformers stops the last round at it and reports the EOS draft as not accepted, so that
    round is corrected: an accepted EOS draft (known from the round's `draft_ids`, when recorded) is labelled
    accepted and the slots after it are cut off; without draft ids the ambiguous slot is cut off too.

    Args:
        stats ([`DSparkGenerationStats`]): `drafter.generation_stats` after the call.
        output_ids (`Sequence[int]`): the generated sequence (only its last token is read).
        eos_token_ids (`Sequence[int]`): the call's EOS ids.
    """
    block_size = stats.block_size
    logits, labels, valid = (np.zeros((len(stats.rounds), block_size)) for _ in range(3))
    valid = valid.astype(bool)
    ended_with_eos = len(output_ids) > 0 and int(output_ids[-1]) in {int(e) for e in eos_token_ids}
    for n, round_stats in enumerate(stats.rounds):
        raw = list(round_stats.confidence_logits)
        num_valid, accepted = min(len(raw), round_stats.verified), round_stats.accepted
        if ended_with_eos and n == len(stats.rounds) - 1 and accepted < num_valid:
            drafts = getattr(round_stats, "draft_ids", None) or None  # unrecorded: None or []
            if drafts is not None and int(drafts[accepted]) == int(output_ids[-1]):
                accepted += 1  # the EOS draft itself was accepted; nothing after it counts
                num_valid = accepted
            elif drafts is None:
                num_valid = accepted  # cannot tell an accepted EOS from a rejection: drop the uncertain slot
        logits[n, :num_valid] = raw[:num_valid]
        labels[n, :num_valid] = [float(accepted >= k) for k in range(1, num_valid + 1)]
        valid[n, :num_valid] = True
    keep = valid.any(axis=1)
    return CalibrationData(logits[keep], labels[keep], valid[keep])


@torch.no_grad()
def collect_calibration_data(
    target, drafter, input_ids: torch.LongTensor, max_new_tokens: int = 128, temperature: float = 0.0, **generate_kwargs
) -> tuple[CalibrationData, torch.LongTensor]:
    """Generates from one prompt with the full-block policy and records its rounds.

    Args:
        target ([`PreTrainedModel`]), drafter ([`DSparkDrafter`]): the pair to calibrate (the drafter needs a
            confidence head).
        input_ids (`torch.LongTensor` of shape `(1, seq)`): the prompt.
        temperature (`float`): 0 for greedy decoding, else sampling at this temperature (no top-k/top-p, the
            distribution the confidence head is trained against).

    Returns:
        `(CalibrationData, torch.LongTensor)`: the rounds, and the generated sequence `(1, seq + new)`.
    """
    from .generation.policies import FullBlockPolicy

    if drafter.confidence_head is None:
        raise ValueError(
            "This drafter has no confidence head (enable_confidence_head=false); there is nothing to calibrate."
        )
    sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else {}
    previous_policy = getattr(drafter, "verification_policy", None)
    drafter.verification_policy = FullBlockPolicy()
    try:
        output = target.generate(
            input_ids.to(target.device),
            attention_mask=torch.ones_like(input_ids).to(target.device),
            assistant_model=drafter,
            max_new_tokens=max_new_tokens,
            **({"do_sample": False} | sampling | generate_kwargs),
        )
    finally:
        drafter.verification_policy = previous_policy
    eos = target.generation_config.eos_token_id
    eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    data = calibration_data_from_stats(drafter.generation_stats, output[0].tolist(), eos)
    return data, output


# ----------------------------------------------------------------------------------------------------------------------
# `dspark-hf calibrate`
# ----------------------------------------------------------------------------------------------------------------------


@dataclass
class CalibrateArguments:
    drafter: str = field(metadata={"help": "drafter folder to calibrate"})
    prompts: str = field(metadata={"help": "held-out prompts: JSON lines with a `turns` list (the first turn is used)"})
    target: str = field(default="smollm2-135m-instruct", metadata={"help": "target: embedded name, Hub id or folder"})
    first_line: int = field(default=1, metadata={"help": "1-based first line of the prompt file to use"})
    num_prompts: int = field(default=64, metadata={"help": "number of prompts to generate from"})
    max_new_tokens: int = field(default=128, metadata={"help": "tokens generated per prompt"})
    temperature: float = field(default=0.0, metadata={"help": "0 = greedy (the labels then are greedy acceptance)"})
    eval_fraction: float = field(
        default=0.25, metadata={"help": "share of prompts held out of the fit to report honest after-metrics"}
    )
    output_dir: str | None = field(
        default=None, metadata={"help": "where to save the calibrated drafter (default: update the drafter in place)"}
    )
    report: str | None = field(
        default=None, metadata={"help": "report JSON (default: OUTPUT_DIR/calibration_report.json)"}
    )
    plot: str | None = field(
        default=None, metadata={"help": "reliability PNG (default: OUTPUT_DIR/calibration_reliability.png)"}
    )
    device: str | None = field(default=None, metadata={"help": "cuda, cpu, ... (default: cuda if available)"})
    seed: int = field(default=0, metadata={"help": "random seed (sampling)"})


def read_prompts(path: str | Path, first_line: int = 1, num_prompts: int | None = None) -> list[str]:
    """First user turns of a JSON-lines prompt file, from 1-based `first_line`. Records take the forms that
    `dspark-hf prepare-data` reads (`turns`, `messages`/`conversations`, or a `prompt`/`question`/`instruction`/...
    field; see `dspark_hf.training.data.record_to_prompt`)."""
    from .training.data import record_to_prompt

    if not Path(path).is_file():
        raise FileNotFoundError(f"--prompts {path}: no such file (JSON lines, one prompt record per line).")
    prompts = []
    with open(path) as f:
        for line_number, line in enumerate(f, start=1):
            if line_number < first_line or not line.strip():
                continue
            if num_prompts is not None and len(prompts) >= num_prompts:
                break
            try:
                turns = record_to_prompt(json.loads(line))["turns"]
            except (json.JSONDecodeError, ValueError) as error:
                raise ValueError(f"{path}:{line_number}: {error}") from None
            prompts.append(turns[0])
    if not prompts:
        raise ValueError(f"No prompts in {path} from line {first_line}.")
    return prompts


def encode_chat_prompt(tokenizer, text: str) -> torch.LongTensor:
    """`(1, seq)` ids of a one-turn user chat, ready for the assistant's answer."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("The tokenizer of this target has no chat template; calibrate with an instruct (chat) target.")
    encoded = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, return_dict=True, return_tensors="pt"
    )
    return encoded["input_ids"]


def plot_reliability(before: dict, after: dict, path: str | Path, title: str = "") -> Path:
    """Reliability diagram of ``a_k`` (pooled) and per-position ECE, before and after STS, as a PNG."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(10, 4.2))
    FigureCanvasAgg(figure)
    left, right = figure.subplots(1, 2)
    left.plot([0, 1], [0, 1], color="0.6", linestyle="--", linewidth=1, label="perfect")
    for metrics, name, marker in ((before, "before (T=1)", "o"), (after, "after STS", "s")):
        table = metrics["reliability"]
        points = [(p, f) for p, f, n in zip(table["mean_probability"], table["frequency"], table["counts"]) if n]
        if points:
            xs, ys = zip(*points)
            left.plot(xs, ys, marker=marker, label=f"{name}: ECE {metrics['ece']:.3f}")
    left.set(xlabel="predicted prefix survival a_k", ylabel="empirical accept-prefix rate", xlim=(0, 1), ylim=(0, 1))
    left.set_title("Reliability (all positions)")
    left.legend(loc="upper left", fontsize=8)
    positions = [p["position"] for p in before["per_position"]]
    width = 0.4
    right.bar([k - width / 2 for k in positions], [p["ece"] for p in before["per_position"]], width, label="before")
    right.bar([k + width / 2 for k in positions], [p["ece"] for p in after["per_position"]], width, label="after")
    right.set(xlabel="position k", ylabel="ECE of a_k", xticks=positions)
    right.set_title("Per-position ECE")
    right.legend(fontsize=8)
    if title:
        figure.suptitle(title, fontsize=9)
    figure.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    return path


def _split_fit_eval(num_prompts: int, eval_fraction: float) -> list[bool]:
    """Which prompts are held out: an evenly spread `eval_fraction` of them (deterministic)."""
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}.")
    return [math.floor((i + 1) * eval_fraction) > math.floor(i * eval_fraction) for i in range(num_prompts)]


def _json_safe(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


def _record(args: CalibrateArguments, target, tokenizer, drafter) -> tuple[list[CalibrationData], list[float]]:
    prompts = read_prompts(args.prompts, args.first_line, args.num_prompts)
    parts, taus = [], []
    for i, text in enumerate(prompts):
        data, _ = collect_calibration_data(
            target, drafter, encode_chat_prompt(tokenizer, text), args.max_new_tokens, args.temperature,
            pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
        )
        parts.append(data)
        taus.append(drafter.generation_stats.tau)
        print(f"[{i + 1}/{len(prompts)}] rounds={len(data.logits)} tau={taus[-1]:.2f}", file=sys.stderr)
    return parts, taus


def calibrate(args: CalibrateArguments, target, tokenizer, drafter) -> dict:
    """Records, fits, saves the calibrated drafter, writes the report and the plot; returns the report."""
    torch.manual_seed(args.seed)
    block_size = drafter.config.block_size
    parts, taus = _record(args, target, tokenizer, drafter)
    held_out = _split_fit_eval(len(parts), args.eval_fraction)
    fit = CalibrationData.concatenate([p for p, h in zip(parts, held_out) if not h], block_size)
    evaluation = CalibrationData.concatenate([p for p, h in zip(parts, held_out) if h], block_size)
    if not fit.valid.any():
        raise ValueError("No verified drafts were recorded; use more prompts or a larger --max_new_tokens.")
    temperatures = fit_sequential_temperatures(fit.logits, fit.labels, fit.valid)
    report = {
        "drafter": args.drafter,
        "target": args.target,
        "prompts": {"file": args.prompts, "first_line": args.first_line, "count": len(parts)},
        "decoding": "greedy" if args.temperature <= 0 else f"sampling, temperature {args.temperature}",
        "max_new_tokens": args.max_new_tokens,
        "tau_full_block": float(np.mean(taus)),
        "temperatures": temperatures,
        "fit": {"num_prompts": held_out.count(False), "before": calibration_metrics(fit.logits, fit.labels, fit.valid),
                "after": calibration_metrics(fit.logits, fit.labels, fit.valid, temperatures)},
    }
    if evaluation.valid.any():
        report["eval"] = {
            "num_prompts": held_out.count(True),
            "before": calibration_metrics(evaluation.logits, evaluation.labels, evaluation.valid),
            "after": calibration_metrics(evaluation.logits, evaluation.labels, evaluation.valid, temperatures),
        }
    output_dir = Path(args.output_dir or args.drafter)
    drafter.config.confidence_temperatures = temperatures
    if output_dir.resolve() == Path(args.drafter).resolve():
        drafter.config.save_pretrained(output_dir)  # in place: only config.json changes, the weights stay put
    else:
        drafter.save_pretrained(output_dir)
    report["saved_to"] = str(output_dir)
    shown = report.get("eval", report["fit"])
    title = f"{Path(args.drafter).name}: {'held-out' if 'eval' in report else 'fit'} rounds"
    plot_path = plot_reliability(
        shown["before"], shown["after"], args.plot or output_dir / "calibration_reliability.png", title=title
    )
    report["plot"] = str(plot_path)
    report_path = Path(args.report or output_dir / "calibration_report.json")
    report_path.parent.mkdir(parents=True, exist_ok=True)
    report_path.write_text(json.dumps(_json_safe(report), indent=2) + "\n")
    report["report"] = str(report_path)
    return report


def _summary(report: dict) -> dict:
    keys = ("ece", "auroc", "brier", "num_samples")
    summary = {"temperatures": report["temperatures"], "tau_full_block": report["tau_full_block"]}
    for split in ("fit", "eval"):
        if split in report:
            summary[split] = {when: {k: report[split][when][k] for k in keys} for when in ("before", "after")}
    summary.update(saved_to=report["saved_to"], report=report["report"], plot=report["plot"])
    return _json_safe(summary)


def main(argv: list[str] | None = None) -> int:
    from .cli import dataclass_parser

    parser = dataclass_parser(CalibrateArguments, "calibrate", description=__doc__.split("\n\n")[0])
    (args,) = parser.parse_args_into_dataclasses(args=argv if argv is not None else sys.argv[1:])
    from .modeling_dspark import DSparkDrafter
    from .models import check_model_path, load_target

    check_model_path(args.drafter)
    read_prompts(args.prompts, args.first_line, args.num_prompts)  # bad files fail before the models load
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    target, tokenizer = load_target(args.target, device=device)
    drafter = DSparkDrafter.from_pretrained(args.drafter, target=target).to(device).eval()
    report = calibrate(args, target, tokenizer, drafter)
    print(json.dumps(_summary(report), indent=2))
    return 0
