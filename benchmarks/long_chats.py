"""Long chats for the long-context fine-tuning journey, built offline from this interpreter's standard library: each
chat gives the source of several standard-library modules, the one defining a function among them, asks what that
function does, and answers with its docstring (the embedded chats' question and answer, data/chat_corpus.py). The
other modules fill the prompt to about `--tokens` tokens of the run's tokenizer (its chat template included), in an
order drawn from the example's index, so the answer sits anywhere in the context. The same files for the same
interpreter and arguments.

    python benchmarks/long_chats.py --tokens 131072 --examples 24 --out /tmp/long-chats.jsonl

Writes `{"messages": [...]}` lines (the trainer's `--dataset FILE.jsonl` chat form; the trainer holds out its own
`--validation_fraction` of them).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import sysconfig
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


PREFIX = "Here is source code from the Python standard library.\n\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, required=True, help="about this many tokens per chat (at most)")
    parser.add_argument("--examples", type=int, default=24)
    parser.add_argument("--tokenizer", default=None, help="default: the shipped tokenizer (the presets')")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    from model_utils.data.chat_corpus import module_name, select_examples
    from model_utils.data.corpus import stdlib_sources
    from model_utils.data.sft.formats import attach_chat_template
    from model_utils.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(args.tokenizer)
    attach_chat_template(tokenizer)  # the template the trainer renders chats with where the tokenizer has none
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    sources = {module_name(path, stdlib): path for path in stdlib_sources()}
    functions = [f for f in select_examples()["train"] if f.module in sources]
    token_counts: dict[str, int] = {}

    def source(module: str) -> str:
        text = sources[module].read_text(encoding="utf-8", errors="replace")
        return f"<file name=\"{module.replace('.', '/')}.py\">\n{text}\n</file>\n\n"

    def tokens(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    def module_tokens(module: str) -> int:
        if module not in token_counts:
            token_counts[module] = tokens(source(module))
        return token_counts[module]

    def chat_tokens(messages: list[dict]) -> int:
        return tokens(tokenizer.apply_chat_template(messages, tokenize=False))

    modules = sorted(sources)
    limit = args.tokens - 32  # files' tokens counted apart: their joins can merge or split a few
    written = 0
    with open(args.out, "w", encoding="utf-8") as out:
        for function in functions:
            if written == args.examples:
                break
            messages = function.messages()
            question = messages[1]["content"]
            messages[1]["content"] = PREFIX + question  # the chat without its sources: what they are added to
            total = chat_tokens(messages) + module_tokens(function.module)
            if total > limit:  # its own module alone is longer: another function's
                continue
            rng = random.Random(written)
            chosen = [function.module]
            for module in rng.sample(modules, len(modules)):
                if module != function.module and total + module_tokens(module) <= limit:
                    chosen.append(module)
                    total += module_tokens(module)
                if total > 0.97 * limit:
                    break
            rng.shuffle(chosen)
            messages[1]["content"] = PREFIX + "".join(source(module) for module in chosen) + question
            out.write(json.dumps({"messages": messages}, ensure_ascii=False) + "\n")
            print(f"chat {written}: {len(chosen)} modules, {chat_tokens(messages):,} tokens, about {function.key}",
                  flush=True)
            written += 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
