"""Loss curves as a PNG (matplotlib, headless)."""
from __future__ import annotations

import numpy as np

from .checkpoint import atomic_write


def smooth(values, window: int = 50) -> np.ndarray:
    """Trailing moving average (shorter at the start)."""
    v = np.asarray(values, np.float64)
    if len(v) == 0:
        return v
    c = np.cumsum(np.insert(v, 0, 0.0))
    idx = np.arange(1, len(v) + 1)
    lo = np.maximum(0, idx - window)
    return (c[idx] - c[lo]) / (idx - lo)


def plot_curves(curves: dict, path, title: str = "char-level LM") -> None:
    """curves: label -> history dict (train_step, train_loss, val_step,
    val_loss). Writes train loss (smoothed) and validation loss per label
    into one figure, atomically."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for (label, h), color in zip(curves.items(), colors):
        if len(h["train_step"]):
            ax.plot(h["train_step"], smooth(h["train_loss"]), color=color, alpha=0.6,
                    lw=1, label=f"{label} train (avg of 50)")
        if len(h["val_step"]):
            ax.plot(h["val_step"], h["val_loss"], color=color, marker="o", ms=3, lw=1.5,
                    label=f"{label} validation")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/char)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    try:
        with atomic_write(path) as f:
            fig.savefig(f, dpi=120, format="png")
    finally:
        plt.close(fig)
