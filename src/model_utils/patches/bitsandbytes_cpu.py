"""bitsandbytes' 4-bit layers keep the layout they train in on CPUs with AVX512-BF16.

From bitsandbytes 0.49 on, `Linear4bit.forward` on such a CPU, the first time a layer runs in eval mode without
gradients, repacks its weight in place for an inference kernel (bf16 only) and keeps it so: the training steps after
an evaluation then run through that kernel, which has no backward, and the inputs of the layer get no gradient (the
adapters before it stop training) while the outputs change to bf16 rounding. The layer decides by its instance
attribute `support_avx512bf16_for_cpu` (set from the CPU at construction); the patch sets it False on the trainer's
4-bit layers, so they always take the dequantize-and-matmul path they train with, as on CPUs without AVX512-BF16 and on
GPUs.
"""

from __future__ import annotations

from model_utils.patches import Patch, gate

TRAINING_LAYOUT = Patch(
    "bitsandbytes", "0.49.0", "0.50",
    "bitsandbytes.nn.Linear4bit.support_avx512bf16_for_cpu: set False on the trainer's 4-bit layers (no in-place "
    "repacking for the CPU inference kernel)",
    "correctness: training after an evaluation on an AVX512-BF16 CPU keeps its gradients (the stock path loses the "
    "input gradient of every 4-bit layer); docs/QLORA.md",
    ("tests/unit/models/test_quantization.py::test_training_after_an_evaluation_keeps_its_gradients",))


def keep_training_layout(model, log=None) -> int:
    """Set every 4-bit layer of `model` to keep its training layout; returns how many were set (0 where the gate is
    closed: bitsandbytes outside the tested versions, whose own path runs)."""
    if not gate(TRAINING_LAYOUT, log):
        return 0
    count = 0
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
            count += 1
    return count
