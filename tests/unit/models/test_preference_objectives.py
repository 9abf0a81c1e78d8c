"""Preference tuning's log-probabilities and objectives against TRL 1.16's own code on the same tiny models and pairs:
the reference log-probabilities of DPOTrainer.compute_ref_log_probs, DPOTrainer's sigmoid and IPO losses with the
rewards and log-probabilities it logs, CPOTrainer's SimPO loss and ORPOTrainer's odds-ratio loss; and the chunked
log-probabilities against the full log-softmax, values and gradients."""

from __future__ import annotations

import copy

import pytest
import torch

from model_utils.config.preference import PreferenceSettings
from model_utils.config.preference import pair_block_len
from model_utils.data.preference.encode import PairEncoder
from model_utils.data.preference.packing import PackedPairs, pack_pairs
from model_utils.data.sft.formats import IGNORE_INDEX, attach_chat_template
from model_utils.data.tokenizer import load_tokenizer
from model_utils.models.preference import PairLogps, pair_terms, score_pairs, target_log_probs

MAX_LENGTH = 48
TEXT_ROWS = [{"prompt": f"Question {i}: what is {i} times three?\nAnswer:", "chosen": f" It is {3 * i}.",
              "rejected": f" It is {3 * i + 1}, I would say." + " Maybe." * (i % 3)} for i in range(5)]
TEXT_ROWS.append({"prompt": "Count to forty.\nAnswer:", "chosen": " " + " ".join(map(str, range(1, 41))),
                  "rejected": " No."})  # the chosen sequence is cut at MAX_LENGTH tokens
CHAT_ROWS = [{"prompt": [{"role": "user", "content": f"Name the number after {i}."}],
              "chosen": [{"role": "assistant", "content": f"{i + 1}."}],
              "rejected": [{"role": "assistant", "content": f"Surely {i + 2}, or {i + 3}."}]} for i in range(4)]


@pytest.fixture(scope="module")
def trl():
    """TRL's trainers (imported once: it takes seconds)."""
    return pytest.importorskip("trl")


@pytest.fixture(scope="module")
def tokenizer():
    tokenizer = load_tokenizer(None)
    attach_chat_template(tokenizer)  # the template both sides render with
    return tokenizer


def tiny_model(seed: int, vocab: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=-(-vocab // 64) * 64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)
    return Qwen3ForCausalLM(config).eval()


@pytest.fixture(scope="module")
def models(tokenizer):
    """(policy, reference): two random initialisations, so that the log-ratios are not zero."""
    return tiny_model(0, len(tokenizer)), tiny_model(1, len(tokenizer))


def ours(model, tokenizer, rows, chunk_tokens: int = 7) -> PairLogps:
    """Our scores of the rows' pairs, packed several to a block and chunked, in the rows' order."""
    encoder = PairEncoder(tokenizer)
    packed = pack_pairs([encoder.encode(row, n) for n, row in enumerate(rows, 1)], MAX_LENGTH, 0, len(tokenizer))
    data = PackedPairs(packed.inputs, packed.targets, packed.positions, packed.pair_offsets, pair_block_len(MAX_LENGTH))
    batch = data.batch(range(data.num_blocks))
    assert batch.pairs[:, 0].tolist() == list(range(len(rows)))
    with torch.no_grad():
        scores = score_pairs(model, model, {"input_ids": torch.from_numpy(batch.input_ids),
                                            "position_ids": torch.from_numpy(batch.position_ids)},
                             torch.from_numpy(batch.targets), torch.from_numpy(batch.segment_ids()), batch.segments,
                             torch.from_numpy(batch.pairs), chunk_tokens)
    in_rows = torch.from_numpy(packed.sources).argsort()  # pair numbers are in block order
    return PairLogps(*(getattr(scores, name)[in_rows] for name in
                       ("chosen", "rejected", "chosen_tokens", "rejected_tokens")))


@pytest.fixture(scope="module")
def dpo_trainer(trl, models, tokenizer, tmp_path_factory):
    """TRL's DPOTrainer on copies of the same two models and the text rows, on the CPU, not trained."""
    import datasets

    policy, reference = models
    args = trl.DPOConfig(output_dir=str(tmp_path_factory.mktemp("trl")), use_cpu=True, bf16=False, report_to="none",
                         max_length=MAX_LENGTH, beta=0.1, loss_type=["sigmoid"],
                         per_device_train_batch_size=len(TEXT_ROWS), dataset_num_proc=None)
    return trl.DPOTrainer(model=copy.deepcopy(policy), ref_model=copy.deepcopy(reference), args=args,
                          train_dataset=datasets.Dataset.from_list(TEXT_ROWS), processing_class=tokenizer)


def trl_batch(trainer, rows_ids: list[dict]) -> dict:
    return trainer.data_collator(rows_ids)


def our_ids(tokenizer, rows) -> list[dict]:
    """The rows as our encoding tokenizes them, in the prompt_ids / chosen_ids / rejected_ids TRL's collator takes:
    each answer up to its last token carrying loss."""
    encoder, out = PairEncoder(tokenizer), []
    for number, row in enumerate(rows, 1):
        pair = encoder.encode(row, number)
        answer = [[i for i, label in enumerate(e.labels) if label != IGNORE_INDEX] for e in (pair.chosen, pair.rejected)]
        start = answer[0][0]
        out.append({"prompt_ids": pair.chosen.ids[:start], "chosen_ids": pair.chosen.ids[start:answer[0][-1] + 1],
                    "rejected_ids": pair.rejected.ids[start:answer[1][-1] + 1]})
    return out


def test_text_pairs_tokenize_as_trl_tokenizes_them(dpo_trainer, tokenizer):
    theirs = [{k: row[k] for k in ("prompt_ids", "chosen_ids", "rejected_ids")} for row in dpo_trainer.train_dataset]
    assert theirs == our_ids(tokenizer, TEXT_ROWS)


def test_the_reference_log_probs_are_trls(dpo_trainer, models, tokenizer):
    """compute_ref_log_probs, TRL's path for its precomputed reference, on its own tokenization of the text rows
    (one cut at max_length) and on ours of the conversational rows: within 1e-3 relative of our packed, chunked
    scores (the text rows' pairs share blocks)."""
    _, reference = models
    encoder = PairEncoder(tokenizer)
    packed = pack_pairs([encoder.encode(row, n) for n, row in enumerate(TEXT_ROWS, 1)], MAX_LENGTH, 0, len(tokenizer))
    assert packed.stats.blocks < len(TEXT_ROWS) and packed.stats.truncated == 1
    for rows, ids in ((TEXT_ROWS, list(dpo_trainer.train_dataset)), (CHAT_ROWS, our_ids(tokenizer, CHAT_ROWS))):
        with torch.no_grad():
            chosen, rejected = dpo_trainer.compute_ref_log_probs(dpo_trainer.ref_model, trl_batch(dpo_trainer, ids))
        scores = ours(reference, tokenizer, rows)
        torch.testing.assert_close(scores.chosen, chosen.float(), rtol=1e-3, atol=0)
        torch.testing.assert_close(scores.rejected, rejected.float(), rtol=1e-3, atol=0)


def test_trls_conversational_completion_adds_only_the_templates_newline(dpo_trainer, tokenizer):
    """TRL's completion of a chat also holds what ChatML writes after the turn's end; our answer stops at it."""
    import datasets

    encoder = PairEncoder(tokenizer)
    prepared = dpo_trainer._prepare_dataset(datasets.Dataset.from_list(CHAT_ROWS), tokenizer, dpo_trainer.args, "chats")
    for row, ids in zip(prepared, our_ids(tokenizer, CHAT_ROWS)):
        assert row["prompt_ids"] == ids["prompt_ids"]
        for side in ("chosen_ids", "rejected_ids"):
            assert row[side][:len(ids[side])] == ids[side] and tokenizer.decode(row[side][len(ids[side]):]) == "\n"
    assert encoder.describe(True).startswith("preference pairs (conversational")


@pytest.mark.parametrize("objective", ["sigmoid", "ipo"])
def test_dpo_and_ipo_losses_and_logged_values_are_trls(dpo_trainer, models, tokenizer, objective):
    """DPOTrainer's own loss code (`_compute_loss`, the policy and reference models' forwards included) against
    ours on the same pairs: the loss, rewards/chosen, rewards/rejected, rewards/margins, rewards/accuracies,
    logps/chosen and logps/rejected."""
    policy, reference = models
    dpo_trainer.loss_types = [objective]
    mode = "train" if dpo_trainer.model.training else "eval"  # where TRL logs them
    dpo_trainer._metrics[mode].clear()
    with torch.no_grad():
        loss = dpo_trainer._compute_loss(dpo_trainer.model, trl_batch(dpo_trainer, list(dpo_trainer.train_dataset)),
                                         False)
    logged = {k: v[-1] for k, v in dpo_trainer._metrics[mode].items()}
    settings = PreferenceSettings("dpo" if objective == "sigmoid" else "ipo", 0.1)
    terms = pair_terms(settings, ours(policy, tokenizer, TEXT_ROWS), ours(reference, tokenizer, TEXT_ROWS))
    assert terms.loss.mean().item() == pytest.approx(loss.item(), rel=1e-4)
    mine = {"rewards/chosen": terms.chosen_rewards.mean(), "rewards/rejected": terms.rejected_rewards.mean(),
            "rewards/margins": (terms.chosen_rewards - terms.rejected_rewards).mean(),
            "rewards/accuracies": (terms.chosen_rewards > terms.rejected_rewards).float().mean(),
            "logps/chosen": terms.chosen_logps.mean(), "logps/rejected": terms.rejected_logps.mean()}
    for name, value in mine.items():
        assert value.item() == pytest.approx(logged[name], rel=1e-3, abs=1e-6), name
    assert 0 < logged["rewards/accuracies"] < 1  # two different models: some pairs each way


def test_simpo_and_orpo_are_trls_reference_free_losses(trl, models, tokenizer):
    """CPOTrainer.cpo_loss (loss_type simpo) and ORPOTrainer.odds_ratio_loss, TRL's own functions, on our mean
    log-probabilities per token; ORPO's NLL against the chosen answers' cross-entropy from the model's logits."""
    from types import SimpleNamespace

    from trl.experimental.cpo import CPOTrainer
    from trl.experimental.orpo import ORPOTrainer

    policy, _ = models
    scores = ours(policy, tokenizer, TEXT_ROWS)
    chosen, rejected = scores.chosen / scores.chosen_tokens, scores.rejected / scores.rejected_tokens
    device = SimpleNamespace(device="cpu")
    simpo = PreferenceSettings("simpo", 2.0, 0.5)
    losses, chosen_rewards, rejected_rewards = CPOTrainer.cpo_loss(SimpleNamespace(
        alpha=0.0, loss_type="simpo", simpo_gamma=0.5, beta=2.0, label_smoothing=0.0, accelerator=device),
        chosen, rejected)
    terms = pair_terms(simpo, scores, None)
    torch.testing.assert_close(terms.loss, losses, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(terms.chosen_rewards, chosen_rewards)
    torch.testing.assert_close(terms.rejected_rewards, rejected_rewards)
    odds, chosen_rewards, _, _, _ = ORPOTrainer.odds_ratio_loss(SimpleNamespace(beta=0.1, accelerator=device),
                                                                chosen, rejected)
    terms = pair_terms(PreferenceSettings("orpo", 0.1), scores, None)
    torch.testing.assert_close(terms.loss, -odds, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(terms.chosen_rewards, chosen_rewards)
    assert (terms.token_loss.sum() / scores.chosen_tokens.sum()).item() == pytest.approx(
        chosen_nll(policy, tokenizer, TEXT_ROWS), rel=1e-4)


def chosen_nll(model, tokenizer, rows) -> float:
    """The mean cross-entropy of the chosen answers' tokens, from the model's full logits, one row at a time."""
    encoder, total, count = PairEncoder(tokenizer), 0.0, 0
    for number, row in enumerate(rows, 1):
        example = encoder.encode(row, number).chosen
        kept = min(len(example.ids), MAX_LENGTH)  # keep_start
        labels = torch.tensor(example.labels[1:kept])
        with torch.no_grad():
            logits = model(torch.tensor([example.ids[:kept - 1]])).logits[0]
        total += torch.nn.functional.cross_entropy(logits, labels, reduction="sum").item()
        count += int((labels != IGNORE_INDEX).sum())
    return total / count


def test_chunked_log_probs_and_their_gradients_equal_the_full_log_softmax(models):
    """The chunks, recomputed in the backward pass, give the full log-softmax's values and gradients."""
    policy, _ = models
    head = policy.get_output_embeddings()
    torch.manual_seed(2)
    hidden = torch.randn(2, 9, head.in_features, requires_grad=True)
    targets = torch.randint(0, head.out_features, (2, 9))
    targets[0, :3] = IGNORE_INDEX
    weights = torch.randn(2, 9)
    full = torch.log_softmax(head(hidden).float(), -1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    full = full * (targets != IGNORE_INDEX)
    (full * weights).sum().backward()
    expected = hidden.grad.clone(), head.weight.grad.clone()
    hidden.grad, head.weight.grad = None, None
    chunked = target_log_probs(head, hidden, targets, chunk_tokens=4)
    (chunked * weights).sum().backward()
    torch.testing.assert_close(chunked, full, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(hidden.grad, expected[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(head.weight.grad, expected[1], rtol=1e-5, atol=1e-6)
    head.weight.grad = None
