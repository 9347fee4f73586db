"""The demo's outputs: the printed table, the PNG of the curves and the JSON."""

from __future__ import annotations

import json
import math
import os
import textwrap
from typing import Any

import numpy as np

from masked_multistep.demo.train import RUNS, Config, RunResult

__all__ = ["summarize", "format_table", "write"]

LABELS = {
    "full_batch": "full batch (reference)",
    "optax_multisteps": "optax.MultiSteps",
    "masked_multisteps": "mm.MaskedMultiSteps",
}
# The table's width: its legend and notes wrap to it.
_WIDTH = 84


def summarize(
    config: Config,
    results: dict[str, RunResult],
    token_counts: np.ndarray,
    mean_batch_tokens: float,
) -> dict[str, Any]:
    """The numbers the demo reports, as plain JSON-able Python values.

    ``final_train_loss`` averages the last ``final_train_loss_steps`` (10, or
    all if fewer) steps' full-batch training losses (each measured at the run's
    params before that step's update).
    """
    tail = _loss_tail(config.steps)
    runs = {}
    for name in RUNS:
        r = results[name]
        runs[name] = {
            "grad_rel_error_mean": float(np.mean(r.grad_rel_error)),
            "grad_rel_error_max": float(np.max(r.grad_rel_error)),
            "final_train_loss": float(np.mean(r.train_loss[-tail:])),
            "heldout_loss": r.heldout_loss,
            "train_loss": [float(x) for x in r.train_loss],
            "grad_rel_error": [float(x) for x in r.grad_rel_error],
        }
        if r.noise_scale is not None:
            runs[name]["smoothed_noise_scale"] = [float(x) for x in r.noise_scale]
            runs[name]["final_smoothed_noise_scale"] = float(r.noise_scale[-1])
    return {
        "config": config._asdict(),
        "tokens_per_microbatch_first_batch": [int(n) for n in token_counts],
        "mean_tokens_per_batch": float(mean_batch_tokens),
        "final_train_loss_steps": tail,
        "runs": runs,
    }


def _loss_tail(steps: int) -> int:
    """How many of the last steps ``final_train_loss`` averages."""
    return max(1, min(10, steps))


def _count(n: int, one: str, many: str = "") -> str:
    """``n`` with its noun, singular for 1: ``_count(1, "step")`` is "1 step"."""
    return f"{n} {one if n == 1 else many or one + 's'}"


def format_table(summary: dict[str, Any]) -> str:
    """A plain-text table of the per-run numbers, its legend, and the masked
    run's window statistics."""
    c = summary["config"]
    header = (
        f"{'run':<24} {'grad rel. error (mean)':>22} {'(max)':>9} "
        f"{'train loss':>11} {'held-out loss':>14}"
    )
    lines = [
        f"{_count(c['steps'], 'step')}; batches of "
        f"{_count(c['batch_size'], 'sequence')} in "
        f"{_count(c['microbatches'], 'microbatch', 'microbatches')}; "
        f"length skew {c['skew']:g}",
        "real tokens per microbatch in the first batch: "
        f"{summary['tokens_per_microbatch_first_batch']}",
        "",
        header,
        "-" * len(header),
    ]
    for name in RUNS:
        r = summary["runs"][name]
        lines.append(
            f"{LABELS[name]:<24} {r['grad_rel_error_mean']:>22.2e} "
            f"{r['grad_rel_error_max']:>9.2e} {r['final_train_loss']:>11.4f} "
            f"{r['heldout_loss']:>14.4f}"
        )
    tail = _loss_tail(c["steps"])
    steps = "the last step" if tail == 1 else f"the last {tail} steps"
    lines += [
        "",
        *textwrap.wrap(
            "grad rel. error: ‖g − g_full‖ / ‖g_full‖, mean and max over steps; g "
            "is the gradient the accumulator handed to adam, g_full the full-batch "
            "gradient at the same params. train loss: mean full-batch loss over "
            f"{steps}.",
            width=_WIDTH,
        ),
    ]
    runs = summary["runs"]
    ms, mm_run = runs["optax_multisteps"], runs["masked_multisteps"]
    verdict = (
        "In short: optax.MultiSteps handed adam a gradient "
        f"{ms['grad_rel_error_mean']:.0%} off on average, mm.MaskedMultiSteps one "
        f"{mm_run['grad_rel_error_mean']:.1e} off; held-out loss "
        f"{ms['heldout_loss']:.4f} and {mm_run['heldout_loss']:.4f}, the full "
        f"batch's {runs['full_batch']['heldout_loss']:.4f}."
    )
    lines += ["", *textwrap.wrap(verdict, width=_WIDTH)]
    tokens_per_step = summary["mean_tokens_per_batch"]
    noise_scale = summary["runs"]["masked_multisteps"]["final_smoothed_noise_scale"]
    stats = "mm.MaskedMultiSteps window statistics: gradient noise scale B_simple "
    if not math.isfinite(noise_scale):
        reason = (
            "it needs 2 or more microbatches per window"
            if c["microbatches"] < 2
            else "the windows did not resolve the gradient from its noise"
        )
        stats += f"(smoothed) undefined at the last step: {reason}."
    else:
        stats += (
            f"(smoothed), {noise_scale:.3g} tokens at the last step: an estimate "
            "of the critical batch size (this run's batches hold "
            f"{tokens_per_step:.0f} tokens on average)."
        )
        if c["skew"] > 0:
            stats += (
                " Length-sorted microbatches (--skew above 0) differ "
                "systematically and inflate it; --skew 0 measures it without "
                "that bias."
            )
    stats += " See the README's section on window statistics."
    lines += ["", *textwrap.wrap(stats, width=_WIDTH)]
    return "\n".join(lines)


def plot(summary: dict[str, Any], path: str) -> None:
    """Loss curves and per-step gradient error of the three runs, as a PNG.

    The masked run follows the reference exactly, so the reference is drawn as a
    wide pale band underneath it and the masked run dashed on top: both stay
    visible. The title gives the settings, the legend each run's held-out loss.
    """
    # The object-oriented API: no pyplot, no global backend to set.
    from matplotlib.figure import Figure

    c = summary["config"]
    fig = Figure(figsize=(11, 4.6), layout="constrained")
    ax_loss, ax_err = fig.subplots(1, 2)
    styles = {
        "full_batch": dict(color="0.55", linewidth=6, alpha=0.5, zorder=1),
        "optax_multisteps": dict(color="C3", linewidth=1.5, zorder=2),
        "masked_multisteps": dict(color="C0", linewidth=1.5, dashes=(4, 2), zorder=3),
    }
    for name in RUNS:
        r = summary["runs"][name]
        steps = np.arange(1, len(r["train_loss"]) + 1)
        label = f"{LABELS[name]}, held-out loss {r['heldout_loss']:.4f}"
        ax_loss.plot(steps, r["train_loss"], label=label, **styles[name])
        if name != "full_batch":
            # Exact zeros cannot be drawn on a log axis; the reference is 0 anyway.
            err = np.maximum(r["grad_rel_error"], 1e-9)
            ax_err.semilogy(steps, err, label=LABELS[name], **styles[name])
    ax_loss.set(
        xlabel="step", ylabel="full-batch token-mean loss", title="Training loss"
    )
    ax_err.set(
        xlabel="step",
        ylabel="‖g − g_full‖ / ‖g_full‖",
        title="Accumulated gradient vs full batch",
    )
    ax_loss.legend()
    ax_err.legend()
    tokens = summary["tokens_per_microbatch_first_batch"]
    per_microbatch = c["batch_size"] // c["microbatches"]
    fig.suptitle(
        f"k = {c['microbatches']} microbatches of {per_microbatch} sequences"
        f", length skew {c['skew']:g}, {c['steps']} steps, seed "
        f"{c['seed']}; real tokens per microbatch in the first batch: {tokens}",
        fontsize="medium",
    )
    fig.savefig(path, dpi=100)


def _finite_or_none(tree: Any) -> Any:
    """``tree`` (dicts, lists, numbers) with every non-finite float as ``None``."""
    if isinstance(tree, dict):
        return {k: _finite_or_none(v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return [_finite_or_none(v) for v in tree]
    if isinstance(tree, float) and not math.isfinite(tree):
        return None
    return tree


def write(summary: dict[str, Any], out_dir: str) -> list[str]:
    """Writes ``curves.png`` and ``summary.json`` into ``out_dir``; their paths."""
    os.makedirs(out_dir, exist_ok=True)
    json_path = os.path.join(out_dir, "summary.json")
    png_path = os.path.join(out_dir, "curves.png")
    with open(json_path, "w", encoding="utf-8") as f:
        # JSON has no NaN: an undefined figure (the noise scale of windows of
        # one microbatch, say) is null.
        json.dump(_finite_or_none(summary), f, indent=1, allow_nan=False)
        f.write("\n")
    plot(summary, png_path)
    return [png_path, json_path]
