"""Fine-tuning data: formats and their errors, the loss on the answers only, packing examples that never see each
other, and the cache the loop opens."""

from __future__ import annotations

import json

import numpy as np
import pytest

from model_utils.data.errors import DataError
from model_utils.data.sft.cache import SFTSettings, build_sft_files, open_sft
from model_utils.data.sft.encode import Example, ExampleEncoder, encode_rows
from model_utils.data.sft.formats import (DEFAULT_CHAT_TEMPLATE, GENERATION_BLOCK, IGNORE_INDEX, check_row,
                                          detect_format, resolve_chat_template)
from model_utils.data.sft.packing import PackedExamples, best_fit_blocks, pack_examples
from model_utils.data.tokenizer import load_tokenizer

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "Four."}, {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "Six, of course."}]
# The default template without its {% generation %} marks: answers are found by rendering turn by turn.
UNMARKED_TEMPLATE = GENERATION_BLOCK.sub("", DEFAULT_CHAT_TEMPLATE).replace("{% endgeneration %}", "")
# Like Qwen3's: the last assistant turn opens with an (empty) thinking block, earlier ones do not, so a turn renders
# differently once later turns follow.
THINKING_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['role'] == 'assistant' and loop.last %}<think>\n\n</think>\n\n{% endif %}"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Reorders the conversation (the last message first): no prompt is a prefix of the whole.
REORDERING_TEMPLATE = ("{% for message in messages|reverse %}{{ message['role'] }}: {{ message['content'] }}\n"
                       "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


def loss_text(tokenizer, example: Example) -> str:
    return tokenizer.decode([i for i, label in zip(example.ids, example.labels) if label != IGNORE_INDEX])


# ---- formats --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("columns, expected", [
    (["messages"], "chat"), (["conversations", "id"], "sharegpt"), (["prompt", "completion"], "prompt_completion"),
    (["instruction", "input", "output"], "alpaca"), (["input_ids", "labels"], "tokens"), (["text"], "text"),
    (["text", "messages", "id"], "chat"),  # a rendered copy beside the messages: the messages win
])
def test_the_format_comes_from_the_columns(columns, expected):
    assert detect_format(columns, "auto", "data.jsonl") == expected


def test_columns_of_no_format_name_the_file_the_columns_and_the_formats():
    with pytest.raises(DataError) as error:
        detect_format(["question", "answer"], "auto", "qa.jsonl")
    problem = error.value.problem
    assert problem.value == "qa.jsonl" and "question, answer" in problem.message
    assert "prompt + completion" in problem.fix and "--data_format" in problem.fix


def test_a_requested_format_needs_its_columns():
    assert detect_format(["text", "messages"], "text", "d.jsonl") == "text"
    with pytest.raises(DataError, match="no column completion for --data_format prompt_completion"):
        detect_format(["prompt", "text"], "prompt_completion", "d.jsonl")
    with pytest.raises(DataError, match="--data_format = oasst"):
        detect_format(["messages"], "oasst", "d.jsonl")
    with pytest.raises(DataError, match="no column conversations for --data_format sharegpt"):
        detect_format(["messages"], "sharegpt", "d.jsonl")


def test_a_row_of_another_format_names_the_row_and_its_columns(tokenizer):
    # datasets unifies JSONL columns: rows of a mixed file hold None in the other format's columns
    rows = [{"messages": CHAT, "prompt": None, "completion": None}] * 2 + [
        {"messages": None, "prompt": "Say hi", "completion": "hi"}]
    encoder = ExampleEncoder(tokenizer, "chat", source="mixed.jsonl")
    with pytest.raises(DataError) as error:
        list(encode_rows(rows, encoder))
    problem = error.value.problem
    assert problem.value == "mixed.jsonl, row 3"
    assert "is prompt_completion" in problem.message and "columns with values: prompt, completion" in problem.message
    assert "one format per dataset" in problem.fix


@pytest.mark.parametrize("fmt, row, message", [
    ("chat", {"messages": [{"role": "user", "content": "hi"}]}, "no assistant message"),
    ("chat", {"messages": [{"role": "user", "text": "hi"}]}, "not a list of {role, content}"),
    ("prompt_completion", {"prompt": "a", "completion": [{"role": "assistant", "content": "b"}]}, "not both strings"),
    ("tokens", {"input_ids": [1, 2, 3], "labels": [1, 2]}, "3 ids, 2 labels"),
    ("text", {"text": 7}, "`text` is int"),
    ("sharegpt", {"conversations": [{"from": "human", "value": "hi"}]}, "no gpt turn"),
    ("sharegpt", {"conversations": [{"role": "user", "content": "hi"}]}, "not a list of {from, value}"),
    ("sharegpt", {"conversations": [{"from": "human", "value": "hi"}, {"from": "bot", "value": "yo"}]},
     "speakers ShareGPT does not name: bot"),
])
def test_bad_values_in_a_row_are_named(fmt, row, message):
    with pytest.raises(DataError, match=message) as error:
        check_row(row, fmt, 5, "d.jsonl")
    assert error.value.problem.value == "d.jsonl, row 5"


# ---- the loss on the answers ------------------------------------------------------------------------------------------
def test_a_tokenizer_without_a_chat_template_gets_the_default_and_says_so(tokenizer):
    assert resolve_chat_template(tokenizer) == (DEFAULT_CHAT_TEMPLATE, True)
    assert "default ChatML-like template" in ExampleEncoder(tokenizer, "chat").describe()


@pytest.mark.parametrize("template", [None, UNMARKED_TEMPLATE], ids=["generation-mask", "turn-by-turn"])
def test_only_the_assistant_answers_carry_loss(tokenizer, template):
    encoder = ExampleEncoder(tokenizer, "chat", chat_template=template)
    assert encoder.marks_generation == (template is None)
    example = encoder.encode({"messages": CHAT}, 1)
    eos = tokenizer.eos_token
    assert loss_text(tokenizer, example) == f"Four.{eos}Six, of course.{eos}"
    assert tokenizer.decode(example.ids).startswith("<|im_start|>system\nBe brief.")


def test_both_ways_of_finding_answers_agree_token_for_token(tokenizer):
    marked = ExampleEncoder(tokenizer, "chat").encode({"messages": CHAT}, 1)
    rendered = ExampleEncoder(tokenizer, "chat", chat_template=UNMARKED_TEMPLATE).encode({"messages": CHAT}, 1)
    assert marked.ids == rendered.ids and marked.labels == rendered.labels


def test_train_on_prompts_puts_loss_on_every_token(tokenizer):
    example = ExampleEncoder(tokenizer, "chat", train_on_prompts=True).encode({"messages": CHAT}, 1)
    assert example.labels == example.ids


def test_a_turn_rendered_differently_once_later_turns_follow_is_still_found(tokenizer):
    example = ExampleEncoder(tokenizer, "chat", chat_template=THINKING_TEMPLATE).encode({"messages": CHAT}, 1)
    assert loss_text(tokenizer, example) == "Four.<|im_end|><think>\n\n</think>\n\nSix, of course.<|im_end|>"


def test_a_template_that_hides_where_answers_are_is_a_problem(tokenizer):
    encoder = ExampleEncoder(tokenizer, "chat", chat_template=REORDERING_TEMPLATE, source="c.jsonl")
    with pytest.raises(DataError, match="cannot be located") as error:
        encoder.encode({"messages": CHAT}, 4)
    assert error.value.problem.value == "c.jsonl, row 4" and "--train_on_prompts" in error.value.problem.fix


def test_prompt_and_completion_text_loss_on_the_completion_and_eos(tokenizer):
    example = ExampleEncoder(tokenizer, "prompt_completion").encode({"prompt": "Capital of France?",
                                                                     "completion": " Paris."}, 1)
    prompt_ids = tokenizer("Capital of France?", add_special_tokens=False)["input_ids"]
    assert example.ids[:len(prompt_ids)] == prompt_ids and example.ids[-1] == tokenizer.eos_token_id
    assert example.labels[:len(prompt_ids)] == [IGNORE_INDEX] * len(prompt_ids)
    assert loss_text(tokenizer, example) == f" Paris.{tokenizer.eos_token}"


def test_conversational_prompt_completion_keeps_the_prompts_answers_out_of_the_loss(tokenizer):
    row = {"prompt": CHAT[:4], "completion": [{"role": "assistant", "content": "Six."}]}
    example = ExampleEncoder(tokenizer, "prompt_completion").encode(row, 1)
    assert loss_text(tokenizer, example) == f"Six.{tokenizer.eos_token}"  # not the few-shot "Four."


def test_sharegpt_rows_are_the_chats_they_name(tokenizer):
    """ShareGPT's {from, value} turns encode token for token as the chat of {role, content} they stand for: system,
    human -> user, gpt -> assistant, the loss on the gpt turns."""
    speakers = {"system": "system", "user": "human", "assistant": "gpt"}
    row = {"conversations": [{"from": speakers[m["role"]], "value": m["content"]} for m in CHAT]}
    check_row(row, "sharegpt", 1, "share.jsonl")
    shared = ExampleEncoder(tokenizer, "sharegpt").encode(row, 1)
    chat = ExampleEncoder(tokenizer, "chat").encode({"messages": CHAT}, 1)
    assert (shared.ids, shared.labels) == (chat.ids, chat.labels)
    assert loss_text(tokenizer, shared) == f"Four.{tokenizer.eos_token}Six, of course.{tokenizer.eos_token}"


def test_alpaca_rows_become_a_user_and_an_assistant_turn(tokenizer):
    example = ExampleEncoder(tokenizer, "alpaca").encode(
        {"instruction": "Translate to French.", "input": "cat", "output": "chat"}, 1)
    assert "<|im_start|>user\nTranslate to French.\n\ncat" in tokenizer.decode(example.ids)
    assert loss_text(tokenizer, example) == f"chat{tokenizer.eos_token}"


def test_pre_tokenized_rows_keep_their_labels_unless_training_on_prompts(tokenizer):
    row = {"input_ids": [5, 6, 7, 8], "labels": [IGNORE_INDEX, IGNORE_INDEX, 7, 8]}
    assert ExampleEncoder(tokenizer, "tokens").encode(row, 1).labels == row["labels"]
    assert ExampleEncoder(tokenizer, "tokens", train_on_prompts=True).encode(row, 1).labels == row["input_ids"]
    assert ExampleEncoder(tokenizer, "tokens").encode({"input_ids": [5, 6]}, 1).labels == [5, 6]


def test_plain_text_carries_loss_everywhere_and_ends_with_eos(tokenizer):
    example = ExampleEncoder(tokenizer, "text").encode({"text": "Hello world"}, 1)
    assert example.labels == example.ids and example.ids[-1] == tokenizer.eos_token_id


# ---- packing ----------------------------------------------------------------------------------------------------------
def test_best_fit_places_every_example_once_and_within_a_block():
    lengths = [7, 3, 5, 1, 8, 2, 2, 4]
    blocks = best_fit_blocks(lengths, 8)
    assert sorted(i for b in blocks for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 8 for b in blocks)
    assert len(blocks) == 4  # 32 tokens in 4 full blocks of 8
    assert blocks == best_fit_blocks(lengths, 8)


def test_packed_blocks_hold_shifted_targets_and_positions_restarting_per_example():
    examples = [Example([10, 11, 12], [IGNORE_INDEX, 11, 12]), Example([20, 21, 22, 23], [20, 21, 22, 23])]
    packed = pack_examples(examples, seq_len=8, pad_id=0, vocab_size=100)
    assert packed.inputs.tolist() == [10, 11, 20, 21, 22, 0, 0, 0]
    assert packed.targets.tolist() == [11, 12, 21, 22, 23, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX]
    assert packed.positions.tolist() == [0, 1, 0, 1, 2, 0, 1, 2]  # the padding is a segment of its own
    stats = packed.stats
    assert (stats.examples, stats.tokens, stats.loss_tokens, stats.blocks) == (2, 5, 5, 1)
    assert stats.padding_share == pytest.approx(3 / 8)


def test_long_examples_are_truncated_and_examples_without_loss_dropped_both_counted():
    long = Example(list(range(1, 21)), list(range(1, 21)))
    prompt_only_after_cut = Example(list(range(1, 21)), [IGNORE_INDEX] * 12 + list(range(13, 21)))
    packed = pack_examples([long, prompt_only_after_cut, Example([5], [5])], seq_len=8, pad_id=0, vocab_size=100)
    assert packed.stats.truncated == 1 and packed.stats.dropped == 2 and packed.stats.examples == 1
    assert packed.inputs.tolist() == list(range(1, 9)) and packed.targets.tolist() == list(range(2, 10))
    assert "1 truncated to 9 tokens, 2 dropped without loss" in packed.stats.describe()


def test_an_example_packed_with_others_has_the_logits_and_loss_it_has_alone(tokenizer):
    """Positions restarting per example are what keep examples apart (transformers' mask from position ids)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, initializer_range=0.2)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    encoder = ExampleEncoder(tokenizer, "chat")
    examples = [encoder.encode({"messages": CHAT[1:3]}, 1), encoder.encode({"messages": CHAT}, 2)]
    seq_len = 128
    packed = pack_examples(examples, seq_len, tokenizer.pad_token_id, len(tokenizer))
    assert packed.stats.blocks == 1
    together = PackedExamples(packed.inputs, packed.targets, packed.positions, seq_len).batch([0])

    def run(arrays):
        with torch.no_grad():
            return model(**{k: torch.from_numpy(v) for k, v in arrays.items()}, use_cache=False)

    loss_sum, logits_alone = 0.0, []
    for example in examples:
        one = pack_examples([example], seq_len, tokenizer.pad_token_id, len(tokenizer))
        alone = PackedExamples(one.inputs, one.targets, one.positions, seq_len).batch([0])
        output = run(alone.model_arrays())
        loss_sum += output.loss.item() * alone.loss_tokens
        logits_alone.append(output.logits[0, :len(example.ids) - 1])
    output = run(together.model_arrays())
    assert output.loss.item() == pytest.approx(loss_sum / together.loss_tokens, rel=1e-5)
    first = len(examples[0].ids) - 1  # the block holds the examples in their order
    second = output.logits[0, first:first + len(examples[1].ids) - 1]
    torch.testing.assert_close(second, logits_alone[1], rtol=1e-4, atol=1e-4)
    # without the restarting positions the second example attends to the first
    crossing = run(dict(together.model_arrays(), position_ids=np.arange(seq_len)[None]))
    assert (crossing.logits[0, first:first + len(examples[1].ids) - 1] - logits_alone[1]).abs().max() > 1e-2


def test_model_arrays_give_flashattention_the_examples_boundaries():
    positions = np.array([[0, 1, 2, 0, 1, 0, 1, 2]])
    batch = PackedExamples(np.arange(8), np.arange(8), positions.reshape(-1), 8).batch([0])
    arrays = batch.model_arrays(document_boundaries=True)
    assert arrays["cu_seq_lens_q"].tolist() == [0, 3, 5, 8] and arrays["max_length_q"] == 8
    assert "cu_seq_lens_q" not in batch.model_arrays()


# ---- the cache --------------------------------------------------------------------------------------------------------
def test_a_jsonl_file_is_packed_into_the_cache_and_opened_as_packed_data(tokenizer, tmp_path):
    import datasets

    data = tmp_path / "chat.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"Count to {n}."},
                          {"role": "assistant", "content": " ".join(str(i) for i in range(1, n + 1))}]}
            for n in range(1, 41)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    train = datasets.load_dataset("json", data_files=str(data), split="train", cache_dir=str(tmp_path / "hf"))
    settings = SFTSettings(seq_len=64, validation_fraction=0.25)
    logged = []
    meta = build_sft_files({"train": train, "validation": None}, tokenizer, settings, tmp_path / "cache",
                           str(data), logged.append)
    assert meta["splits"]["train"]["stats"]["examples"] == 40
    packed = open_sft(tmp_path / "cache", settings.validation_fraction)
    assert len(packed.train_ids) + len(packed.val_ids) == packed.train.num_blocks
    assert len(packed.val_ids) == round(packed.train.num_blocks * 0.25)
    assert "fine-tuning data (chat, default ChatML-like template" in packed.description
    assert "40 examples" in packed.description and "% with loss" in packed.description
    batch = packed.train.batch(packed.train_ids[:2])
    assert batch.input_ids.shape == (2, 64) and batch.loss_tokens > 0
    assert set(batch.position_ids[:, 0].tolist()) == {0}


def test_a_sharegpt_file_packs_into_the_blocks_of_its_chats(tokenizer, tmp_path):
    """A ShareGPT JSONL file, its format found from the columns, packs into the same blocks (ids, targets, positions)
    as the same conversations written as messages."""
    from model_utils.config.settings import DataConfig
    from model_utils.data.sft.cache import ensure_sft_cache

    chats = [[{"role": "system", "content": "Count."}, {"role": "user", "content": f"Count to {n}."},
              {"role": "assistant", "content": " ".join(str(i) for i in range(1, n + 1))}] for n in range(1, 31)]
    speakers = {"system": "system", "user": "human", "assistant": "gpt"}
    (tmp_path / "share.jsonl").write_text("".join(json.dumps(
        {"id": n, "conversations": [{"from": speakers[m["role"]], "value": m["content"]} for m in chat]}) + "\n"
        for n, chat in enumerate(chats)))
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps({"messages": chat}) + "\n" for chat in chats))
    packed = {}
    for name in ("share", "chat"):
        cfg = DataConfig(dataset=str(tmp_path / f"{name}.jsonl"), data_cache_dir=str(tmp_path / "cache"))
        packed[name] = open_sft(ensure_sft_cache(cfg, tokenizer, SFTSettings(seq_len=64), log=lambda *_: None))
    assert "fine-tuning data (sharegpt" in packed["share"].description
    share, chat = (packed[name].train.batch(np.arange(packed[name].train.num_blocks)) for name in ("share", "chat"))
    assert share.loss_tokens == chat.loss_tokens > 0
    for field in ("input_ids", "targets", "position_ids"):
        np.testing.assert_array_equal(getattr(share, field), getattr(chat, field))


def test_the_cache_entry_is_built_once_per_dataset_and_settings(tokenizer, tmp_path):
    from model_utils.config.settings import DataConfig
    from model_utils.data.sft.cache import ensure_sft_cache

    data = tmp_path / "pc.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{n} + {n} =", "completion": f" {2 * n}"}) + "\n"
                            for n in range(30)))
    cfg = DataConfig(dataset=str(data), data_cache_dir=str(tmp_path / "cache"))
    built = []
    first = ensure_sft_cache(cfg, tokenizer, SFTSettings(seq_len=32), log=built.append)
    again = ensure_sft_cache(cfg, tokenizer, SFTSettings(seq_len=32), log=built.append)
    on_prompts = ensure_sft_cache(cfg, tokenizer, SFTSettings(seq_len=32, train_on_prompts=True), log=built.append)
    assert first == again != on_prompts and len(built) == 2
    share = [train_stats(d).loss_share for d in (first, on_prompts)]
    assert share[0] < share[1] == 1.0


def train_stats(cache):
    from model_utils.data.sft.packing import PackingStats

    return PackingStats(**json.loads((cache / "meta.json").read_text())["splits"]["train"]["stats"])


def test_a_bad_row_in_any_split_stops_before_anything_is_tokenized_or_written(tokenizer, tmp_path):
    train = [{"messages": CHAT}] * 3
    validation = [{"messages": CHAT}, {"messages": [{"role": "user", "content": "no answer"}]}]
    with pytest.raises(DataError) as error:
        build_sft_files({"train": train, "validation": validation}, tokenizer, SFTSettings(seq_len=64),
                        tmp_path / "cache", "chats.jsonl")
    assert error.value.problem.value == "chats.jsonl (validation split), row 2"
    assert not (tmp_path / "cache").exists()


def test_an_export_carries_the_default_template_its_chats_were_rendered_with(tmp_path):
    from transformers import AutoTokenizer

    from model_utils.data.sft.formats import attach_chat_template

    fresh = load_tokenizer(None)
    assert attach_chat_template(fresh) and not attach_chat_template(fresh)  # once: then it is the tokenizer's own
    fresh.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    assert reloaded.chat_template == DEFAULT_CHAT_TEMPLATE
    assert ExampleEncoder(reloaded, "chat").encode({"messages": CHAT}, 1).ids == \
        ExampleEncoder(load_tokenizer(None), "chat").encode({"messages": CHAT}, 1).ids


def test_rows_encode_alike_in_worker_processes(tokenizer, monkeypatch):
    """encode_all with 2 spawned workers (the threshold lowered so a few rows use them) gives the Examples one process
    gives, in row order, from a list and from a datasets.Dataset."""
    import datasets

    from model_utils.data.sft import encode

    rows = [{"messages": [{"role": "user", "content": f"What is {a} times {b}?"},
                          {"role": "assistant", "content": f"{a} times {b} is {a * b}." * (1 + a % 3)}]}
            for a in range(40) for b in range(3)]
    encoder = ExampleEncoder(tokenizer, "chat")
    alone = list(encode.encode_all(rows, encoder, workers=2))  # below the threshold: this process
    monkeypatch.setattr(encode, "PARALLEL_MIN_ROWS", 0)
    monkeypatch.setattr(encode, "CHUNK_MIN_ROWS", 7)  # many chunks from few rows, the last one short
    assert list(encode.encode_all(rows, encoder, workers=2)) == alone
    assert list(encode.encode_all(datasets.Dataset.from_list(rows), encoder, workers=2)) == alone
    assert len({tuple(e.ids) for e in alone}) == len(rows)  # distinct rows: the order is checked
