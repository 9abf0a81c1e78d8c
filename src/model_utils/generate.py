"""Generate text from an exported Hugging Face model directory (or any model `from_pretrained` loads).

    python -m model_utils.generate --model checkpoints/hf --prompt "Return the number of" --max_new_tokens 40
"""

from __future__ import annotations

import argparse


def generate_text(model_dir, prompt: str, max_new_tokens: int = 40, greedy: bool = True) -> str:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
    model.to(device).eval()
    inputs = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).to(device)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=not greedy,
                             pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    return tokenizer.decode(out[0], skip_special_tokens=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="exported model directory (e.g. checkpoints/hf) or hub id")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--max_new_tokens", type=int, default=40)
    parser.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    args = parser.parse_args(argv)
    print(generate_text(args.model, args.prompt, args.max_new_tokens, greedy=not args.sample))


if __name__ == "__main__":
    main()
