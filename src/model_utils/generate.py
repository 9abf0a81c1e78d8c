"""Generate text from an exported Hugging Face model directory (or any model `from_pretrained` loads).

    python -m model_utils.generate --model checkpoints/hf --prompt "Return the number of" --max_new_tokens 40
    python -m model_utils.generate --model checkpoints/hf --chat "What does json.dumps do?"   # a fine-tuned model

--chat sends the message as a user turn through the model's chat template (a fine-tuning run's export carries the
template it was trained with) and prints the assistant's answer only.
"""

from __future__ import annotations

import argparse


def _load(model_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
    return tokenizer, model.to(device).eval(), device


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


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="exported model directory (e.g. checkpoints/hf) or hub id")
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", help="text to continue")
    what.add_argument("--chat", help="a user message, answered through the model's chat template")
    parser.add_argument("--system", help="with --chat: a system message before it")
    parser.add_argument("--max_new_tokens", type=int, default=None,
                        help="default: 40 with --prompt, 200 with --chat")
    parser.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    args = parser.parse_args(argv)
    if args.chat is not None:
        print(chat_reply(args.model, args.chat, args.max_new_tokens or 200, greedy=not args.sample,
                         system=args.system))
    else:
        print(generate_text(args.model, args.prompt, args.max_new_tokens or 40, greedy=not args.sample))


if __name__ == "__main__":
    main()
