"""Text from an exported model (or any model `from_pretrained` loads): a continuation of a prompt, or a chat reply
through the model's chat template, the assistant's answer only, about images where the model sees (the
`python -m model_utils.generate` command and the end-of-run sample).
"""

from __future__ import annotations

import importlib.util


def _load(model_dir):
    """The tokenizer, the model on this machine's device, and the device. An adapter a QLoRA run exported has its base
    loaded in 4-bit, as it was trained (models.quantization.recorded_base_quantization)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from model_utils.models.quantization import recorded_base_quantization

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    auto = AutoModelForCausalLM
    if vision_processor(model_dir) is not None:  # a vision-language model, or an adapter of one
        from transformers import AutoModelForImageTextToText

        auto = AutoModelForImageTextToText
    quantization = recorded_base_quantization(model_dir, dtype)
    if quantization is not None and importlib.util.find_spec("bitsandbytes") is None:
        raise SystemExit(f"error: {model_dir} is an adapter trained on a 4-bit base, which needs bitsandbytes: "
                         "pip install '.[qlora]', or generate from the merged export")
    if quantization is not None:
        model = auto.from_pretrained(model_dir, dtype=dtype, quantization_config=quantization, device_map={"": device})
    else:
        model = auto.from_pretrained(model_dir, dtype=dtype).to(device)
    return tokenizer, model.eval(), device


def vision_processor(model_dir):
    """The processor of a vision-language model directory (data.vision.processor.load_processor), or of an adapter
    export of one (its processor saved beside the adapter); None for a text model."""
    from model_utils.models.vision.build import is_vision_config

    config = model_config_of(model_dir)
    if config is None or not is_vision_config(config):
        return None
    from model_utils.data.vision.processor import load_processor

    return load_processor(str(model_dir), config.model_type)


def model_config_of(model_dir):
    """The config of a model directory, or of an adapter's base (the base_model_name_or_path of peft's
    adapter_config.json); None where neither loads."""
    import json
    from pathlib import Path

    from transformers import AutoConfig

    adapter = Path(model_dir) / "adapter_config.json"
    name = json.loads(adapter.read_text()).get("base_model_name_or_path") if adapter.is_file() else model_dir
    try:
        return AutoConfig.from_pretrained(name) if name else None
    except (OSError, ValueError):
        return None


def _generate(model, tokenizer, input_ids, max_new_tokens: int, greedy: bool, **inputs):
    import torch

    with torch.no_grad():
        return model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                              max_new_tokens=max_new_tokens, do_sample=not greedy,
                              pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id, **inputs)


def generate_text(model_dir, prompt: str, max_new_tokens: int = 40, greedy: bool = True) -> str:
    tokenizer, model, device = _load(model_dir)
    inputs = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).to(device)
    out = _generate(model, tokenizer, inputs["input_ids"], max_new_tokens, greedy)
    return tokenizer.decode(out[0], skip_special_tokens=True)


def chat_reply(model_dir, message: str, max_new_tokens: int = 200, greedy: bool = True,
               system: str | None = None, images: list[str] = ()) -> str:
    """The assistant's answer to one user message, prompted through the model's chat template; `images`: files shown
    before the message (a vision-language model, through its processor)."""
    tokenizer, model, device = _load(model_dir)
    processor = vision_processor(model_dir) if images else None
    if images and processor is None:
        raise SystemExit(f"error: {model_dir} is not a vision-language model, so it takes no --image")
    template = (getattr(processor, "chat_template", None) if processor else None) or getattr(tokenizer, "chat_template",
                                                                                           None)
    if not template:
        raise SystemExit(f"error: {model_dir} has no chat template; use --prompt, or export a fine-tuning run "
                         "(its export carries the template it was trained with)")
    content = [*({"type": "image"} for _ in images), {"type": "text", "text": message}] if images else message
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]
    prompt = tokenizer.apply_chat_template(messages, chat_template=template, add_generation_prompt=True,
                                           tokenize=False)
    if processor is not None:
        from model_utils.data.vision.images import open_rgb

        inputs = processor(text=[prompt], images=[open_rgb(path) for path in images], add_special_tokens=False,
                           return_tensors="pt").to(device)
        input_ids = inputs.pop("input_ids")
        inputs.pop("attention_mask", None)
        out = _generate(model, tokenizer, input_ids, max_new_tokens, greedy, **inputs)
    else:
        input_ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"].to(device)
        out = _generate(model, tokenizer, input_ids, max_new_tokens, greedy)
    return tokenizer.decode(out[0, input_ids.shape[1]:], skip_special_tokens=True).strip()
