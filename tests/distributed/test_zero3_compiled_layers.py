"""Compiled decoder layers under real DeepSpeed ZeRO-3 on 2 CPU ranks (zero3_layers_run.py): each layer becomes a
ZeRO-3 leaf module whose parameters the layer's own hooks gather, outside one compiled graph shared by the layers,
and training matches the eager layers' (hooks on every submodule) step for step, also with LoRA's adapters.
The trainer compiles on GPUs only; here the same graphs run on Dynamo's aot_eager backend."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import preloaded
from conftest import REPO, rank_environment, rendezvous_port

SCRIPT = Path(__file__).with_name("zero3_layers_run.py")


def run(work: Path, mode: str) -> dict:
    port = rendezvous_port()
    logs = [work / f"{mode}-rank{r}.log" for r in range(2)]
    procs = [preloaded.Popen([sys.executable, str(SCRIPT), str(work), mode], cwd=REPO,
                             env=rank_environment(r, 2, port), stdout=open(logs[r], "w"), stderr=subprocess.STDOUT)
             for r in range(2)]
    codes = [p.wait(timeout=600) for p in procs]
    assert codes == [0, 0], "\n----\n".join(log.read_text()[-4000:] for log in logs)
    return json.loads((work / f"{mode}.json").read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    work = tmp_path_factory.mktemp("zero3-layers")
    return {mode: run(work, mode) for mode in ("eager", "compiled", "compiled-checkpointed", "compiled-whole")}


@pytest.mark.parametrize("mode", ["compiled", "compiled-checkpointed", "compiled-whole"])
def test_compiled_layers_train_as_the_eager_ones(runs, mode):
    """Also with each layer recomputed in the backward pass (--gradient_checkpointing: its hooks gather it again)."""
    eager, compiled = runs["eager"], runs[mode]
    assert compiled["losses"] == pytest.approx(eager["losses"], rel=1e-5)
    assert compiled["weights"].keys() == eager["weights"].keys()
    for name, total in eager["weights"].items():
        assert compiled["weights"][name] == pytest.approx(total, rel=1e-4, abs=1e-4), name
    assert eager["losses"][-1] != eager["losses"][0]  # the steps trained


@pytest.mark.parametrize("mode", ["compiled", "compiled-checkpointed", "compiled-whole"])
def test_each_layer_is_gathered_whole_by_its_own_hooks(runs, mode):
    eager, compiled = runs["eager"], runs[mode]
    assert not eager["layer_is_leaf"] and eager["hooked_projection"] and eager["graphs"] == 0
    assert compiled["layer_is_leaf"] and not compiled["hooked_projection"]
    assert compiled["graphs"] == 1  # one graph for every layer, no break at a hook


def test_whole_parameters_are_never_released(runs):
    """Every parameter persistent (what "auto" persistence chooses where whole parameters fit the GPU): nothing is
    released after a backward once the first step has run, so nothing is gathered again for the next micro-batch;
    partitioned, every parameter is (the threshold 0: the norms too)."""
    whole, partitioned = runs["compiled-whole"], runs["compiled"]
    assert whole["released"] == []
    assert len(partitioned["released"]) == partitioned["parameters"]
