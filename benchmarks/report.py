"""What a run reports and how an invocation's results are tabled: throughput, TFLOP/s and MFU (pure arithmetic, the
same for the engine and the HF peer), one table row per run with its ratio to HF + Liger at the same micro-batch and
round, each side at its best micro-batch, the loss check, and the versions in the header."""

from __future__ import annotations

import math
import platform
import statistics


def throughput(tokens_per_step_per_gpu: int, step_times: list[float], flops_per_token_12: float,
               flops_per_token_6: float, peak_tflops: float | None) -> dict:
    """Per-GPU figures over the timed steps: tokens/s, TFLOP/s and MFU under both attention conventions, and each
    step's time (a mean over its median says a step stalled; `step_s` says which)."""
    total = sum(step_times)
    tps = tokens_per_step_per_gpu * len(step_times) / total if total > 0 else 0.0
    out = {"tokens_per_s_per_gpu": tps, "step_s_mean": total / max(len(step_times), 1),
           "step_s_median": statistics.median(step_times) if step_times else 0.0,
           "step_s": [round(t, 4) for t in step_times],
           "tflops_per_gpu": tps * flops_per_token_12 / 1e12, "tflops_per_gpu_6": tps * flops_per_token_6 / 1e12}
    if peak_tflops:
        out["mfu"] = out["tflops_per_gpu"] / peak_tflops
        out["mfu_6"] = out["tflops_per_gpu_6"] / peak_tflops
    return out


def base_parameters(model) -> int:
    """The model's parameters less LoRA adapters', each by its values (parameter_size): what the FLOPs and MFU of both
    sides count."""
    return sum(parameter_size(p) for name, p in model.named_parameters() if "lora_" not in name)


def parameter_size(p) -> int:
    """A parameter's values: a bitsandbytes 4-bit weight's from its quantization state (its storage packs 2 values a
    byte: an 8B model's would count 4.5B), ZeRO-3's partitioned one's by its full size (ds_numel), else numel."""
    state = getattr(p, "quant_state", None)
    if state is not None:
        return math.prod(state.shape)
    return getattr(p, "ds_numel", p.numel())


def flops_per_token(config, num_params: int, seq_len: int, attention_span: float | None = None) -> tuple[float, float]:
    """Under both attention conventions. `attention_span`: the attention query-key pairs per token, seq_len unless
    attention stays within documents (then the mean over the timed tokens)."""
    from model_utils.models.build import FlopsModel

    fm = FlopsModel.from_config(config, num_params, seq_len)
    span = seq_len if attention_span is None else attention_span
    return fm.flops(1, span, 12), fm.flops(1, span, 6)


def fmt_row(job: dict, r: dict, ref: dict | None) -> str:
    name = job["name"]
    if "error" in r:
        return f"| {name} | {job.get('micro_batch_size')} | {r['error']} | | | | | | | |"
    mfu = f"{100 * r['mfu']:.1f}%" if "mfu" in r else "-"
    mfu6 = f"{100 * r['mfu_6']:.1f}%" if "mfu_6" in r else "-"
    mem = f"{r['peak_mem_gib']:.1f}" if "peak_mem_gib" in r else "-"
    if "host_peak_gib" in r:
        mem += f" (host {r['host_peak_gib']:.1f})"
    ratio = f"{r['tokens_per_s_per_gpu'] / ref['tokens_per_s_per_gpu']:.2f}x" if ref and "error" not in ref else "-"
    gpu = (f"{r['sm_clock_mhz']:,.0f} / {r['power_w']:.0f} / {100 * r['power_limited_share']:.0f}%"
           if "sm_clock_mhz" in r else "-")
    return (f"| {name} | {r['micro_batch_size']} | {r['tokens_per_s_per_gpu']:,.0f} | {r['tflops_per_gpu']:.0f} | "
            f"{mfu} | {mfu6} | {mem} | {1e3 * r['step_s_median']:.0f} | {gpu} | {ratio} |")


def is_hf_liger_peer(job: dict) -> bool:
    """The peer the ratios are to: HF Trainer + DeepSpeed + Liger with SDPA attention."""
    return job.get("kind") == "hf" and bool(job.get("liger")) and job.get("attn", "sdpa") == "sdpa"


def micro_batch(job: dict, result: dict):
    """The micro-batch a run used: the worker's report (ds_config's when the job named none), else the job's."""
    return result.get("micro_batch_size", job.get("micro_batch_size"))


def table(jobs: list[dict], results: list[dict], ref_name: str | None) -> str:
    """One row per run. The ratio is to HF + Liger at the same micro-batch in the same round ("-" where that did not
    run: the best micro-batch each is best_per_side's line); without any HF + Liger run, to `ref_name`."""
    by_name = {j["name"]: r for j, r in zip(jobs, results)}
    same_mb = {(j.get("round"), micro_batch(j, r)): r for j, r in zip(jobs, results)
               if is_hf_liger_peer(j) and "error" not in r}
    lines = ["| run | micro-batch | tokens/s/GPU | TFLOP/s/GPU | MFU (12·LHQT) | MFU (6·LHQT) | peak GiB | step ms "
             "| SM MHz / W / power-limited "
             f"| vs {'HF + Liger, same micro-batch' if same_mb else ref_name or '-'} |", "|---|---|---|---|---|---|---|---|---|---|"]
    lines += [fmt_row(j, r, same_mb.get((j.get("round"), micro_batch(j, r))) if same_mb else by_name.get(ref_name))
              for j, r in zip(jobs, results)]
    return "\n".join(lines)


def _best_each(rows: list[tuple[dict, dict]]) -> dict | None:
    """Each side's fastest micro-batch among `rows` (job, result) and its tokens/s: the mean over the rows that ran
    at that micro-batch (one per round)."""
    def best(pick):
        by_mb = {}
        for j, r in rows:
            if pick(j) and "error" not in r:
                by_mb.setdefault(micro_batch(j, r), []).append(r["tokens_per_s_per_gpu"])
        return max(((statistics.mean(v), mb) for mb, v in by_mb.items()), default=None)

    ours = best(lambda j: j["kind"] == "engine" and j.get("variant") == "default")
    peer = best(is_hf_liger_peer)
    if not ours or not peer:
        return None
    failed = sorted({j["micro_batch_size"] for j, r in rows if "error" in r and is_hf_liger_peer(j)})
    return {"ours": ours, "peer": peer, "failed": failed, "ratio": ours[0] / peer[0]}


def best_per_side(jobs: list[dict], results: list[dict]) -> str:
    """With several micro-batches: each side at its fastest micro-batch that ran, and the ratio (the issue's measure).
    With --rounds, the same per round, then over all rounds by each side's mean tokens/s at its best micro-batch."""
    rows = list(zip(jobs, results))
    if len({micro_batch(j, r) for j, r in rows}) < 2:
        return ""

    def line(b: dict, digits: int = 2) -> str:
        return (f"default path {b['ours'][0]:,.0f} tokens/s at {b['ours'][1]}, HF + Liger {b['peer'][0]:,.0f} at "
                f"{b['peer'][1]}" + (f" (failed at {b['failed']})" if b["failed"] else "")
                + f": {b['ratio']:.{digits}f}x")

    overall = _best_each(rows)
    rounds = sorted({j["round"] for j in jobs if "round" in j})
    if not overall or not rounds:
        return "Best micro-batch each: " + line(overall) if overall else ""
    per_round = {k: _best_each([(j, r) for j, r in rows if j.get("round") == k]) for k in rounds}
    out = [f"Round {k}, best micro-batch each: " + (line(b, 3) if b else "no pair ran") for k, b in per_round.items()]
    ratios = [b["ratio"] for b in per_round.values() if b]
    if ratios:
        out.append(f"Over {len(rounds)} rounds, each side's mean at its best micro-batch: {line(overall, 3)} "
                   f"(rounds {min(ratios):.3f}x-{max(ratios):.3f}x, median {statistics.median(ratios):.3f}x)")
    return "\n".join(out)


def loss_check(results_a: dict, results_b: dict, n: int = 50) -> dict:
    """Max and mean |difference| of per-step losses between two runs (same seed/data), first n steps."""
    a, b = results_a.get("losses", [])[:n], results_b.get("losses", [])[:n]
    k = min(len(a), len(b))
    if k == 0:
        return {}
    diffs = [abs(x - y) for x, y in zip(a[:k], b[:k])]
    return {"steps": k, "max_abs_diff": max(diffs), "mean_abs_diff": sum(diffs) / k, "first": (a[0], b[0]),
            "last": (a[k - 1], b[k - 1])}


def versions() -> dict:
    from model_utils.runtime.monitor import package_version

    out = {"python": platform.python_version()}
    for name in ("torch", "deepspeed", "transformers", "liger-kernel", "flash-attn-4", "triton", "accelerate"):
        out[name] = package_version(name)
    try:
        import torch

        if torch.cuda.is_available():
            out["gpu"] = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name()}"
            out["cuda"] = torch.version.cuda
    except Exception:  # noqa: BLE001
        pass
    return out
