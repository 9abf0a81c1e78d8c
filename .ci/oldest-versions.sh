#!/usr/bin/env bash
# The oldest versions pyproject.toml allows: a virtual environment with the floor of each dependency installed exactly,
# the qlora extra's too, then the main job (./train-singlenode.sh, shortened), the exact-resume test, the op build lock
# tests (the floor of torch locks its op builds the older way) and the fine-tuning blocks (chat templates, LoRA through
# peft, QLoRA's 4-bit base through bitsandbytes) on it. FLOORS_ONLY=1 prints the pins and stops.
set -euo pipefail
cd "$(dirname "$0")/.."

: "${OLDEST_VENV:=/tmp/dslm-oldest-venv}"
: "${OLDEST_MAX_STEPS:=60}"
: "${FLOORS_ONLY:=0}"
: "${OLDEST_PINS:=}" # space-separated NAME==VERSION pins instead of pyproject's floors (to try candidate floors)

floors() {
    if [[ -n $OLDEST_PINS ]]; then
        tr ' ' '\n' <<<"$OLDEST_PINS"
        return
    fi
    python3 - <<'PY'
import re, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
deps = project["dependencies"] + project["optional-dependencies"]["qlora"]
for dep in deps:
    m = re.match(r"^\s*([A-Za-z0-9_.-]+)\s*>=\s*([\w.]+)", dep)
    if m:
        print(f"{m.group(1)}=={m.group(2)}")
PY
}
mapfile -t pins < <(floors)
echo "oldest-versions: ${pins[*]}"
[[ $FLOORS_ONLY == 1 ]] && exit 0

rm -rf "$OLDEST_VENV"
python3 -m venv "$OLDEST_VENV"
py=$OLDEST_VENV/bin/python
"$py" -m pip install --quiet --upgrade pip
torch_pin=""
ds_pin=""
other=()
for pin in "${pins[@]}"; do
    case $pin in
        torch==*) torch_pin=$pin ;;
        deepspeed==*) ds_pin=$pin ;;
        *) other+=("$pin") ;;
    esac
done
"$py" -m pip install --quiet "$torch_pin" setuptools wheel ninja
# DeepSpeed's sdist builds against the torch above, not in an isolated environment that would install the newest.
"$py" -m pip install --quiet --no-build-isolation "$ds_pin"
# The project at its floors with the test runner; not the test extra, whose benchmark peer (trl) needs a newer
# datasets than the floor: the tests below need none of the extra's tools.
"$py" -m pip install --quiet -e . "$torch_pin" "${other[@]}" "$ds_pin" "pytest>=8" "pytest-timeout>=2.3" "pytest-xdist>=3.5"
"$py" .ci/versions.py "oldest versions"

# The main job as README's first command runs it, on this environment, with its own checkpoint directory.
ckpt=$(mktemp -d)
PYTHON=$py CHECKPOINT_DIR=$ckpt MAX_STEPS=$OLDEST_MAX_STEPS ./train-singlenode.sh --generate_prompt "Return the"
test -f "$ckpt/hf/model.safetensors"
rm -rf "$ckpt"
# One test session (each session builds DeepSpeed's ops once, in its own extensions folder).
training=tests/distributed/test_training.py
"$py" -m pytest -q "$training::test_loss_falls_and_metrics_are_complete" \
    "$training::test_export_loads_with_from_pretrained_and_generates" "$training::test_resume_after_kill_9_is_exact" \
    "$training::test_resume_after_kill_9_restores_every_ranks_rng" tests/unit/runtime/test_build_locks.py \
    tests/unit/models/test_lora.py tests/unit/models/test_quantization.py tests/unit/data/sft/test_sft_data.py \
    tests/unit/config/test_fine_tuning_schedule.py
