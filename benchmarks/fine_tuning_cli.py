"""The command line and the report that the fine-tuning benchmarks share (sft_bench.py against TRL's SFTTrainer and the
one-GPU peers, dpo_bench.py against TRL's DPOTrainer): the run arguments beside their data and batch, and the end of an
invocation (the table printed, the summary appended to --json, the section written to --write-doc)."""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def add_run_arguments(p, sides, modes=("full", "lora")) -> None:
    """The command line both benchmarks share beside their data and batch: modes (`modes`: the ones this benchmark
    runs; full and LoRA by default), LoRA, steps, the DeepSpeed config, the peer's kernels, the sides, GPUs and where
    the results go."""
    p.add_argument("--modes", nargs="+", default=["full", "lora"], choices=modes,
                   help="full fine-tuning, LoRA" + (", QLoRA (--load_in_4bit)" if "qlora" in modes else "") +
                        ": one or more")
    p.add_argument("--lora_rank", type=int, default=16)
    p.add_argument("--lora_alpha", type=float, default=32.0)
    p.add_argument("--lora_target_modules", default=None, help="comma-separated (default: the trainer's for the "
                                                               "architecture)")
    p.add_argument("--steps", type=int, default=20, help="timed optimizer steps (enough to include stalls)")
    p.add_argument("--warmup", type=int, default=2, help="untimed optimizer steps first")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--ds_config", default="ds_config.json")
    p.add_argument("--zero_stage", type=int, default=None, help="override the config's ZeRO stage")
    p.add_argument("--ds-set", dest="ds_set", nargs="*", default=[], metavar="KEY=JSON",
                   help="override DeepSpeed config values, e.g. zero_optimization.overlap_comm=false")
    p.add_argument("--gradient_checkpointing", action="store_true", help="both sides")
    p.add_argument("--peer-attn", dest="peer_attn", default="sdpa",
                   help="TRL side's attn_implementation (e.g. flash_attention_4 where flash-attn-4 is installed)")
    p.add_argument("--attention_kernel", default="auto", choices=("auto", "fa4", "varlen", "sdpa"),
                   help="our side's --attention_kernel (varlen: FlashAttention-4 off, PyTorch's variable-length "
                        "attention)")
    p.add_argument("--peer-liger", dest="peer_liger", default="on", choices=("on", "off"),
                   help="TRL side's use_liger_kernel (on CUDA only)")
    p.add_argument("--skip", nargs="*", default=[], choices=list(sides), help="sides not to run")
    p.add_argument("--nproc", type=int, default=None, help="GPUs to use (default: all present; 1 on CPU)")
    p.add_argument("--timeout", type=int, default=900, help="seconds per measurement")
    p.add_argument("--workdir", default=None, help="the rows, the model written from a preset and ours' packed data "
                                                   "(default: a temporary folder)")
    p.add_argument("--json", default=None, help="append results (JSON lines) to this file")
    p.add_argument("--log-dir", dest="log_dir", default=None, help="full log of every measurement")
    p.add_argument("--write-doc", dest="write_doc", default=None, help="write the tables as a markdown section")
    p.add_argument("--title", default=None)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)


def reporter(a, vers: dict, command: str):
    """What reports each measurement as it ends (bench.result_reporter: printed, appended to --json)."""
    from bench import result_reporter

    return result_reporter(a.json, vers, a.nproc, command)


def report(a, text: str, record: dict, results: list[dict], vers: dict, command: str, title: str,
           data_line: str) -> int:
    """The `text` (table and summary) printed, the summary's `record` appended to --json, the section written to
    --write-doc; the exit status (1 where a measurement failed)."""
    print("\n" + text, flush=True)
    if a.json and record:
        with open(a.json, "a") as f:
            f.write(json.dumps({"summary": record, "versions": vers, "nproc": a.nproc, "command": command}) + "\n")
    if a.write_doc:
        body = [f"### {title}", "", f"Hardware/versions: `{json.dumps(vers)}`", "", f"Command: `{command}`", "",
                data_line, "", text, ""]
        Path(a.write_doc).write_text("\n".join(body))
    return 0 if all("error" not in r for r in results) else 1


def results_table(jobs: list[dict], results: list[dict], side_label, rates: list[tuple[str, object]],
                  per_step: list[tuple[str, object]]) -> str:
    """The markdown table of an invocation's measurements: the run, its side (`side_label(job)`), its micro-batch x
    accumulation, its `rates`, the MFU, peak memory and step times, its `per_step` counts (each column a (header,
    cell(result) -> str)) and its mean loss; a failed run shows its error."""
    columns = rates + [
        ("MFU (12·LHQT / 6·LHQT)", lambda r: f"{100 * r['mfu']:.1f}% / {100 * r['mfu_6']:.1f}%" if "mfu" in r else "-"),
        ("peak GiB", lambda r: f"{r['peak_mem_gib']:.1f}" if "peak_mem_gib" in r else "-"),
        ("step ms mean / median", lambda r: f"{1e3 * r['step_s_mean']:.0f} / {1e3 * r['step_s_median']:.0f}"),
    ] + per_step + [("mean loss", lambda r: f"{statistics.fmean(r['losses']) if r.get('losses') else float('nan'):.4f}")]
    headers = ["run", "side", "micro-batch x accumulation"] + [header for header, _ in columns]
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for job, r in zip(jobs, results):
        if "error" in r:
            cells = [job["name"], side_label(job), str(job["micro_batch_size"]), r["error"]] + [""] * (len(columns) - 1)
        else:
            cells = [job["name"], side_label(job), f"{r['micro_batch_size']} x {r['gradient_accumulation_steps']}",
                     *(cell(r) for _, cell in columns)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def losses_line(mode: str, losses: dict, name: str, note: str = "") -> str:
    """The summary's line comparing both sides' losses over the same steps (fine_tuning_work.compare_losses)."""
    return (f"{mode}, losses over the same {losses['steps']} steps: ours first {losses['ours_first']}, {name} first "
            f"{losses['peer_first']}; mean ours {losses['ours_mean']:.4f}, {name} {losses['peer_mean']:.4f} (ours - "
            f"{name} {losses['mean_diff']:+.4f}{note})")
