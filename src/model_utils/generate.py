"""Generate text from an exported Hugging Face model directory (or any model `from_pretrained` loads).

    python -m model_utils.generate --model checkpoints/hf --prompt "Return the number of" --max_new_tokens 40
    python -m model_utils.generate --model checkpoints/hf --chat "What does json.dumps do?"   # a fine-tuned model
    python -m model_utils.generate --model checkpoints/hf --image shapes.png --chat "What colour are the shapes?"

--chat sends the message as a user turn through the model's chat template (a fine-tuning run's export carries the
template it was trained with) and prints the assistant's answer only.
"""

from __future__ import annotations

import argparse

from model_utils.models.generate import chat_reply, generate_text


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="exported model directory (e.g. checkpoints/hf) or hub id")
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", help="text to continue")
    what.add_argument("--chat", help="a user message, answered through the model's chat template")
    parser.add_argument("--system", help="with --chat: a system message before it")
    parser.add_argument("--image", action="append", default=[], metavar="FILE",
                        help="with --chat: an image shown before the message (a vision-language model; repeat for "
                             "several)")
    parser.add_argument("--max_new_tokens", type=int, default=None,
                        help="default: 40 with --prompt, 200 with --chat")
    parser.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    args = parser.parse_args(argv)
    if args.image and args.chat is None:
        parser.error("--image goes with --chat (the image is shown in the user's turn)")
    if args.chat is not None:
        print(chat_reply(args.model, args.chat, args.max_new_tokens or 200, greedy=not args.sample,
                         system=args.system, images=args.image))
    else:
        print(generate_text(args.model, args.prompt, args.max_new_tokens or 40, greedy=not args.sample))

if __name__ == "__main__":
    main()
