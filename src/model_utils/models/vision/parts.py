"""A vision-language model's three parts, found by the names transformers gives their modules: the vision tower
(`visual`, `vision_tower`, `vision_model`), the projector that maps its features into the language model's
embeddings (`merger`, `multi_modal_projector`, `connector`, Qwen3-VL's `deepstack_merger_list`) and the language
model (everything else, the LM head included). What trains is set per part (--freeze, default: a pretrained model's
tower frozen, the projector and the language model trained, as Qwen's and ms-swift's fine-tuning scripts do; a preset
trained from random weights trains every part), each with a learning rate
of its own as a factor on the schedule's (--vision_tower_lr, --projector_lr). With LoRA the adapters go on the
language model's layers only, and a projector or tower that trains is trained whole beside them (peft's
modules_to_save).
"""

from __future__ import annotations

from model_utils.core.problems import Problem

PARTS = ("vision_tower", "projector", "language_model")
DEFAULT_FROZEN = ("vision_tower",)
PROJECTOR_MODULES = ("merger", "multi_modal_projector", "connector", "mm_projector", "deepstack_merger_list")
TOWER_MODULES = ("visual", "vision_tower", "vision_model")


def part_of(name: str) -> str:
    """The part a parameter or module belongs to, by its dotted name."""
    segments = name.split(".")
    if any(segment in PROJECTOR_MODULES for segment in segments):
        return "projector"
    if any(segment in TOWER_MODULES for segment in segments):
        return "vision_tower"
    return "language_model"


def parse_parts(text: str | None, pretrained: bool = True) -> tuple[str, ...]:
    """--freeze as a tuple of parts: None is the default (the tower of a pretrained model; nothing of a preset trained
    from random weights, whose tower would otherwise stay random), "none" or "" freezes nothing."""
    if text is None:
        return DEFAULT_FROZEN if pretrained else ()
    names = tuple(name.strip() for name in text.split(",") if name.strip() and name.strip() != "none")
    return names


def freeze_problems(text: str | None, lora: bool) -> list[Problem]:
    """--freeze naming a part the model has not, freezing everything, or the language model under LoRA (whose
    adapters are the language model's training)."""
    parts = parse_parts(text)
    unknown = [name for name in parts if name not in PARTS]
    if unknown:
        return [Problem("--freeze", text, f"names {', '.join(unknown)}, not a part of a vision-language model",
                        f"name parts among {', '.join(PARTS)} (comma-separated), or none")]
    if set(parts) == set(PARTS):
        return [Problem("--freeze", text, "freezes every part: nothing would train",
                        "leave one part out (the default freezes the vision tower only)")]
    if lora and "language_model" in parts:
        return [Problem("--freeze", text, "freezes the language model, and LoRA trains adapters on it",
                        "leave language_model out of --freeze, or drop --lora_rank to train the other parts only")]
    return []


def freeze(model, frozen: tuple[str, ...]) -> dict[str, int]:
    """Stop the gradients of the frozen parts' parameters; returns each part's parameters, as counted (ZeRO-3's
    placeholders by their real size)."""
    counts = dict.fromkeys(PARTS, 0)
    for name, parameter in model.named_parameters():
        part = part_of(name)
        counts[part] += getattr(parameter, "ds_numel", parameter.numel())
        if part in frozen:
            parameter.requires_grad_(False)
    return counts


def keep_frozen_tower_out_of_autograd(model, frozen: tuple[str, ...]) -> int:
    """A frozen vision tower builds no autograd graph. transformers' `enable_input_require_grads` (called by activation
    checkpointing's enable, and by models.lora.apply_lora under checkpointing) hooks the input embedding of every
    PreTrainedModel inside the model, the tower's patch embedding too; its output then requires gradients, and each
    frozen tower block (left out of checkpointing by build_vision_model) would keep its whole working set for a
    pixel gradient nothing uses. Here each frozen tower's input embedding is hidden from those hooks (its
    `get_input_embeddings` answers None, which transformers skips); the projector, where it trains, still gets its
    gradients from its own weights. tests/unit/models/test_vision_models.py checks that the frozen blocks keep nothing
    and that the trained parts' gradients are unchanged. Returns the towers changed."""
    if "vision_tower" not in frozen:
        return 0
    from transformers import PreTrainedModel

    changed = 0
    for name, module in model.named_modules():
        if name and isinstance(module, PreTrainedModel) and part_of(name) == "vision_tower":
            module.get_input_embeddings = _no_input_embeddings  # before any hook: build_vision_model calls this first
            changed += 1
    return changed


def _no_input_embeddings():
    return None


def part_modules(model, part: str) -> list[str]:
    """The outermost modules of a part, by their last name (what peft's modules_to_save matches)."""
    names = set()
    for name, _ in model.named_modules():
        segments = name.split(".")
        if segments[-1] in (PROJECTOR_MODULES if part == "projector" else TOWER_MODULES) and part_of(name) == part:
            names.add(segments[-1])
    return sorted(names)


def language_model_linear_names(model) -> list[str]:
    """The last names of the language model's linear layers (its output head apart): what all-linear adapts."""
    import torch

    head = model.get_output_embeddings()
    return sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                   if isinstance(module, torch.nn.Linear) and module is not head and part_of(name) == "language_model"
                   and "lora_" not in name})


def language_model_targets(targets: list[str] | str) -> str:
    """peft's target_modules (a regular expression peft matches whole) for layers named `targets` (or every linear
    layer: "all-linear") inside the language model alone, never the tower's or the projector's layers of the same
    names (Qwen2.5-VL's vision blocks hold gate_proj, up_proj and down_proj too)."""
    outside = "|".join(TOWER_MODULES + PROJECTOR_MODULES)
    names = r"[^.]+" if targets == "all-linear" else "|".join(targets)
    return rf"^(?!(.*\.)?({outside})\.)(.*\.)?({names})$"


def lr_scales(frozen: tuple[str, ...], learning_rate: float, tower_lr: float | None,
              projector_lr: float | None) -> dict[str, float]:
    """Each trained part's learning rate as a factor on the schedule's (the language model's)."""
    scales = {"language_model": 1.0, "vision_tower": 1.0, "projector": 1.0}
    if tower_lr is not None and learning_rate:
        scales["vision_tower"] = tower_lr / learning_rate
    if projector_lr is not None and learning_rate:
        scales["projector"] = projector_lr / learning_rate
    return {part: scale for part, scale in scales.items() if part not in frozen}


def part_groups(model, decay_groups, weight_decay: float, scales: dict[str, float]) -> list[dict]:
    """The optimizer's parameter groups: per trained part, its matrices (weight decay) and its other parameters (none),
    each with the part's `lr_scale`; the language model's first (its rate is the one the log shows)."""
    by_part: dict[str, list] = {part: [] for part in PARTS}
    for name, parameter in model.named_parameters():
        if parameter.requires_grad:
            by_part[part_of(name)].append(parameter)
    groups = []
    for part in ("language_model", "projector", "vision_tower"):
        if not by_part[part]:
            continue
        matrices, others = decay_groups(by_part[part])
        scale = scales.get(part, 1.0)
        groups += [{"params": matrices, "weight_decay": weight_decay, "lr_scale": scale, "part": part},
                   {"params": others, "weight_decay": 0.0, "lr_scale": scale, "part": part}]
    return [group for group in groups if group["params"]]


def keep_lr_scales(engine) -> bool:
    """Each parameter group at its part's factor of the schedule's rate: applied now and after every step of the
    scheduler (which sets every group's rate alike). False where every factor is 1 (nothing to do)."""
    groups = engine.optimizer.param_groups
    if all(group.get("lr_scale", 1.0) == 1.0 for group in groups):
        return False

    def scale():
        for group in groups:
            group["lr"] = group["lr"] * group.get("lr_scale", 1.0)

    scheduler = engine.lr_scheduler
    if scheduler is not None:
        step = scheduler.step

        def scaled_step(*args, **kwargs):
            result = step(*args, **kwargs)
            scale()
            return result

        scheduler.step = scaled_step
    scale()
    return True
