"""Loading `ds_config.json`: resolve "auto" values (Hugging Face style), fill what depends on the run, and check
optimizer/scheduler parameters against the classes that will receive them, so a typo is a message, not a TypeError."""

from __future__ import annotations

import copy
import difflib
import inspect
import json
import math
from pathlib import Path

from model_utils.config.settings import TrainConfig
from model_utils.core.problems import Problem
from model_utils.patches import gate
from model_utils.patches.deepspeed_zero3 import PARTIAL_OFFLOAD_STATE

AUTO = "auto"
# DeepSpeed optimizer names whose params go to torch.optim.AdamW/Adam (torch_adam) or DeepSpeed's Adam family.
ADAM_NAMES = {"adam", "adamw"}
ADAM_EXTRA_KEYS = {"torch_adam", "adam_w_mode", "fused", "foreach", "fp32_optimizer_states"}


def load_json(path: Path) -> tuple[dict | None, list[Problem]]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        return None, [Problem("--ds_config", str(path), "file not found", "point DS_CONFIG/--ds_config at a JSON file")]
    except json.JSONDecodeError as e:
        return None, [Problem("--ds_config", str(path), f"is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}",
                              "fix the JSON syntax there (trailing commas and comments are not allowed)")]
    if not isinstance(data, dict):
        return None, [Problem("--ds_config", str(path), "must hold a JSON object", "wrap the settings in { ... }")]
    return data, []


def suggest(key: str, valid, otherwise: str | None = None) -> str:
    """The fix for an unknown key: the nearest valid one, else `otherwise` (default: the valid keys)."""
    close = difflib.get_close_matches(key, list(valid), n=1, cutoff=0.6)
    return f"did you mean `{close[0]}`?" if close else otherwise or f"valid keys: {', '.join(sorted(valid))}"


def _accepted_params(cls, skip=("self", "optimizer", "params", "last_batch_iteration")) -> dict[str, inspect.Parameter]:
    sig = inspect.signature(cls.__init__)
    return {n: p for n, p in sig.parameters.items() if n not in skip and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}


def check_scheduler(sched: dict, where: str = "scheduler") -> list[Problem]:
    from deepspeed.runtime import lr_schedules

    problems = []
    name = sched.get("type")
    if name not in lr_schedules.VALID_LR_SCHEDULES:
        return [Problem(f"{where}.type", name, "is not a DeepSpeed scheduler",
                        suggest(str(name), lr_schedules.VALID_LR_SCHEDULES))]
    accepted = _accepted_params(getattr(lr_schedules, name))
    for key in sched.get("params", {}):
        if key not in accepted:
            problems.append(Problem(f"{where}.params.{key}", sched["params"][key], f"is not a parameter of {name}",
                                    suggest(key, accepted)))
    for key, p in accepted.items():
        if p.default is inspect.Parameter.empty and key not in sched.get("params", {}):
            problems.append(Problem(f"{where}.params.{key}", None, f"is required by {name}",
                                    f'add "{key}": "auto" (filled from --max_steps) or a number'))
    return problems


def check_optimizer(opt: dict, where: str = "optimizer") -> list[Problem]:
    import torch

    name = str(opt.get("type", ""))
    params = opt.get("params", {})
    if name.lower() not in ADAM_NAMES:
        return []  # other optimizers are DeepSpeed's own; DeepSpeed validates them
    accepted = set(_accepted_params(torch.optim.AdamW)) | ADAM_EXTRA_KEYS
    problems = []
    for key in params:
        if key == "max_grad_norm":
            problems.append(Problem(f"{where}.params.max_grad_norm", params[key], "is not an optimizer parameter",
                                    'move it to the top level as "gradient_clipping"'))
        elif key not in accepted:
            problems.append(Problem(f"{where}.params.{key}", params[key], f"is not a parameter of {name}",
                                    suggest(key, accepted)))
    return problems


def resolve_settings(raw: dict, cfg: TrainConfig, hardware: str, hidden_size: int | None = None,
                     check_classes: bool = True) -> tuple[dict, list[str], list[Problem]]:
    """Return (config, notes for the log, problems): everything but the batch resolved (the batch keys stay as
    written; `with_batch` writes them).

    "auto" takes the matching flag's value or the default written here; a flag given explicitly replaces a concrete
    config value, and a note says so. `hardware` is the best precision the training devices support
    (`hardware_precision`): "bf16", "fp16" or "fp32". `check_classes` False skips checking the optimizer's and
    scheduler's parameters against their classes (a machine without torch and DeepSpeed).
    """
    ds = copy.deepcopy(raw)
    notes: list[str] = []
    problems: list[Problem] = []
    optim, max_steps = cfg.optim, cfg.batch.max_steps

    def setting(container: dict, key: str, flag: str | None, flag_value, auto_value, label: str):
        current = container.get(key, AUTO)
        if flag and flag_value is not None:  # the overriding flags default to None: set means given
            if current not in (AUTO, flag_value):
                notes.append(f"--{flag} {flag_value} overrides {label}={current} from the DeepSpeed config")
            container[key] = flag_value
        elif current == AUTO:
            container[key] = auto_value
        return container[key]

    notes_, problems_ = resolve_precision(ds, hardware)
    notes += notes_
    problems += problems_

    setting(ds, "gradient_clipping", None, None, 1.0, "gradient_clipping")


    opt = ds.get("optimizer")
    if isinstance(opt, dict):
        params = opt.setdefault("params", {})
        setting(params, "lr", "learning_rate", optim.learning_rate, 3e-4, "optimizer.params.lr")
        if check_classes:
            problems += check_optimizer(opt)

    sched = ds.get("scheduler")
    if isinstance(sched, dict):
        params = sched.setdefault("params", {})
        if check_classes:
            problems += check_scheduler(sched)
        if "total_num_steps" in params or sched.get("type") in ("WarmupDecayLR", "WarmupCosineLR"):
            total = params.get("total_num_steps", AUTO)
            if total not in (AUTO, max_steps):
                notes.append(f"scheduler total_num_steps={total} replaced by --max_steps {max_steps}")
            params["total_num_steps"] = max_steps
        if "warmup_num_steps" in params or sched.get("type") in ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR"):
            auto_warmup = max(1, math.ceil(0.05 * max_steps))
            warmup = setting(params, "warmup_num_steps", "warmup_steps", optim.warmup_steps, auto_warmup,
                             "scheduler.params.warmup_num_steps")
            if isinstance(warmup, int) and warmup < 1:
                problems.append(Problem("scheduler.params.warmup_num_steps", warmup,
                                        f"{sched.get('type')} needs at least one warmup step",
                                        "use 1 for (almost) no warmup"))
            elif isinstance(warmup, int) and warmup >= max_steps:
                problems.append(Problem("scheduler.params.warmup_num_steps", warmup,
                                        f"warmup is not shorter than the run (--max_steps {max_steps})",
                                        'lower it, use "auto" (5% of max_steps), or raise --max_steps'))
        if "warmup_max_lr" in params and params["warmup_max_lr"] == AUTO and isinstance(opt, dict):
            params["warmup_max_lr"] = opt["params"]["lr"]

    zero = ds.get("zero_optimization")
    if isinstance(zero, dict) and hidden_size:
        # Hugging Face's sizing for ZeRO-3 buckets, proportional to the model's hidden size.
        for key, value in (("reduce_bucket_size", hidden_size * hidden_size),
                           ("stage3_prefetch_bucket_size", int(0.9 * hidden_size * hidden_size)),
                           ("stage3_param_persistence_threshold", 10 * hidden_size)):
            if zero.get(key) == AUTO:
                zero[key] = value

    problems += _check_partial_offload(ds)
    problems += check_delayed_update(ds, optim.delayed_update_from_step)
    ratio = partial_offload_ratio(ds)
    if ratio is not None and not _partial_offload_state_kept():
        notes.append(f"zero_optimization.offload_optimizer.ratio {ratio:g}: this DeepSpeed's ZeRO-3 checkpoints hold "
                     "the Adam moments of the offloaded part only (its CPU Adam's state, not that of the AdamW updating "
                     "the rest on the GPU), and the patch that adds them is tested with another release: a resume "
                     "restarts the GPU part's moments and does not continue exactly")
    return ds, notes, problems


def with_layer_prefetch(ds: dict, raw: dict, layer_params: int) -> dict:
    """ZeRO-3 gathering whole decoder layers (models/speed.py: compiled layers are leaf modules): a prefetch bucket left
    at "auto" holds one layer's parameters, so the next layer's gather runs during this one's compute (the size
    resolve_settings writes, Hugging Face's 0.9 h^2, covers one linear module of it)."""
    if raw.get("zero_optimization", {}).get("stage3_prefetch_bucket_size", AUTO) != AUTO:
        return ds
    ds = copy.deepcopy(ds)
    ds.setdefault("zero_optimization", {})["stage3_prefetch_bucket_size"] = int(layer_params)
    return ds


def keeps_whole_parameters(ds: dict, largest_param: int, num_params: int) -> bool:
    """ZeRO-3 with every parameter persistent (`stage3_param_persistence_threshold` at least the largest parameter's
    elements, and `stage3_model_persistence_threshold`, if set, at least the model's): DeepSpeed keeps each parameter
    whole on every GPU beside the rank's partition, so no layer is gathered for its forward or backward; the
    gradients are still reduce-scattered, the optimizer state stays partitioned, and the updated partitions are
    gathered once per step."""
    zero = ds.get("zero_optimization", {})
    if zero_stage(ds) != 3:
        return False
    threshold = zero.get("stage3_param_persistence_threshold")
    if threshold is None:  # DeepSpeed's own default
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

        threshold = DeepSpeedZeroConfig.model_fields["param_persistence_threshold"].default
    return (isinstance(threshold, (int, float)) and threshold >= largest_param
            and zero.get("stage3_model_persistence_threshold", num_params) >= num_params)


def with_whole_parameters(ds: dict, largest_param: int) -> dict:
    """`ds` (a copy) keeping every parameter whole on each GPU (keeps_whole_parameters)."""
    ds = copy.deepcopy(ds)
    ds.setdefault("zero_optimization", {})["stage3_param_persistence_threshold"] = int(largest_param)
    return ds


def persistence_is_auto(raw: dict) -> bool:
    """Whether the config as written leaves ZeRO-3's persistence threshold to the run ("auto")."""
    return raw.get("zero_optimization", {}).get("stage3_param_persistence_threshold") == AUTO


def zero12_optimizer_offload(ds: dict) -> bool:
    """ZeRO-1/2 with the optimizer offloaded: DeepSpeed's path whose gradient accumulation goes through host memory
    unless grad_accum_dtype is fp32."""
    return zero_stage(ds) in (1, 2) and offloads(ds)[0]


def cpu_optimizer_offload(ds: dict) -> bool:
    """ZeRO-1/2/3 with the optimizer offloaded to CPU memory (under ZeRO-3 fully or in part): DeepSpeed's CPU update,
    which the delayed update runs beside the next step."""
    return zero_stage(ds) in (1, 2, 3) and offload_devices(ds)[0] == "cpu"


def check_delayed_update(ds: dict, from_step: int) -> list[Problem]:
    """--delayed_update_from_step defers the CPU optimizer step of ZeRO offload (patches.deepspeed_offload): the
    configs it covers offload the optimizer to CPU memory (ZeRO-3: fully or in part, the parameters too or not) and
    use DeepSpeed's CPU AdamW (or Adam in its default AdamW mode) in bf16 or fp32."""
    if from_step <= 0:
        return []
    where, problems = "--delayed_update_from_step", []
    zero = ds.get("zero_optimization", {}) if isinstance(ds.get("zero_optimization"), dict) else {}
    optimizer = ds.get("optimizer", {}) if isinstance(ds.get("optimizer"), dict) else {}
    params = optimizer.get("params", {}) if isinstance(optimizer.get("params"), dict) else {}
    offload_device, param_device = offload_devices(ds)
    if not cpu_optimizer_offload(ds):
        problems.append(Problem(where, from_step, f"delays the CPU-offloaded optimizer step of ZeRO; this config "
                                f"(ZeRO stage {zero_stage(ds)}, optimizer offload {offload_device}) has none",
                                "use a config with zero_optimization.offload_optimizer.device cpu "
                                "(configs/zero2-offload.json, configs/zero3-offload.json), or remove the flag"))
    elif param_device == "nvme":
        problems.append(Problem(where, from_step, "the delayed update rewrites the 16-bit parameters in host memory; "
                                "this config swaps them to NVMe (zero_optimization.offload_param.device nvme)",
                                "use offload_param.device cpu or none, or remove the flag"))
    elif (optimizer.get("type", "").lower() not in ADAM_NAMES or params.get("torch_adam")
          or params.get("adam_w_mode") is False or zero.get("zenflow") or params.get("bias_correction") is False):
        problems.append(Problem(where, from_step, "the delayed update steps DeepSpeed's CPU AdamW state; this config's "
                                f"optimizer ({json.dumps(optimizer)[:120]}) is another, or ZenFlow manages the offload",
                                "use optimizer.type AdamW (or Adam) without torch_adam, adam_w_mode false, "
                                "bias_correction false or zenflow, or remove the flag"))
    if precision(ds) == "fp16":
        problems.append(Problem(where, from_step, "fp16's dynamic loss scaling skips steps on overflow, which a "
                                "delayed update has already queued",
                                "use bf16 (\"bf16\": {\"enabled\": true}), or remove the flag"))
    return problems


def _partial_offload_state_kept() -> bool:
    """Whether patches.deepspeed_zero3 saves a partial offload's GPU part with its checkpoints (the installed DeepSpeed
    is one it was tested with)."""
    return gate(PARTIAL_OFFLOAD_STATE)


def _offload_ratio(ds: dict):
    """`zero_optimization.offload_optimizer.ratio` as written, None where it is not."""
    zero = ds.get("zero_optimization", {})
    offload = zero.get("offload_optimizer", {}) if isinstance(zero, dict) else {}
    return offload.get("ratio") if isinstance(offload, dict) else None


def partial_offload_ratio(ds: dict) -> float | None:
    """The `offload_optimizer.ratio` in force: a valid ratio below 1 under ZeRO-3 with the optimizer offloaded (what
    DeepSpeed applies); None otherwise (`_check_partial_offload` reports a ratio that would not apply)."""
    ratio = _offload_ratio(ds)
    if (isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 <= ratio < 1
            or zero_stage(ds) != 3 or not offloads(ds)[0]):
        return None
    return ratio


def _check_partial_offload(ds: dict) -> list[Problem]:
    """`zero_optimization.offload_optimizer.ratio`: the share of the optimizer states DeepSpeed offloads, the rest
    updated on the GPU. DeepSpeed reads it under ZeRO-3 only, with its CPU Adam (an assertion otherwise)."""
    ratio, where = _offload_ratio(ds), "zero_optimization.offload_optimizer.ratio"
    if ratio is None:
        return []
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 <= ratio <= 1:
        return [Problem(where, ratio, "must be a number from 0 to 1 (the share of the optimizer states offloaded)",
                        "use e.g. 0.5, or remove it (1: all offloaded)")]
    if ratio == 1 or not offloads(ds)[0]:
        return []
    if zero_stage(ds) != 3:
        return [Problem(where, ratio, f"DeepSpeed applies a partial offload under ZeRO-3 only (stage {zero_stage(ds)} "
                        "here): every optimizer state would still go to the host",
                        "use ZeRO-3 (configs/zero3-offload.json) with the ratio, or remove it")]
    if ds.get("optimizer", {}).get("params", {}).get("torch_adam"):
        return [Problem(where, ratio, "a partial offload runs DeepSpeed's CPU Adam on the host part, which "
                        "optimizer.params.torch_adam true replaces", "remove torch_adam, or the ratio")]
    return []


# DeepSpeed's dynamic loss scaling, as its fp16 defaults: the scale starts at 2^16, halves on an overflow (that step's
# update is skipped) and doubles after 1000 steps without one.
FP16_DYNAMIC = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
                "hysteresis": 2, "min_loss_scale": 1}


def hardware_precision(cuda: bool, bf16: bool) -> str:
    """The half precision the training devices support: bf16 (Ampere and newer), fp16 (other CUDA GPUs: T4, V100),
    or fp32 (CPU)."""
    return "bf16" if cuda and bf16 else "fp16" if cuda else "fp32"


def resolve_precision(ds: dict, hardware: str) -> tuple[list[str], list[Problem]]:
    """Resolve "auto" in the bf16 and fp16 sections in place: bf16 where the hardware has it; fp16 with dynamic loss
    scaling on GPUs without bf16 (bf16 "auto" falls back to it unless the config sets fp16 itself); fp32 on CPU."""
    notes, problems = [], []
    bf16, fp16 = ds.get("bf16"), ds.get("fp16")
    bf16 = bf16 if isinstance(bf16, dict) else None
    fp16 = fp16 if isinstance(fp16, dict) else None
    if fp16 is not None and fp16.get("enabled") == AUTO:
        fp16["enabled"] = hardware != "fp32" and not (bf16 is not None and bf16.get("enabled") is True)
    if bf16 is not None and bf16.get("enabled") == AUTO:
        bf16["enabled"] = hardware == "bf16" and not (fp16 is not None and fp16.get("enabled") is True)
        if hardware == "fp16" and fp16 is None:
            ds["fp16"] = dict(FP16_DYNAMIC)
            notes.append('bf16 "auto": this GPU has no bf16, so training runs in fp16 with dynamic loss scaling')
    if ds.get("bf16", {}).get("enabled") is True and hardware != "bf16":
        problems.append(Problem("bf16.enabled", True, f"this hardware has no bf16 support ({hardware} at best)",
                                'set "bf16": {"enabled": "auto"} (fp16 on GPUs without bf16, fp32 on CPU)'))
    if ds.get("fp16", {}).get("enabled") is True and hardware == "fp32":
        problems.append(Problem("fp16.enabled", True, "fp16 training needs a CUDA GPU and there is none here",
                                'set "fp16": {"enabled": "auto"} (fp32 where no GPU is present)'))
    if ds.get("fp16", {}).get("enabled") is True and ds.get("bf16", {}).get("enabled") is True:
        problems.append(Problem("bf16.enabled / fp16.enabled", True, "both are on; DeepSpeed trains in one",
                                "turn one of them off"))
    return notes, problems


def precision(ds: dict) -> str:
    """The resolved config's training precision, for the log: bf16, fp16 or fp32."""
    return "bf16" if ds.get("bf16", {}).get("enabled") else "fp16" if ds.get("fp16", {}).get("enabled") else "fp32"


def _flat_items(node, prefix=""):
    """(dotted key, value) for every leaf of a config section."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _flat_items(value, f"{prefix}.{key}" if prefix else key)
    else:
        yield prefix, node


def leftover_autos(node):
    return ((path, value) for path, value in _flat_items(node) if value == AUTO)


def zero_stage(ds: dict) -> int:
    return int(ds.get("zero_optimization", {}).get("stage", 0))


def fp32_grad_accumulation(ds: dict) -> bool:
    """ZeRO-1/2 accumulates gradients in DeepSpeed's fp32 buffer on the GPU ("data_types": {"grad_accum_dtype": "fp32"})."""
    return ds.get("data_types", {}).get("grad_accum_dtype") == "fp32"


def zero3_sub_groups(param_groups: list[list[int]], world: int, sub_group_size: float) -> list[int]:
    """The sizes of the sub-groups ZeRO-3 cuts a rank's optimizer partition into (stage3.py): each parameter group
    (`param_groups`: its parameters' sizes, in the order setup() groups them) whole where it holds at most
    `sub_group_size` elements of the rank's partition, else cut after each parameter that brings a sub-group to it."""
    sub_groups: list[int] = []
    for group in param_groups:
        sizes = [math.ceil(n / world) for n in group]
        if not sizes:
            continue
        if sub_group_size >= sum(sizes):
            sub_groups.append(sum(sizes))
            continue
        current = 0
        for i, n in enumerate(sizes):
            current += n
            if current >= sub_group_size or i == len(sizes) - 1:
                sub_groups.append(current)
                current = 0
    return sub_groups


def gpu_optimizer_share(ds: dict, param_groups: list[list[int]], world: int) -> float:
    """The share of each rank's optimizer states (fp32 master weights, Adam moments, fp32 gradients) that a partial
    offload keeps on the GPU (`offload_optimizer.ratio` r < 1 under ZeRO-3), 0 without one: DeepSpeed keeps the first
    floor((1 - r) n) of the rank's n sub-groups there (`zero3_sub_groups`)."""
    ratio = partial_offload_ratio(ds)
    if ratio is None:
        return 0.0
    size = ds["zero_optimization"].get("sub_group_size", 1e9)
    sub_groups = zero3_sub_groups(param_groups, world, size if isinstance(size, (int, float)) and size > 0 else 1e9)
    total = sum(sub_groups)
    return sum(sub_groups[:int((1 - ratio) * len(sub_groups))]) / total if total else 0.0


def offload_setting(ds: dict, part: str, key: str, default=None):
    """`zero_optimization.<part>.<key>` (part: offload_optimizer or offload_param), `default` where it is not set."""
    zero = ds.get("zero_optimization") if isinstance(ds.get("zero_optimization"), dict) else {}
    section = zero.get(part) if isinstance(zero.get(part), dict) else {}
    return section.get(key, default)


def offload_devices(ds: dict) -> tuple[str, str]:
    """Where the optimizer states and the parameters are offloaded to: none, cpu or nvme."""
    return (offload_setting(ds, "offload_optimizer", "device") or "none",
            offload_setting(ds, "offload_param", "device") or "none")


def offloads(ds: dict) -> tuple[bool, bool]:
    optimizer, param = offload_devices(ds)
    return optimizer != "none", param != "none"


# The parts of a resolved config that set the optimisation, and the flag each derived value comes from: a resume that
# changes one continues the run with other settings (a longer --max_steps stretches the cosine decay, for one).
OPTIMISATION_KEYS = ("train_batch_size", "gradient_clipping", "optimizer", "scheduler", "data_types")
DERIVED_FROM = {"train_batch_size": "micro-batch x accumulation x ranks; --global_batch_tokens keeps it",
                "scheduler.params.total_num_steps": "--max_steps",
                "scheduler.params.warmup_num_steps": "--warmup_steps, or 5% of --max_steps",
                "optimizer.params.lr": "--learning_rate"}


def optimisation_changes(saved: dict, current: dict) -> list[str]:
    """What differs between a checkpoint's resolved DeepSpeed config (its manifest's) and this run's, among the
    settings of the optimisation and the precision, as 'key: old -> new (where the value comes from)'."""

    def flat(ds: dict) -> dict:
        values = {f"{name}.enabled": ds.get(name, {}).get("enabled") for name in ("bf16", "fp16")
                  if isinstance(ds.get(name), dict)}
        values.update(_flat_items({key: ds[key] for key in OPTIMISATION_KEYS if key in ds}))
        return values

    if not saved:
        return []  # a checkpoint written before manifests held the config
    before, after = flat(saved), flat(json.loads(json.dumps(current)))  # as the manifest stores it (lists, not tuples)
    changes = []
    for key in sorted(set(before) | set(after)):
        old, new = before.get(key), after.get(key)
        if old != new:
            source = f" ({DERIVED_FROM[key]})" if key in DERIVED_FROM else ""
            changes.append(f"{key}: {json.dumps(old)} -> {json.dumps(new)}{source}")
    return changes
