"""Preference rows -> pairs of examples: the prompt followed by the chosen answer, and by the rejected one, token ids
with labels on the answer only, rendered as fine-tuning renders them (data.sft.encode: the chat template, its answer
spans, EOS after a text answer). TRL 1.16's DPOTrainer tokenizes the same way: a conversational prompt with the
generation prompt, EOS appended to text answers; its completion also holds what the template writes after the
answer's end of turn (ChatML's newline), which carries no loss here, as in fine-tuning.
"""

from __future__ import annotations

from dataclasses import dataclass

from model_utils.data.preference.formats import pair_parts
from model_utils.data.sft.encode import Example, ExampleEncoder


@dataclass
class PairExamples:
    """One row's two sequences, unshifted and untruncated (data.preference.packing cuts and shifts them)."""

    chosen: Example
    rejected: Example


class PairEncoder:
    """Turns checked preference rows into PairExamples with `tokenizer` (a fast tokenizer); the interface
    data.sft.encode.encode_all drives (`encode(row, number)`), so large datasets encode in worker processes."""

    def __init__(self, tokenizer, source: str = "dataset"):
        self.examples = ExampleEncoder(tokenizer, "chat", source=source)
        self.source = source
        self.eos_text = tokenizer.eos_token

    def describe(self, conversational: bool) -> str:
        if not conversational:
            return "preference pairs (text: prompt, answer, EOS)"
        template = ("the default ChatML-like template (the tokenizer has none)" if self.examples.default_template
                    else "the tokenizer's chat template")
        return f"preference pairs (conversational, {template})"

    def encode(self, row: dict, number: int) -> PairExamples:
        prompt, chosen, rejected = pair_parts(row)
        return PairExamples(self._sequence(prompt, chosen, number), self._sequence(prompt, rejected, number))

    def _sequence(self, prompt, answer, number: int) -> Example:
        if isinstance(answer, str):
            if self.eos_text and answer.endswith(self.eos_text):  # TRL appends EOS only where it is missing
                answer = answer[:-len(self.eos_text)]
            return self.examples.encode_text(prompt, answer)
        return self.examples.encode_chat(list(prompt) + list(answer), number, first_answer=len(prompt))
