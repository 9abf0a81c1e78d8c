"""Text from an exported model (or any model `from_pretrained` loads): a continuation of a prompt, or a chat reply
through the model's chat template, the assistant's answer only (the `python -m model_utils.generate` command and the
end-of-run sample).
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
    quantization = recorded_base_quantization(model_dir, dtype)
    if quantization is not None and importlib.util.find_spec("bitsandbytes") is None:
        raise SystemExit(f"error: {model_dir} is an adapter trained on a 4-bit base, which needs bitsandbytes: "
                         "pip install '.[qlora]', or generate from the merged export")
    if quantization is not None:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, quantization_config=quantization,
                                                     device_map={"": device})
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device)
    return tokenizer, model.eval(), device


def _generate(model, tokenizer, input_ids, max_new_tokens: int, greedy: bool):
    import torch

    with torch.no_grad():
        return model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                              max_new_tokens=max_new_tokens, do_sample=not greedy,
                              pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)


def generate_text(model_dir, prompt: str, max_new_tokens: int = 40, greedy: bool = True) -> str:
    tokenizer, model, device = _load(model_dir)
    inputs = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).to(device)
    out = _generate(model, tokenizer, inputs["input_ids"], max_new_tokens, greedy)
    return tokenizer.decode(out[0], skip_special_tokens=True)


def chat_reply(model_dir, message: str, max_new_tokens: int = 200, greedy: bool = True,
               system: str | None = None) -> str:
    """The assistant's answer to one user message, prompted through the model's chat template."""
    tokenizer, model, device = _load(model_dir)
    if not getattr(tokenizer, "chat_template", None):
        raise SystemExit(f"error: {model_dir} has no chat template; use --prompt, or export a fine-tuning run "
                         "(its export carries the template it was trained with)")
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": message}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    input_ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"].to(device)
    out = _generate(model, tokenizer, input_ids, max_new_tokens, greedy)
    return tokenizer.decode(out[0, input_ids.shape[1]:], skip_special_tokens=True).strip()
