"""The learning curve: held-out score vs training step, the base model's score marked, with the
on-topic rate and the KL to the initial model beside it (a collapse shows as on-topic falling)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot_learning_curve(rows: list[dict[str, Any]], out: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, (ax, ax_kl) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    ax.plot(steps, [r["score"] for r in rows], "o-", color="tab:blue", label="score (persona AND on topic)")
    ax.plot(steps, [r["on_topic_rate"] for r in rows], "s--", color="tab:green", label="on-topic rate")
    ax.plot(steps, [r["persona_rate"] for r in rows], "^:", color="tab:orange", label="persona rate")
    ax.axhline(rows[0]["score"], color="gray", linestyle="--", linewidth=1, label=f"base score {rows[0]['score']:.2f}")
    ax.axhline(0.8, color="tab:red", linestyle=":", linewidth=1, label="goal 0.8")
    ax.set_ylim(-0.02, 1.02)
    ax.set_ylabel("held-out rate")
    ax.set_title(title)
    ax.legend(loc="lower right", fontsize=8)
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
