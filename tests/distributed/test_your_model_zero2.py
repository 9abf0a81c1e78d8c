"""A model of your own in two stages under ZeRO-2 (real DeepSpeed on 2 CPU ranks): killed (-9) inside stage 2 and
resumed, its losses equal to the uninterrupted run's bit for bit; each stage's frozen weights exactly as the model
function built them from the seed (read from the stage-end checkpoints, whose module states ZeRO-2 holds whole)."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_ok
from test_your_model import MODEL, STAGES, args, whole_and_resumed


@pytest.fixture(scope="module")
def zero2(tmp_path_factory):
    return whole_and_resumed(tmp_path_factory.mktemp("your-model-zero2"),
                             args(STAGES[:2], "--ds_config", "ds_config.json", "--checkpoint_freq", "4",
                                  "--keep_last_checkpoints", "0", "--no-export"))


def test_zero2_resumes_inside_stage_2_exactly(zero2):
    whole, resumed = zero2
    assert_ok(whole)
    losses, again = whole.losses_by_step(), resumed.losses_by_step()
    assert sorted(losses) == list(range(1, 7))
    assert [again[s] for s in (5, 6)] == [losses[s] for s in (5, 6)]


def test_each_stage_updates_only_what_it_trains(zero2):
    """After stage 1 (the projector) only the projector moved; after stage 2 (projector and language model) the
    encoder is still as built."""
    from model_utils.data.tokenizer import load_tokenizer
    from model_utils.models.custom.contract import ModelSettings, build_user_model
    from model_utils.runtime.process import seed_everything

    whole, _ = zero2
    seed_everything(1234)
    built = dict(build_user_model(MODEL, ModelSettings(args={"width": 32, "heads": 2}, tokenizer=load_tokenizer(None),
                                                       seq_len=24, seed=1234)).named_parameters())

    def moved(step):
        state = torch.load(whole.checkpoint_dir / f"step-{step:08d}" / "mp_rank_00_model_states.pt",
                           map_location="cpu", weights_only=False)["module"]
        return {name.split(".")[0] for name, value in state.items()
                if name in built and not torch.equal(value.float(), built[name].detach())}

    assert moved(3) == {"projector"}
    assert moved(6) == {"projector", "decoder", "head"}
