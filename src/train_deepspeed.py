#!/usr/bin/env python3
"""Train a causal language model with DeepSpeed.

    torchrun --standalone --nproc_per_node=N src/train_deepspeed.py [--model qwen3-0.6b] [--dataset PATH_OR_NAME] ...
    srun (one task per GPU)              python src/train_deepspeed.py ...      # SLURM: ranks from SLURM_PROCID
    python src/train_deepspeed.py --preflight ...                               # check everything, train nothing

Parse the flags, plan the run and check the plan, build it, train, exit with its status
(model_utils/core/exit_status.py). The plan is model_utils/planning/, the loop model_utils/train/loop.py; `ds_config.json` holds what DeepSpeed owns
(batch, optimizer, scheduler, ZeRO, precision); see docs/CONFIGURATION.md.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import time
from typing import NoReturn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # model_utils, also where the project is not installed

from model_utils.config.checks import validate_args  # noqa: E402
from model_utils.config.flags import parse_args  # noqa: E402
from model_utils.core import exit_status  # noqa: E402
from model_utils.core.problems import ConfigError, exit_on_problems  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    # --- the flags: --help and --preflight need no process group and no GPU (a login node runs them) ---
    cfg = parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if cfg.preflight:
        from model_utils.planning.preflight import print_report, run_preflight
        return print_report(run_preflight(cfg))
    from model_utils.runtime.build_locks import remove_leftover_locks, stale_build_lock_problems
    from model_utils.runtime.distributed import distributed_env_problems

    remove_leftover_locks(lambda line: print(line, flush=True))
    exit_on_problems(validate_args(cfg) + distributed_env_problems() + stale_build_lock_problems())
    # A rank that dies in native code (SIGSEGV, SIGABRT from a C++ library) prints every thread's Python stack first.
    faulthandler.enable()
    from model_utils.runtime.process import pin_host_memory_by_threads

    pin_host_memory_by_threads()  # read once, when CUDA starts: before the process group

    from model_utils.checkpoint.protocol import ResumeError
    from model_utils.checkpoint.save import SaveFailed
    from model_utils.data.errors import DataError, OneRankDataError
    from model_utils.models.custom.contract import UserModelError
    from model_utils.runtime.distributed import setup_distributed
    from model_utils.runtime.run_lock import acquire

    dist = setup_distributed()
    lock, together = None, False
    try:
        if cfg.sanity_check:
            from model_utils.runtime.sanity import all_reduce_check
            return all_reduce_check(dist)
        # --- one run per checkpoint directory, decided by rank 0 before anything is written there ---
        lock, problem = acquire(cfg.checkpoint.checkpoint_dir, cfg.checkpoint.force_unlock, print) if dist.is_main else (None, None)
        problem = dist.broadcast_object(problem)
        if problem:
            if dist.is_main:
                exit_on_problems([problem])
            return exit_status.BAD_INPUT

        # --- plan, check, build, train ---
        from model_utils.planning.preflight import checked_plan
        from model_utils.runtime.monitor import write_run_config
        from model_utils.train.build import build_run, start_log
        from model_utils.train.loop import train

        t0 = time.perf_counter()
        log = start_log(cfg, dist)
        run = build_run(checked_plan(cfg, dist, log), dist, log)
        if dist.is_main:  # CHECKPOINT_DIR/config.yaml: the flags as given (the plan's derived values stay derived)
            write_run_config(log, cfg)
        log.info(f"setup: ready in {time.perf_counter() - t0:.1f}s")
        status = train(run)
        together = True  # every rank returns the status all of them agreed on
        return status
    except ConfigError as e:  # every rank, on the problems all of them gathered (checked_plan) or rank 0 found
        together = True
        if dist.is_main:
            exit_on_problems(e.problems)
        return exit_status.BAD_INPUT
    except UserModelError as e:  # your model broke its contract mid-run (its forward's output): said by each rank
        print(f"error (rank {dist.rank}): {e.problem}", file=sys.stderr, flush=True)
        return exit_status.BAD_INPUT
    except OneRankDataError as e:  # found by this rank alone (its preparer died, an image of its micro-batch changed):
        # the others cannot meet it in a collective
        print(f"error (rank {dist.rank}): {e.problem}", file=sys.stderr, flush=True)
        return exit_status.BAD_INPUT
    except DataError as e:  # every rank, on what rank 0 found and broadcast (data.pipeline.prepare_data)
        together = True
        if dist.is_main:
            exit_on_problems([e.problem])
        return exit_status.BAD_INPUT
    except ResumeError as e:  # every rank, on rank 0's broadcast verdict (checkpoint.protocol.convert_to_universal)
        together = True
        if dist.is_main:
            print(f"error: {e}", file=sys.stderr, flush=True)
        return exit_status.BAD_INPUT
    except SaveFailed as e:
        print(f"error (rank {dist.rank}): {e}", file=sys.stderr, flush=True)
        return exit_status.FAILED
    finally:
        import torch

        if lock is not None:
            lock.release()
        if torch.distributed.is_initialized():
            if together:  # no rank destroys the group while another still uses it (rank 0 writes the summary last)
                dist.barrier()
            torch.distributed.destroy_process_group()


def end_process(status: int | str | None) -> NoReturn:
    """Exit with `status` once main() has returned, skipping the interpreter's finalization and the C++ static
    destructors: a rank whose run had ended and saved everything was seen to abort there (SIGABRT from a native
    library's object torn down after Python), turning the trainer's 0, 2 or 75 into 134. Everything the run writes is
    closed or flushed by then; logging and the standard streams are flushed here."""
    import logging

    if status is not None and not isinstance(status, int):  # SystemExit("message"): printed, status 1, as Python does
        print(status, file=sys.stderr)
        status = 1
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status or 0)


if __name__ == "__main__":
    try:
        exit_status_of_main = main()
    except SystemExit as stop:  # exit_on_problems: bad input, reported before anything started
        exit_status_of_main = stop.code
    end_process(exit_status_of_main)
