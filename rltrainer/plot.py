"""Plot a run from its CSV log: reward, validation score, response length, KL, entropy and step
time against the step, in one PNG (matplotlib)::

    python -m rltrainer.plot lightning_logs/version_0            # writes .../version_0/plots.png
    python -m rltrainer.plot runs/addition -o addition.png       # the newest metrics.csv below it

Each panel draws the first of its metrics the run logged (:data:`PANELS`): validation draws
``val/accuracy`` (``val/score`` where a custom ``validation_step`` logs only that). The KL panel draws
every one it logged (:data:`EVERY_CURVE`), with a legend: the KL penalty's ``actor/kl_loss``
(``kl_coef > 0``), ``rollout_corr/kl`` (the engine's log-probs against the trainer's, logged where the
old log-probs are recomputed: several optimizer steps a batch, off-policy pipelines) and
``actor/ppo_kl`` (how far the optimizer steps moved the policy from the one that sampled: 0 with one
optimizer step a batch). A panel none of whose metrics the run logged (no validation) says so
instead of a curve. A run that logged ``moe/*`` metrics (a mixture-of-experts
policy) gets four more panels on the right: the experts' shares, the router entropy, the routing
agreement with the engine and the load-balancing loss (:data:`MOE_PANELS`).
"""

from __future__ import annotations

import argparse
import csv
import logging
import math
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

#: Panel title -> the metrics drawn in it, the first one the log has.
PANELS: dict[str, tuple[str, ...]] = {
    "reward": ("critic/score/mean", "reward/mean"),
    "validation": ("val/accuracy", "val/score"),
    "response length (tokens)": ("response_length/mean",),
    "KL": ("actor/kl_loss", "critic/kl_in_reward", "rollout_corr/kl", "actor/ppo_kl"),
    "entropy": ("actor/entropy",),
    "step time (s)": ("timing_s/step",),
}

#: Panels of :data:`PANELS` that draw every one of their metrics the run logged (the others: the first).
EVERY_CURVE = ("KL",)

#: A mixture-of-experts run's panels, drawn to the right of :data:`PANELS` when the log has any
#: ``moe/`` metric: panel title -> the metrics drawn in it, every one the log has (``.ci/docs/pages/models.md``).
MOE_PANELS: dict[str, tuple[str, ...]] = {
    "expert share (1/E when balanced)": ("moe/expert_share/max", "moe/expert_share/min"),
    "router entropy (nats)": ("moe/router_entropy",),
    "routing agreement with the engine": ("moe/routing_agreement",),
    "load-balancing loss": ("moe/aux_loss",),
}


def find_metrics_csv(log_dir: str | Path) -> Path:
    """``log_dir/metrics.csv``, or the newest ``metrics.csv`` below ``log_dir``; raise if none."""
    path = Path(log_dir)
    if path.is_file() and path.name.endswith(".csv"):
        return path
    if not path.is_dir():
        raise FileNotFoundError(f"Log directory {str(path)!r} does not exist. Pass the directory of a CSV log (Trainer("
                                "logger='csv') writes <default_root_dir>/lightning_logs/version_N/metrics.csv).")
    if (path / "metrics.csv").is_file():
        return path / "metrics.csv"
    found = sorted(path.rglob("metrics.csv"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise FileNotFoundError(f"No metrics.csv in or below {str(path)!r}. Run with Trainer(logger='csv') (the "
                                "default logger) and pass its default_root_dir or a lightning_logs/version_N folder.")
    return found[-1]


def read_series(path: Path) -> dict[str, tuple[list[float], list[float]]]:
    """Every column of a Lightning ``metrics.csv`` as ``(steps, values)``, empty cells left out."""
    series: dict[str, tuple[list[float], list[float]]] = {}
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            step = row.get("step")
            if not step:
                continue
            for name, cell in row.items():
                if name == "step" or not cell:
                    continue
                try:
                    value = float(cell)
                except ValueError:
                    continue
                steps, values = series.setdefault(name, ([], []))
                steps.append(float(step))
                values.append(value)
    return series


def panel_curves(title: str, series: dict[str, tuple[list[float], list[float]]]) -> list[str]:
    """The metrics the :data:`PANELS` panel ``title`` draws: those with a finite value in ``series``,
    all of them (:data:`EVERY_CURVE`) or the first."""
    logged = [n for n in PANELS[title] if n in series and any(math.isfinite(v) for v in series[n][1])]
    return logged if title in EVERY_CURVE else logged[:1]


def plot_run(log_dir: str | Path, out: str | Path | None = None, dpi: int = 80) -> Path:
    """Draw :data:`PANELS` (and :data:`MOE_PANELS` for a run that logged ``moe/`` metrics) from
    the CSV log in ``log_dir`` into one PNG; return its path (default: ``plots.png`` beside
    ``metrics.csv``)."""
    import matplotlib

    matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt

    path = find_metrics_csv(log_dir)
    series = read_series(path)
    moe = any(name.startswith("moe/") for name in series)
    fig, axes = plt.subplots(2, 5 if moe else 3, figsize=(19.5 if moe else 12, 6.2), constrained_layout=True)
    for ax, (title, names) in zip(axes[:, :3].flat, PANELS.items()):
        _draw(ax, title, names, panel_curves(title, series), series)
    if moe:
        for ax, (title, names) in zip(axes[:, 3:].flat, MOE_PANELS.items()):
            _draw(ax, title, names, [n for n in names if n in series], series)
    fig.suptitle(str(path.parent), fontsize=9)
    target = Path(out) if out is not None else path.parent / "plots.png"
    target.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(target, dpi=dpi)
    plt.close(fig)
    log.info("Wrote %s from %s", target, path)
    return target


def _draw(ax: Any, title: str, names: tuple[str, ...], drawn: list[str],
          series: dict[str, tuple[list[float], list[float]]]) -> None:
    """One panel: the ``drawn`` metrics (a legend if several), or a note naming ``names`` if none."""
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("step", fontsize=8)
    ax.tick_params(labelsize=8)
    ax.grid(alpha=0.3)
    if not drawn:
        ax.text(0.5, 0.5, f"not logged\n({', '.join(names)})", ha="center", va="center", fontsize=8,
                color="gray", transform=ax.transAxes)
        return
    for name in drawn:
        steps, values = series[name]
        ax.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3, linewidth=1, label=name)
    if len(drawn) == 1:
        ax.set_ylabel(drawn[0], fontsize=8)
    else:
        ax.legend(fontsize=7)


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(prog="python -m rltrainer.plot", description=__doc__.split("\n\n")[0])
    parser.add_argument("log_dir", help="a CSV log directory (or one above it: the newest metrics.csv is used)")
    parser.add_argument("-o", "--out", default=None, help="the PNG to write (default: plots.png beside metrics.csv)")
    parser.add_argument("--dpi", type=int, default=80)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    return plot_run(args.log_dir, args.out, args.dpi)


if __name__ == "__main__":
    main()
