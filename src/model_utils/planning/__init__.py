"""From configuration to a checked plan, above models: plan.py computes the frozen plan of a run (hardware, model sizes,
resolved DeepSpeed config, batch, memory, checkpoints, resume point, data source), memory_model.py the memory model it
sizes the batch and ZeRO-3's parameters with, and the preflight (preflight.py, with memory_checks.py, data_checks.py
and report.py) checks a plan on a login node and names every problem with its fix before GPUs are allocated.
"""
