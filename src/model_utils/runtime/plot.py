"""Figures of one or more runs' metrics.jsonl (`python -m model_utils.plot`): loss against steps and tokens, learning
rate, throughput, MFU and memory, a resumed run's repeated steps counted once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from model_utils.core.run_dir import METRICS
from model_utils.runtime.monitor import read_metrics

OVERVIEW_SIZE = (16.0, 9.0)  # inches; at --dpi 100: 1600 x 900 pixels
PANEL_SIZE = (8.0, 5.0)  # 800 x 500 pixels
PANELS = ("loss", "loss_tokens", "lr", "throughput", "mfu", "memory")


@dataclass
class RunMetrics:
    label: str
    path: Path
    train: list[dict] = field(default_factory=list)
    evals: list[dict] = field(default_factory=list)

    def series(self, key: str, x: str = "step", records=None):
        rows = [r for r in (self.train if records is None else records) if r.get(key) is not None and x in r]
        return [r[x] for r in rows], [r[key] for r in rows]

    def eval_tokens(self) -> list[float]:
        """Tokens seen at each evaluation (eval records hold only the step): read from the train records."""
        steps, tokens = self.series("tokens_seen")
        if not steps:
            return []
        import numpy as np

        per_step = tokens[-1] / steps[-1] if steps[-1] else 0.0
        out = []
        for r in self.evals:
            s = r["step"]
            out.append(float(np.interp(s, steps, tokens)) if steps[0] <= s <= steps[-1] else s * per_step)
        return out


def load_run(arg: str, label: str | None = None) -> RunMetrics:
    path = Path(arg)
    metrics = path / METRICS if path.is_dir() else path
    if not metrics.is_file():
        raise SystemExit(f"error: {arg}: no metrics.jsonl there (pass a checkpoint directory or a metrics.jsonl file)")
    train, evals = read_metrics(metrics)
    if not train and not evals:
        raise SystemExit(f"error: {metrics} holds no metrics records yet")
    return RunMetrics(label or metrics.parent.name, metrics, train, evals)


def run_labels(args: list[str], given: list[str] | None) -> list[str | None]:
    if given:
        if len(given) != len(args):
            raise SystemExit(f"error: {len(given)} --labels for {len(args)} runs")
        return list(given)
    names = [(Path(a) if Path(a).is_dir() else Path(a).parent).resolve() for a in args]
    short = [n.name for n in names]
    # same directory names (e.g. several runs' ckpt/): use the parent too
    return [f"{n.parent.name}/{n.name}" if short.count(n.name) > 1 else n.name for n in names]


# ----------------------------------------------------------------------------------------------------------------------
# Panels: each draws every run into one Axes
# ----------------------------------------------------------------------------------------------------------------------
def _loss(ax, runs, x="step"):
    for i, run in enumerate(runs):
        color = f"C{i}"
        xs, ys = run.series("loss", "tokens_seen" if x == "tokens" else "step")
        ax.plot(xs, ys, color=color, lw=1.5, label=f"{run.label} train")
        if run.evals:
            ex = run.eval_tokens() if x == "tokens" else [r["step"] for r in run.evals]
            ax.plot(ex, [r["eval_loss"] for r in run.evals], color=color, ls="--", marker="o", ms=4,
                    label=f"{run.label} validation")
    ax.set_xlabel("tokens" if x == "tokens" else "step")
    if x == "tokens":
        from matplotlib.ticker import EngFormatter

        ax.xaxis.set_major_formatter(EngFormatter())  # 100k, 1.5M, 2G
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(f"loss against {'tokens' if x == 'tokens' else 'steps'}")


def _lr(ax, runs):
    for i, run in enumerate(runs):
        ax.plot(*run.series("lr"), color=f"C{i}", label=run.label)
    ax.set_xlabel("step")
    ax.set_ylabel("learning rate")
    ax.set_title("learning rate")
    ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))


def _throughput(ax, runs):
    for i, run in enumerate(runs):
        ax.plot(*run.series("tokens_per_s"), color=f"C{i}", marker=".", label=f"{run.label} (all ranks)")
    ax.set_xlabel("step")
    ax.set_ylabel("tokens/s")
    ax.set_title("throughput")


def _mfu(ax, runs):
    have_mfu = any("mfu" in r for run in runs for r in run.train)
    for i, run in enumerate(runs):
        if have_mfu:
            xs, ys = run.series("mfu")
            ax.plot(xs, [100 * y for y in ys], color=f"C{i}", marker=".", label=run.label)
        else:
            ax.plot(*run.series("tflops_per_device"), color=f"C{i}", marker=".", label=run.label)
    ax.set_xlabel("step")
    ax.set_ylabel("MFU (%)" if have_mfu else "TFLOP/s per device")
    ax.set_title("model FLOPs utilisation" if have_mfu else "TFLOP/s per device (no GPU peak known: no MFU)")


def _memory(ax, runs):
    for i, run in enumerate(runs):
        for key, style, what in (("peak_mem_gib", "-", "GPU peak"), ("mem_gib", ":", "GPU allocated"),
                                 ("host_peak_mem_gib", "--", "host peak, rank 0"),
                                 ("host_mem_gib", "-.", "host, rank 0")):
            xs, ys = run.series(key)
            if xs:
                ax.plot(xs, ys, color=f"C{i}", ls=style, label=f"{run.label} {what}")
    ax.set_xlabel("step")
    ax.set_ylabel("GiB")
    ax.set_title("memory")


DRAW = {"loss": _loss, "loss_tokens": lambda ax, runs: _loss(ax, runs, x="tokens"), "lr": _lr,
        "throughput": _throughput, "mfu": _mfu, "memory": _memory}


def _finish(ax):
    ax.grid(True, alpha=0.3)
    handles, _ = ax.get_legend_handles_labels()
    if handles:
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="gray")


def plot_runs(runs: list[RunMetrics], out: Path, dpi: int = 100, title: str | None = None) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    written = []
    fig, axes = plt.subplots(2, 3, figsize=OVERVIEW_SIZE)
    for ax, name in zip(axes.flat, PANELS):
        DRAW[name](ax, runs)
        _finish(ax)
    fig.suptitle(title or "  vs  ".join(r.label for r in runs))
    fig.tight_layout()
    path = out / "overview.png"
    fig.savefig(path, dpi=dpi)  # no bbox_inches="tight": the size stays figsize x dpi
    plt.close(fig)
    written.append(path)
    for name in PANELS:
        fig, ax = plt.subplots(figsize=PANEL_SIZE)
        DRAW[name](ax, runs)
        _finish(ax)
        fig.tight_layout()
        path = out / f"{name}.png"
        fig.savefig(path, dpi=dpi)
        plt.close(fig)
        written.append(path)
    return written
