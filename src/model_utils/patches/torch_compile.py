"""torch.compile of the decoder layers: Dynamo's recompile limits and the partitioner's activation memory budget.

Both are process-wide settings in torch's private config modules (`torch._dynamo.config`, `torch._functorch.config`).
The layers themselves are compiled through the public `torch.compile` (models.speed.compiled_layer_class), which runs
on any torch; only these two settings are gated.
"""

from __future__ import annotations

from model_utils.patches import Patch, gate

COMPILE_SETTINGS = Patch(
    "torch", "2.11", "2.11",
    "torch._dynamo.config's recompile_limit/cache_size_limit (and their accumulated forms) raised to 4 per layer + 8, "
    "and torch._functorch.config.activation_memory_budget set to --activation_budget",
    "the limits keep every layer compiled (a guard that specialises on the module would otherwise send layers past "
    "the limit to eager); the budget lowers the compiled layers' peak at the same speed, which lets a larger "
    "micro-batch fit (docs/PERFORMANCE.md, Memory and recomputation)",

    ("tests/unit/patches/test_patches.py::test_compile_settings_raise_limits_and_set_the_budget",))


def configure(num_layers: int, budget: float, log) -> bool:
    """Let Dynamo compile `num_layers` layers without falling back to eager, and set the activation memory budget;
    False (torch's own settings) on an untested torch."""
    import torch

    if not gate(COMPILE_SETTINGS, log):
        return False
    # One compiled graph serves every layer (identical modules, parameters as inputs); allow a recompile per layer
    # anyway in case a guard specialises on the module, so no layer silently falls back to eager.
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 4 * num_layers + 8))
    if budget < 1.0 and hasattr(torch._functorch.config, "activation_memory_budget"):
        torch._functorch.config.activation_memory_budget = budget
    return True
