"""Export any checkpoint of this project to a Hugging Face model directory, on CPU, without GPUs.

    python -m model_utils.export checkpoints                      # the newest complete checkpoint -> checkpoints/hf
    python -m model_utils.export checkpoints/step-00001000 --output /models/run1 --dtype bfloat16
    python -m model_utils.export checkpoints --merged             # a LoRA run: hf/adapter and hf/merged

Works for ZeRO stages 1, 2 and 3, offloaded or not: DeepSpeed's `zero_to_fp32` merges the fp32 master weights from
every rank's optimizer shards (never the possibly-empty 16-bit ZeRO-3 module weights). The model is built on the meta
device and takes those tensors as its parameters (`assign=True`), so only one full copy is ever in memory. A LoRA
checkpoint holds the adapters only: they are loaded into the pretrained model its manifest names, wrapped again with
the manifest's LoRA settings (models.lora.export_lora_checkpoint).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from model_utils.checkpoint.protocol import ResumeError
from model_utils.models.export import DTYPES, export_checkpoint


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="a step-XXXXXXXX directory, or a checkpoint directory (newest complete one)")
    parser.add_argument("--output", help="output directory (default: <checkpoint dir>/hf)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--merged", action="store_true", help="a LoRA checkpoint: also the merged model "
                                                               "(OUTPUT/merged), loadable without peft")
    args = parser.parse_args(argv)
    try:
        export_checkpoint(Path(args.checkpoint), Path(args.output) if args.output else None, args.dtype,
                          merged=args.merged)
    except ResumeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0

if __name__ == "__main__":
    sys.exit(main())
