"""The learning curve: held-out rates vs training step, the base model's score marked, with the KL
to the initial model below (a collapse shows as the other rates falling while the KL climbs)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

STYLES = ["o-", "s--", "^:", "d-.", "v:"]
COLORS = ["tab:blue", "tab:green", "tab:orange", "tab:brown", "tab:gray"]


def plot_learning_curve(rows: list[dict[str, Any]], out: Path, curves: list[tuple[str, str]], title: str,
                        goal: float | None = None) -> Path:
    """``curves``: (row key, label) of each rate to draw, the first being the score."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, (ax, ax_kl) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    for i, (key, label) in enumerate(curves):
        ax.plot(steps, [r.get(key, float("nan")) for r in rows], STYLES[i % 5], color=COLORS[i % 5], label=label)
    first = curves[0][0]
    ax.axhline(rows[0][first], color="gray", linestyle="--", linewidth=1, label=f"base {rows[0][first]:.2f}")
    if goal is not None:
        ax.axhline(goal, color="tab:red", linestyle=":", linewidth=1, label=f"goal {goal:g}")
    ax.set_ylim(-0.02, 1.02)
    ax.set_ylabel("held-out rate")
    ax.set_title(title)
    ax.legend(loc="best", fontsize=8)
    ax.grid(alpha=0.3)
    ax_kl.plot(steps, [r.get("kl", float("nan")) for r in rows], "o-", color="tab:purple")
    ax_kl.set_ylabel("KL to initial")
    ax_kl.set_xlabel("training step (weight version)")
    ax_kl.grid(alpha=0.3)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


ARM_STYLES = {"shared": ("s--", "tab:gray"), "per-user": ("o-", "tab:blue")}


def plot_panel_curves(rows: dict[str, list[dict[str, Any]]], panel: list[str], out: Path, title: str) -> Path:
    """One panel per user: its held-out score over its own turns trained on, one curve per arm, and dotted its
    on-topic rate (``rows``: arm -> rows with ``turns``, ``scores`` and ``on_topic_rates``, dicts persona -> rate)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(2, len(panel))
    n_rows = -(-len(panel) // cols)
    fig, axes = plt.subplots(n_rows, cols, figsize=(4.2 * cols, 3.2 * n_rows), sharex=True, sharey=True,
                             squeeze=False)
    for ax, name in zip(axes.flat, panel):
        for arm, arm_rows in rows.items():
            style, color = ARM_STYLES.get(arm, ("^:", "tab:orange"))
            x = [r["turns"] for r in arm_rows]
            ax.plot(x, [r["scores"][name] for r in arm_rows], style, color=color, label=f"{arm}: score")
            if all("on_topic_rates" in r for r in arm_rows):  # what a score of 0 hides: the answers' topic
                ax.plot(x, [r["on_topic_rates"][name] for r in arm_rows], ":", color=color, alpha=0.6,
                        label=f"{arm}: on topic")
        ax.set_title(f"user '{name}'", fontsize=10)
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(panel):]:
        ax.axis("off")
    for ax in axes[:, 0]:
        ax.set_ylabel("held-out rate")
    for ax in axes[-1, :]:
        ax.set_xlabel("the user's own turns trained on")
    axes.flat[0].legend(loc="best", fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
