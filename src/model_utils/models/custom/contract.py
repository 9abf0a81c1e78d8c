"""The contract of a model of your own, `--model FILE.py:FUNCTION`:

- FUNCTION(settings) returns a `torch.nn.Module`; `settings` is a `ModelSettings` (the run's model_args, tokenizer,
  seq_len, seed, gradient_checkpointing). The trainer builds it on the meta device to plan (sizes only), then for
  real: under DeepSpeed's zero.Init with ZeRO-3, so a model larger than one GPU is partitioned as it is built.
- Its forward takes a micro-batch, the collated items, as keyword arguments, and returns the mean loss: a tensor, or
  a mapping or object with `loss` (and optionally `tokens`, the targets the loss is over, for the evaluation's mean).
- Optional hooks, methods of the module, each with a default:
    parameter_groups() -> {group: [module prefixes]}: names a curriculum's stages train or freeze (default: the
        module's top-level children, each a group of its own name)
    loss_tokens(batch) -> int: the loss targets of a micro-batch, read before the forward, so that each target of a
        step weighs the same (default: every micro-batch's mean weighs the same)
    flops(batch) -> float: the training FLOPs of a micro-batch, for TFLOP/s and MFU (default: none reported)
    activation_bytes(micro_batch) -> int: one GPU's activations at that micro-batch, for the preflight's memory
        plan (default: the plan counts the weights, gradients and optimizer states, and says it did not count these)
  Export: save_pretrained where the module is a transformers model, else model.safetensors and trainer_model.json
  (export.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from model_utils.core.problems import Problem
from model_utils.core.user_code import load_function

FIX_RETURN = "return the mean loss: a tensor, or {'loss': loss} (optionally with 'tokens': the targets it is over)"


@dataclass(frozen=True)
class ModelSettings:
    """What a model function receives."""

    args: dict = field(default_factory=dict)  # --model_args (the run file's model_args mapping)
    tokenizer: object = None  # the run's tokenizer (--tokenizer, else the project's shipped one)
    seq_len: int | None = None  # --seq_len
    seed: int = 0  # --seed (torch's RNG is seeded with it before the model is built)
    gradient_checkpointing: bool = False  # --gradient_checkpointing: recompute what your forward can


class UserModelError(Exception):
    """The user's model broke its contract: the Problem says where and how to fix it."""

    def __init__(self, problem: Problem):
        self.problem = problem
        super().__init__(str(problem))


def build_user_model(spec: str, settings: ModelSettings, device=None):
    """The module FUNCTION(settings) returns (on `device`, e.g. "meta", where given); UserModelError where FUNCTION
    is missing, raises, or returns something that is not a module."""
    import torch

    function, problem = load_function(spec, "model")
    if problem is not None:
        raise UserModelError(problem)
    try:
        if device is not None:
            with torch.device(device):
                module = function(settings)
        else:
            module = function(settings)
    except Exception as e:  # the user's code: its error, named, with where it came from
        raise UserModelError(Problem("--model", spec, f"calling it raised {type(e).__name__}: {e}",
                                     "fix the function (it receives settings.args, .tokenizer, .seq_len, .seed)")) from e
    if not isinstance(module, torch.nn.Module):
        raise UserModelError(Problem("--model", spec, f"returned a {type(module).__name__}, not a torch.nn.Module",
                                     "return the model (an nn.Module) from the function"))
    if not any(True for _ in module.parameters()):
        raise UserModelError(Problem("--model", spec, "returned a module without parameters",
                                     "return the model whose parameters train"))
    return module


def loss_of(output, spec: str):
    """(the loss, the targets it is over or None) of a forward's output; UserModelError where it holds no scalar
    loss."""
    import torch

    loss = output
    tokens = None
    if isinstance(output, dict):
        loss, tokens = output.get("loss"), output.get("tokens")
    elif not isinstance(output, torch.Tensor):
        loss, tokens = getattr(output, "loss", None), getattr(output, "tokens", None)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shown = type(output).__name__ if loss is None else f"loss of shape {tuple(getattr(loss, 'shape', ()))}"
        raise UserModelError(Problem("--model", spec, f"its forward returned {shown}, not a scalar loss", FIX_RETURN))
    return loss.reshape(()), tokens


def parameter_groups(model) -> dict[str, tuple[str, ...]]:
    """The model's named groups of module prefixes: its parameter_groups() hook, else each top-level child."""
    hook = getattr(model, "parameter_groups", None)
    if callable(hook):
        return {str(name): tuple(prefixes) for name, prefixes in hook().items()}
    return {name: (name,) for name, _ in model.named_children()}


def parameter_counts(model) -> tuple[int, int]:
    """(all parameters, trainable ones), ZeRO-3's placeholders by their real size."""
    total = trainable = 0
    for parameter in model.parameters():
        n = getattr(parameter, "ds_numel", parameter.numel())
        total += n
        trainable += n if parameter.requires_grad else 0
    return total, trainable


def hook(model, name: str):
    """The model's optional hook `name` (a method), or None."""
    found = getattr(model, name, None)
    return found if callable(found) else None


class BatchFlops:
    """TFLOP/s and MFU of a model of your own: its flops(batch) hook per micro-batch (step.py adds them up), nothing
    per token (the text models' 6N)."""

    non_embedding_params = 0
    num_layers = 0

    def per_token(self, attention_factor: int = 12) -> float:
        return 0.0

    def flops(self, tokens: float, attention_area: float, attention_factor: int = 12) -> float:
        return 0.0


def build_for_training(spec: str, settings: ModelSettings, ds: dict):
    """The module for the engine, in fp32 (DeepSpeed makes its 16-bit copy): under ZeRO-3 built inside
    deepspeed.zero.Init (in the config's precision), each parameter partitioned over the ranks as it is created (a
    model larger than one GPU never exists whole). UserModelError stops every rank alike."""
    import deepspeed

    from model_utils.config import deepspeed as dsc
    from model_utils.core.problems import ConfigError

    try:
        if dsc.zero_stage(ds) == 3:
            with deepspeed.zero.Init(config_dict_or_path=ds):
                model = build_user_model(spec, settings)
        else:
            model = build_user_model(spec, settings)
    except UserModelError as e:
        raise ConfigError([e.problem]) from e
    return model.float() if dsc.zero_stage(ds) != 3 else model


def evaluation_loss(engine, spec: str, inputs: dict):
    """(the loss of a micro-batch summed over its targets, their count) as float64 tensors, under no_grad: the
    forward's `tokens` where it returns them, else the micro-batch counts as one target."""
    import torch

    loss, tokens = loss_of(engine(**inputs), spec)
    count = torch.as_tensor(tokens if tokens is not None else 1, device=loss.device).double()
    return loss.double() * count, count
