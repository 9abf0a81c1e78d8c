"""The processor of a vision-language model: its tokenizer, its image processor and its chat template, as transformers'
AutoProcessor loads them from a model directory or hub id, or built for a preset (the shipped tokenizer with the
vision tokens added, the image processor at its defaults, a chat template that renders images and marks answers).

The image token is the one token the chat template writes for each image, which the processor expands into the
image's tokens (Qwen2-VL's `<|image_pad|>` into one token per merged patch, LLaVA's `<image>` into one per patch);
`ImageTokens` runs that expansion for one image at a time, so an example's tokens are the conversation's with each
image token replaced by its image's.

A processor whose class also takes a video processor (the Qwen-VL family) cannot be built without torchvision in
transformers 5.x, where image-only training needs none: it is built without one (`image_only`), under the same
class name, so the directory it is saved to loads with AutoProcessor wherever torchvision is installed.
"""

from __future__ import annotations

import hashlib
import inspect
import json

# The vision tokens a preset adds to the shipped tokenizer, with the Qwen-VL family's names: an image is written as
# <|vision_start|><|image_pad|><|vision_end|>, and <|image_pad|> is expanded into the image's tokens.
VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"
VISION_TOKENS = (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)

# A preset's chat template: the shipped tokenizer's ChatML-like layout (data.sft.formats.DEFAULT_CHAT_TEMPLATE) with
# a message's content as a string or a list of parts ({"type": "image"} or {"type": "text", "text": ...}), each image
# written as the Qwen-VL family writes it, the answers marked for the assistant mask.
PRESET_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{% set parts = [{'type': 'text', 'text': message['content']}] %}"
    "{% else %}{% set parts = message['content'] %}{% endif %}"
    "{% if message['role'] == 'assistant' %}{% generation %}"
    "{% for part in parts %}{% if part['type'] == 'image' %}{{ '" + VISION_START + IMAGE_PAD + VISION_END + "' }}"
    "{% else %}{{ part['text'] }}{% endif %}{% endfor %}{{ eos_token }}"
    "{% endgeneration %}{% else %}"
    "{% for part in parts %}{% if part['type'] == 'image' %}{{ '" + VISION_START + IMAGE_PAD + VISION_END + "' }}"
    "{% else %}{{ part['text'] }}{% endif %}{% endfor %}{{ eos_token }}"
    "{% endif %}{{ '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class ProcessorError(ValueError):
    """A processor that cannot be loaded or built, with the reason in its message."""


def preset_processor(image_processor_class: str = "Qwen2VLImageProcessor", processor_class: str = "Qwen2_5_VLProcessor"):
    """A preset's processor: the shipped tokenizer with VISION_TOKENS added, `image_processor_class` at its defaults
    (its PIL backend where torchvision is missing), PRESET_CHAT_TEMPLATE."""
    from model_utils.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(None)
    tokenizer.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
    tokenizer.chat_template = PRESET_CHAT_TEMPLATE
    return image_only(transformers_class(processor_class), image_processor_of(image_processor_class), tokenizer,
                      PRESET_CHAT_TEMPLATE)


def transformers_class(name: str):
    import transformers

    found = getattr(transformers, name, None)
    if found is None:
        raise ProcessorError(f"transformers {transformers.__version__} has no {name}")
    return found


def image_processor_of(name: str):
    """An image processor of class `name` at its defaults: transformers' torchvision backend where torchvision is
    installed, else its PIL backend (`NamePil`, transformers 5.24 on) or, in releases before the backends, the class
    itself."""
    import importlib.util

    import transformers

    if importlib.util.find_spec("torchvision") is None and hasattr(transformers, f"{name}Pil"):
        return transformers_class(f"{name}Pil")()
    return transformers_class(name)()


def image_only(processor_class, image_processor, tokenizer, chat_template: str | None):
    """`processor_class` built from an image processor and a tokenizer alone: where its __init__ also takes a video
    processor, through a subclass of the same name that passes none (the saved processor_config.json names the class
    itself)."""
    if "video_processor" not in inspect.signature(processor_class.__init__).parameters:
        return processor_class(image_processor=image_processor, tokenizer=tokenizer, chat_template=chat_template)

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        processor_class.__init__(self, image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    def __reduce__(self):  # built again the same way in another process (a spawned encoding worker)
        return image_only, (processor_class, self.image_processor, self.tokenizer, self.chat_template)

    without_video = type(processor_class.__name__, (processor_class,),
                         {"__init__": __init__, "__reduce__": __reduce__, "__module__": processor_class.__module__,
                          "__qualname__": processor_class.__qualname__})
    return without_video(image_processor=image_processor, tokenizer=tokenizer, chat_template=chat_template)


def load_processor(name_or_path: str, model_type: str | None = None):
    """The processor of a model directory or hub id (AutoProcessor); where AutoProcessor cannot build it here (a
    video processor without torchvision) or gives a tokenizer alone, the model type's processor class built from
    AutoImageProcessor and AutoTokenizer (`image_only`). Raises ProcessorError where there is no image processor."""
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer

    try:
        processor = AutoProcessor.from_pretrained(name_or_path)
        if getattr(processor, "image_processor", None) is not None and getattr(processor, "tokenizer", None):
            return processor
    except (ImportError, AttributeError, ValueError, TypeError, OSError) as e:  # a video processor needs torchvision
        failure = e
    else:
        failure = None
    try:
        image_processor = AutoImageProcessor.from_pretrained(name_or_path)
        tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    except (OSError, ValueError) as e:
        raise ProcessorError(f"{name_or_path} has no image processor that loads here ({str(e).splitlines()[0]})") from e
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    class_name = PROCESSOR_MAPPING_NAMES.get(model_type or "")
    if not class_name:
        raise ProcessorError(f"{name_or_path}: no processor class is known for model type {model_type!r}"
                             + (f" ({failure})" if failure else ""))
    template = getattr(tokenizer, "chat_template", None)
    return image_only(transformers_class(class_name), image_processor, tokenizer, template)


def chat_template_of(processor) -> str | None:
    """The template conversations are rendered with: the processor's, else its tokenizer's."""
    template = getattr(processor, "chat_template", None) or getattr(processor.tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default")
    return template if isinstance(template, str) and template.strip() else None


def image_token(processor) -> tuple[str, int]:
    """(the token the chat template writes for an image, its id): the processor's image token (Gemma 3's
    beginning-of-image token, which its processor expands)."""
    token = getattr(processor, "boi_token", None) or getattr(processor, "image_token", None)
    if not token:
        raise ProcessorError(f"{type(processor).__name__} names no image token")
    ids = processor.tokenizer.convert_tokens_to_ids([token])
    if not ids or ids[0] is None or ids[0] == processor.tokenizer.unk_token_id:
        raise ProcessorError(f"the tokenizer has no token {token!r}, which the processor expands into an image's")
    return token, ids[0]


def _bounds(size) -> tuple[int, int] | None:
    """(shortest_edge, longest_edge) of an image processor's `size` (a dict, or transformers 5's SizeDict) where both
    are set: the Qwen-VL family's pixel bounds."""
    get = size.get if isinstance(size, dict) else (lambda key: getattr(size, key, None))
    low, high = get("shortest_edge"), get("longest_edge")
    return (int(low), int(high)) if low and high else None


def set_image_pixels(processor, max_pixels: int | None, min_pixels: int | None) -> bool:
    """Bound the pixels each image is resized to (the Qwen-VL family's min/max pixels: `size` shortest_edge and
    longest_edge, in pixels); True where the image processor has such bounds, False where it resizes to a fixed size
    (CLIP, SigLIP)."""
    import dataclasses

    image_processor = processor.image_processor
    size = getattr(image_processor, "size", None)
    if size is None or _bounds(size) is None or not hasattr(image_processor, "merge_size"):
        return False
    low, high = _bounds(size)
    bounded = {"shortest_edge": int(min_pixels or low), "longest_edge": int(max_pixels or high)}
    image_processor.size = {**size, **bounded} if isinstance(size, dict) else dataclasses.replace(size, **bounded)
    for name, value in (("max_pixels", max_pixels), ("min_pixels", min_pixels)):
        if value is not None and hasattr(image_processor, name):
            setattr(image_processor, name, int(value))
    return True


def image_pixels(processor) -> tuple[int, int] | None:
    """(min, max) pixels an image is resized within, or None for an image processor of a fixed size."""
    size = getattr(processor.image_processor, "size", None)
    return _bounds(size) if size is not None and hasattr(processor.image_processor, "merge_size") else None


def pixels_per_token(processor) -> int | None:
    """Pixels one image token covers (patch x patch x merge²: 784 for Qwen2.5-VL, 1,024 for Qwen3-VL), None where
    unknown."""
    image_processor = processor.image_processor
    patch, merge = getattr(image_processor, "patch_size", None), getattr(image_processor, "merge_size", None)
    return int(patch) ** 2 * int(merge) ** 2 if patch and merge else None


def processor_identity(processor) -> str:
    """A digest of what the tokens and pixels depend on: the tokenizer's vocabulary and template, the image
    processor's settings, the processor's own (how many tokens an image becomes: LLaVA's num_additional_image_tokens,
    the feature selection)."""
    from model_utils.data.tokens import tokenizer_identity

    own = {k: v for k, v in processor.to_dict().items() if k not in ("chat_template", "tokenizer")}  # expansion
    settings = json.dumps([processor.image_processor.to_dict(), own], sort_keys=True, default=str)
    parts = [tokenizer_identity(processor.tokenizer), chat_template_of(processor) or "", settings]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()
