"""Prepare a corpus once, before training: tokenize it with every core (and every node) into token shards that
training memory-maps.

    python -m model_utils.prepare --dataset SRC --tokenizer TOK --output DIR [--num_proc N] [--text_column text]
                                  [--max_documents N] [--shard_mb MB]

SRC is anything --dataset takes (local files, a save_to_disk directory, a hub dataset). The input is cut into shards
(a byte range of a JSONL or text file, row groups of a Parquet file, a row range of an Arrow dataset); a process pool
tokenizes them with the fast tokenizer's batch encode, an EOS after every document, as the trainer's own tokenization
does. Each shard becomes DIR/shards/<split>-NNNNN.bin (the token ids back to back, uint16 when the vocabulary fits,
else uint32) and .idx.npy (int64 offsets of its documents, one more than documents), then a .done marker. A rerun of
the same command skips every shard with a marker. Under SLURM (SLURM_PROCID and SLURM_NTASKS set) task i takes
shards i, i + n, i + 2n, ... and the task that finds every shard done writes DIR/manifest.json (renamed into place):
the source, the tokenizer's identity, the dtype, the shards in order and the counts. `--dataset DIR` trains on it.
See docs/DATA-PREPARATION.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from model_utils.config.settings import DataConfig
from model_utils.core.exit_status import BAD_INPUT
from model_utils.core.problems import Problem, exit_on_problems
from model_utils.data.errors import DataError
from model_utils.data.prepare import prepare
from model_utils.data.progress import PreparationFailed


# --------------------------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m model_utils.prepare", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", default=None, help="What --dataset of the trainer takes: files, a save_to_disk "
                   "directory or a hub dataset. Default: the embedded corpus.")
    p.add_argument("--dataset_config_name", default=None, help="Hub dataset configuration name.")
    p.add_argument("--local_dataset", default="auto", choices=("auto", "true", "false"))
    p.add_argument("--tokenizer", default=None, help="The tokenizer training will use (default: the shipped one).")
    p.add_argument("--output", required=True, help="Directory for the shards and manifest.json (shared by the "
                   "SLURM tasks).")
    p.add_argument("--num_proc", type=int, default=None, help="Tokenizing processes per task (default: the CPUs "
                   "this process may use).")
    p.add_argument("--text_column", default="text")
    p.add_argument("--max_documents", type=int, default=0, help="Only the first N documents of each split (0: all).")
    p.add_argument("--shard_mb", type=float, default=None, help="Input megabytes per shard (default: about 256 "
                   "shards, 1 to 256 MiB each).")
    p.add_argument("--data_cache_dir", default=None, help="Where hub downloads and the embedded corpus are cached.")
    return p.parse_args(argv)


def argument_problems(args) -> list[Problem]:
    problems = []
    if args.num_proc is not None and args.num_proc < 1:
        problems.append(Problem("--num_proc", args.num_proc, "must be at least 1", "pass --num_proc 1 or more"))
    if args.max_documents < 0:
        problems.append(Problem("--max_documents", args.max_documents, "must be >= 0", "pass 0 for all documents"))
    if args.shard_mb is not None and not args.shard_mb > 0:
        problems.append(Problem("--shard_mb", args.shard_mb, "must be positive", "leave it out for the default"))
    output = Path(args.output)
    if output.exists() and not output.is_dir():
        problems.append(Problem("--output", args.output, "is a file", "pass a directory"))
    return problems


def main(argv=None) -> int:
    args = parse_args(argv)
    exit_on_problems(argument_problems(args))
    cfg = DataConfig(dataset=args.dataset, dataset_config_name=args.dataset_config_name,
                     local_dataset=args.local_dataset, text_column=args.text_column,
                     max_documents=args.max_documents, data_cache_dir=args.data_cache_dir, validation_fraction=0.0)
    try:
        prepare(cfg, args.tokenizer, Path(args.output), args.num_proc, args.shard_mb)
    except (DataError, PreparationFailed) as e:
        exit_on_problems([e.problem])
    except ValueError as e:  # load_tokenizer's message names the tokenizer and the fix
        print(f"error: {e}", file=sys.stderr)
        return BAD_INPUT
    return 0

if __name__ == "__main__":
    sys.exit(main())
