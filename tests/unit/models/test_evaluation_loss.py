"""The validation loss is the model's own loss, computed without the full-vocabulary logits (model_utils.models.evaluation)."""

from __future__ import annotations

import pytest
import torch

from model_utils.models import evaluation
from model_utils.models.evaluation import evaluation_loss


class Engine:
    """Stands in for DeepSpeed's engine, whose forward is the module's (no DeepSpeed process group needed here)."""

    def __init__(self, model):
        self.model = model

    def __call__(self, **kw):
        return self.model(**kw)


def tiny(model_type: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    extra = {"final_logit_softcapping": 0.1} if model_type == "gemma2" else {}
    config = AutoConfig.for_model(model_type, vocab_size=512, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                  max_position_embeddings=256, **extra)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()


def batch(rows=3, length=40, vocab=512):
    """Rows with different numbers of targets that carry loss (-100 masks a prompt of 10, of 30, and none): a mean of
    the rows' means would differ from the mean over the batch's targets."""
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (rows, length + 1), generator=g)
    inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()  # as the trainer makes them
    for row, prompt in zip(targets, (10, 30, 0)):
        row[:prompt] = -100
    return {"input_ids": inputs, "labels": targets, "shift_labels": targets}


@pytest.mark.parametrize("model_type", ["qwen3", "llama"])
def test_chunked_loss_equals_the_models_own_loss_without_its_logits(model_type, monkeypatch):
    model = tiny(model_type)
    b = batch()
    with torch.no_grad():
        own = model(**b).loss.double()
        seen = []
        monkeypatch.setattr(evaluation, "CHUNK_TOKENS", 16)  # several chunks, the last one partial (120 tokens)
        original = evaluation.chunked_cross_entropy

        def spy(head, hidden, targets, chunk_tokens=16):
            seen.append(hidden.shape)
            return original(head, hidden, targets, 16)

        monkeypatch.setattr(evaluation, "chunked_cross_entropy", spy)
        logits_shapes = []
        handle = model.get_output_embeddings().register_forward_hook(lambda m, a, out: logits_shapes.append(out.shape))
        summed, count = evaluation_loss(Engine(model), model, b)
        handle.remove()
    assert seen == [torch.Size([3, 40, 64])]  # the chunked path ran on the final hidden states
    assert logits_shapes[0] == torch.Size([3, 1, 512])  # the model's own pass made logits for one position only
    assert max(s[0] for s in logits_shapes[1:]) <= 16  # and each chunk's logits cover at most 16 tokens
    assert count == 10 + 30 + 40
    torch.testing.assert_close(summed / count, own, rtol=1e-6, atol=1e-6)


def test_a_model_that_post_processes_its_logits_gets_its_own_loss():
    """Gemma 2 softcaps its logits after the LM head: the one-position check sees it and the batch goes through the
    model's own loss, one sequence at a time, each row's mean weighed by its targets that carry loss."""
    model = tiny("gemma2")
    b = batch()
    with torch.no_grad():
        own = model(**b).loss.double()
        summed, count = evaluation_loss(Engine(model), model, b)
        plain = evaluation.chunked_cross_entropy(model.get_output_embeddings(),
                                                 model.model(input_ids=b["input_ids"]).last_hidden_state, b["labels"])
    assert not torch.allclose(plain, own, atol=1e-3)  # the check has something to catch
    torch.testing.assert_close(summed / count, own, rtol=1e-5, atol=1e-5)  # the rows weighed by their targets


def test_a_micro_batch_without_targets_that_carry_loss_adds_nothing():
    """A micro-batch of prompts only (every target -100) has no mean loss; it adds 0 to the sum and 0 to the count."""
    model = tiny("llama")
    b = batch()
    b["labels"][:] = -100
    with torch.no_grad():
        summed, count = evaluation_loss(Engine(model), model, b)
    assert (summed.item(), count.item()) == (0.0, 0.0)
