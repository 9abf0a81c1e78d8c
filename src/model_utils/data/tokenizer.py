"""Tokenizers: the shipped default (no download) and anything `AutoTokenizer` can load.

The default is a byte-level BPE with 8192 entries trained by this project on the embedded corpus
(`python -m model_utils.data.tokenizer --rebuild` regenerates it). Byte-level means it encodes any text, so it also
serves as a stand-in for user data when no hub tokenizer is reachable.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from model_utils.data.corpus import build_embedded_corpus

DEFAULT_TOKENIZER_DIR = Path(__file__).resolve().parents[1] / "assets" / "tokenizer"
DEFAULT_TOKENIZER = "default"
DEFAULT_VOCAB_SIZE = 8192
EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"


def load_tokenizer(name_or_path: str | None):
    """Load `name_or_path` through `AutoTokenizer`; `None` or "default" means the shipped tokenizer.

    A tokenizer without an EOS token cannot separate packed documents, so one is required.
    """
    from transformers import AutoTokenizer

    source = str(DEFAULT_TOKENIZER_DIR) if name_or_path in (None, "", DEFAULT_TOKENIZER) else name_or_path
    tokenizer = AutoTokenizer.from_pretrained(source)
    if len(tokenizer) < 2 or not tokenizer("a b c", add_special_tokens=False)["input_ids"]:
        # transformers builds an empty tokenizer from a model directory that has a config but no tokenizer files
        raise ValueError(f"--tokenizer {name_or_path or source}: {source} holds no usable tokenizer (vocabulary of "
                         f"{len(tokenizer)}); pass --tokenizer with the tokenizer the model was trained with")
    if tokenizer.eos_token_id is None:
        raise ValueError(
            f"--tokenizer {name_or_path}: the tokenizer has no EOS token, which separates packed documents; "
            "set one with tokenizer.add_special_tokens({'eos_token': ...}) and save it, or pick another tokenizer"
        )
    return tokenizer


def train_default_tokenizer(out_dir: Path = DEFAULT_TOKENIZER_DIR, vocab_size: int = DEFAULT_VOCAB_SIZE) -> Path:
    """Train the default byte-level BPE on the embedded corpus and save it in Hugging Face format."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = build_embedded_corpus()

    def texts():
        with open(corpus, encoding="utf-8") as f:
            for line in f:
                yield json.loads(line)["text"]

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts(), trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token=EOS_TOKEN, bos_token=EOS_TOKEN, pad_token=PAD_TOKEN, unk_token=None
    )
    wrapped.model_max_length = 1 << 20
    out_dir.mkdir(parents=True, exist_ok=True)
    wrapped.save_pretrained(out_dir)
    return out_dir


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rebuild", action="store_true", help="retrain the shipped default tokenizer")
    parser.add_argument("--out", type=Path, default=DEFAULT_TOKENIZER_DIR)
    if parser.parse_args().rebuild:
        print(train_default_tokenizer(parser.parse_args().out))
