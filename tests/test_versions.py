"""Private-API uses are gated on the versions they were tested with (model_utils.versions); outside them the library's
public path runs and the log says why."""

from __future__ import annotations

import pytest

from model_utils import versions
from model_utils.versions import DEEPSPEED_ZERO_STEP, FA4_INTERNALS, LIGER_INTERNALS, gate, within


@pytest.mark.parametrize("version, inside", [("0.19.6", True), ("0.19.8", True), ("0.19.5", False),
                                             ("0.19.9", False), ("0.18.0", False), ("0.20.0rc1", False)])
def test_deepspeed_range(version, inside):
    assert within(version, DEEPSPEED_ZERO_STEP.oldest, DEEPSPEED_ZERO_STEP.newest) is inside


def test_pre_releases_and_local_versions_compare_as_releases():
    assert within("4.0.0b36", FA4_INTERNALS.oldest, FA4_INTERNALS.newest)
    assert not within("4.0.0b37", FA4_INTERNALS.oldest, FA4_INTERNALS.newest)
    assert not within("4.0.0", FA4_INTERNALS.oldest, FA4_INTERNALS.newest)
    assert within("2.11.0+cu130", "2.11", "2.13") and not within("2.10.1", "2.11", "2.13")


def test_outside_the_range_the_gate_closes_and_says_so(monkeypatch):
    said = []
    monkeypatch.setattr(versions, "installed", lambda name: {"deepspeed": "0.18.0"}.get(name))
    assert gate(DEEPSPEED_ZERO_STEP, said.append) is False
    assert "deepspeed 0.18.0 is outside 0.19.6-0.19.8" in said[0] and "public path" in said[0]
    assert gate(LIGER_INTERNALS, said.append) is False and "liger-kernel not installed" in said[1]


def test_an_untested_deepspeed_takes_its_own_zero_step(monkeypatch):
    """The ZeRO-1/2 step is left exactly as DeepSpeed wrote it: nothing of the optimizer is replaced."""
    from model_utils import fast
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    class Engine:
        optimizer = DeepSpeedZeroOptimizer.__new__(DeepSpeedZeroOptimizer)

    said = []
    monkeypatch.setattr(versions, "installed", lambda name: "0.20.0")
    monkeypatch.setattr(fast, "installed", lambda name: "0.20.0")
    assert fast.streamline_zero_step(Engine(), said.append) is False
    assert vars(Engine.optimizer) == {} and "outside 0.19.6-0.19.8" in said[0]
