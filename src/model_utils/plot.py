"""Plot one or more runs' metrics.jsonl as PNG figures, to look at a run or compare runs.

    python -m model_utils.plot CHECKPOINT_DIR [CHECKPOINT_DIR_OR_METRICS_JSONL ...] --out plots/ [--labels a b]

Writes overview.png (all panels) and one PNG per panel: loss.png (training and validation loss against steps),
loss_tokens.png (against tokens), lr.png, throughput.png (tokens/s), mfu.png (MFU, or TFLOP/s per device where no
GPU peak is known), memory.png (GPU memory, and the host memory of rank 0). A resumed run's repeated steps count
once (the last record wins). Run from `src/` or with the project installed (`pip install -e .[monitor]`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from model_utils.runtime.plot import load_run, plot_runs, run_labels


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m model_utils.plot", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("runs", nargs="+", help="checkpoint directories (holding metrics.jsonl) or metrics.jsonl files")
    parser.add_argument("--out", default="plots", help="directory for the PNG files")
    parser.add_argument("--labels", nargs="+", help="one legend label per run (default: the runs' directory names)")
    parser.add_argument("--title", help="overview title (default: the labels)")
    parser.add_argument("--dpi", type=int, default=100, help="pixels per inch: overview 16x9 in, panels 8x5 in")
    args = parser.parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("error: plotting needs matplotlib: pip install matplotlib (or the project's `monitor` extra)",
              file=sys.stderr)
        return 2
    runs = [load_run(a, label) for a, label in zip(args.runs, run_labels(args.runs, args.labels))]
    for path in plot_runs(runs, Path(args.out), args.dpi, args.title):
        print(path)
    return 0

if __name__ == "__main__":
    sys.exit(main())
