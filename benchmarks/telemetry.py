"""GPU telemetry over a run's timed steps: nvidia-smi samples the SM clock, power draw and power-limit flags of the
GPUs a run uses, summarised into the figures each result carries beside its throughput."""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import tempfile

# nvidia-smi's clock event reason bits that mean "held back by power": the software power cap and the hardware power
# brake. `clocks_throttle_reasons` is the older field name, which newer drivers still accept.
POWER_LIMIT_BITS = 0x4 | 0x80
GPU_SAMPLE_FIELDS = "clocks.sm,power.draw,clocks_throttle_reasons.active"


def summarize_gpu_samples(lines: list[str]) -> dict:
    """nvidia-smi rows (`--format=csv,noheader,nounits` of GPU_SAMPLE_FIELDS) -> mean SM clock, mean power per GPU and
    the share of samples in which power held the clock back. Rows a GPU cannot fill ("[N/A]") are skipped."""
    clocks, powers, limited = [], [], 0
    for line in lines:
        parts = [part.strip() for part in line.split(",")]
        if len(parts) != 3:
            continue
        try:
            clock, power, reasons = float(parts[0]), float(parts[1]), int(parts[2], 16)
        except ValueError:
            continue
        clocks.append(clock)
        powers.append(power)
        limited += bool(reasons & POWER_LIMIT_BITS)
    if not clocks:
        return {}
    return {"sm_clock_mhz": statistics.fmean(clocks), "power_w": statistics.fmean(powers),
            "power_limited_share": limited / len(clocks), "gpu_samples": len(clocks)}


class GpuTelemetry:
    """SM clock, power draw and power-limit flags of the GPUs a run uses, sampled by nvidia-smi every `interval_ms`
    between start() and stop(). An H100 at its 700 W limit lowers its clock, and a step that keeps it busier runs at
    a lower clock than one with idle gaps, so throughput comparisons carry these figures. Empty without nvidia-smi."""

    def __init__(self, num_gpus: int | None = None, interval_ms: int = 100):
        """num_gpus: this host's processes of the run (torchrun's LOCAL_WORLD_SIZE; 1 for a single process)."""
        num_gpus = num_gpus or int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",")[:num_gpus] if visible else [str(i) for i in range(num_gpus)]
        self.command = ["nvidia-smi", f"--query-gpu={GPU_SAMPLE_FIELDS}", "--format=csv,noheader,nounits",
                        "-i", ",".join(ids), "-lms", str(interval_ms)]
        self.samples = None
        self.process = None

    def start(self) -> GpuTelemetry:
        if shutil.which("nvidia-smi"):
            self.samples = tempfile.TemporaryFile(mode="w+")  # a file, not a pipe: a long window cannot fill one
            self.process = subprocess.Popen(self.command, stdout=self.samples, stderr=subprocess.DEVNULL)
        return self

    def stop(self) -> dict:
        if self.process is None:
            return {}
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:  # a hung nvidia-smi costs its figures, not the measurement
            self.process.kill()
            self.process.wait()
        self.process = None
        self.samples.seek(0)
        with self.samples:
            return summarize_gpu_samples(self.samples.read().splitlines())
