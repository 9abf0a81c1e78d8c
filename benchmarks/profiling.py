"""Where a step's time goes (`--profile`): phase timing of the trainer's own step with each phase synchronised, then
torch.profiler's tables and where the GPU waited, from the Kineto trace's idle gaps."""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

from common import cuda_sync

GPU_EVENT_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def gpu_idle_report(events: list[dict], min_gap_us: float = 20.0, top: int = 15) -> str:
    """Where the GPU waited, from a torch.profiler (Kineto) trace's events: idle time between GPU activity, summed by
    the phase (`phase:NAME` annotation) the host was in when the GPU ran dry, and the longest gaps with the host
    operator running at their start (what the GPU waited for) and the one that launched the kernel ending them."""
    gpu = sorted((e["ts"], e["ts"] + e.get("dur", 0), e) for e in events
                 if e.get("ph") == "X" and e.get("cat") in GPU_EVENT_CATEGORIES)
    if not gpu:
        return "gpu idle: no GPU events in the trace"
    cpu_ops = [e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
    phases = [e for e in events if e.get("ph") == "X" and e.get("cat") == "user_annotation"
              and str(e.get("name", "")).startswith("phase:")]
    launches = {e.get("args", {}).get("correlation"): e for e in events
                if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver")}  # Triton: cuLaunchKernelEx

    def active(pool, t):  # the innermost (latest-starting) event of `pool` running at time t
        running = [e for e in pool if e["ts"] <= t < e["ts"] + e.get("dur", 0)]
        return max(running, key=lambda e: e["ts"]) if running else None

    gaps, end = [], gpu[0][1]
    for start, stop, event in gpu[1:]:
        if start - end >= min_gap_us:
            gaps.append((end, start, event))
        end = max(end, stop)
    window = end - gpu[0][0]
    by_phase: dict[str, float] = {}
    for t0, t1, _ in gaps:
        phase = active(phases, t0)
        name = phase["name"][len("phase:"):] if phase else "between phases"
        by_phase[name] = by_phase.get(name, 0.0) + (t1 - t0)
    idle = sum(t1 - t0 for t0, t1, _ in gaps)
    lines = [f"gpu idle: {idle / 1e3:.1f} ms of {window / 1e3:.1f} ms ({100 * idle / window:.1f}%) in {len(gaps)} gaps "
             f">= {min_gap_us:.0f} us; by the host's phase at the gap's start: "
             + ", ".join(f"{k} {v / 1e3:.1f} ms" for k, v in sorted(by_phase.items(), key=lambda kv: -kv[1]))]
    for t0, t1, next_event in sorted(gaps, key=lambda g: g[0] - g[1])[:top]:
        host = active(cpu_ops, t0)
        launch = launches.get(next_event.get("args", {}).get("correlation"))
        launcher = active(cpu_ops, launch["ts"]) if launch else None
        lines.append(f"  {(t1 - t0) / 1e3:7.2f} ms at +{(t0 - gpu[0][0]) / 1e3:8.1f} ms: host in "
                     f"{host['name'] if host else '-'}; ended by {next_event.get('name', '?')[:60]} launched from "
                     f"{launcher['name'] if launcher else '-'}")
    return "\n".join(lines)


def profile_steps(step, is_main: bool, steps: int = 2, trace: str | None = None) -> None:
    """Where a step's time goes, printed by rank 0 into the measurement's log. `step(phase)` runs one training step
    (the trainer's train_step), entering `phase(name)` around each micro-batch's forward, backward and optimizer
    step. First three steps with every phase synchronised: the time until its call returns (host: Python, launches)
    against the time until the GPU is done, so a phase whose host time is the larger starves the GPU. Then `steps`
    steps under torch.profiler: kernels by GPU time, operators by host time, and where the GPU waited
    (gpu_idle_report); with `trace`, the Chrome trace is written there (gzip)."""
    import contextlib

    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    names = ("forward", "backward", "step")
    host, total = {name: [] for name in names}, {name: [] for name in names}

    @contextlib.contextmanager
    def synchronised(name):
        cuda_sync()
        t0 = time.perf_counter()
        yield
        t1 = time.perf_counter()
        cuda_sync()
        host[name].append(t1 - t0)
        total[name].append(time.perf_counter() - t0)

    for _ in range(3):
        step(synchronised)
    if is_main:
        print("phase timing (median of 3 synchronised steps): host = until the call returns, total = until the GPU "
              "is done", flush=True)
        for name in names:
            print(f"  {name:10s} host {1e3 * statistics.median(host[name]):8.1f} ms   "
                  f"total {1e3 * statistics.median(total[name]):8.1f} ms", flush=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step(lambda name: record_function(f"phase:{name}"))
        cuda_sync()
    if is_main:
        import gzip

        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "trace.json"
            prof.export_chrome_trace(str(path))
            raw = path.read_bytes()
        print(gpu_idle_report(json.loads(raw).get("traceEvents", [])), flush=True)
        if trace:
            Path(trace).parent.mkdir(parents=True, exist_ok=True)
            Path(trace).write_bytes(gzip.compress(raw))
        events = prof.key_averages()
        keys = (["self_device_time_total"] if torch.cuda.is_available() else []) + ["self_cpu_time_total", "cpu_time_total"]
        for key in keys:
            print(f"profile over {steps} steps, sorted by {key}:", flush=True)
            print(events.table(sort_by=key, row_limit=40, max_name_column_width=90), flush=True)
