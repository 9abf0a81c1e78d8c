#!/usr/bin/env bash
# The oldest versions pyproject.toml allows: a virtual environment with the floor of each dependency installed exactly
# (torch aside: the CPU build CI has, 2.13.0; the GPU journey runs the torch floor), then the main
# job (./train-singlenode.sh, shortened) and the exact-resume test on it. FLOORS_ONLY=1 prints the pins and stops.
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
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
for dep in deps:
    m = re.match(r"^\s*([A-Za-z0-9_.-]+)\s*>=\s*([\w.]+)", dep)
    if m and m.group(1) != "torch":  # torch: the CPU build CI has (see the header)
        print(f"{m.group(1)}=={m.group(2)}")
PY
}
mapfile -t pins < <(floors)
echo "oldest-versions: ${pins[*]} (torch 2.13.0, CPU)"
[[ $FLOORS_ONLY == 1 ]] && exit 0

rm -rf "$OLDEST_VENV"
python3 -m venv "$OLDEST_VENV"
py=$OLDEST_VENV/bin/python
"$py" -m pip install --quiet --upgrade pip
"$py" -m pip install --quiet torch==2.13.0 setuptools wheel ninja
ds_pin=""
other=()
for pin in "${pins[@]}"; do
    if [[ $pin == deepspeed==* ]]; then ds_pin=$pin; else other+=("$pin"); fi
done
# DeepSpeed's sdist builds against the torch above (see .ci/run).
"$py" -m pip install --quiet --no-build-isolation "$ds_pin"
"$py" -m pip install --quiet -e ".[test]" "${other[@]}" "$ds_pin"
"$py" -c "import torch, deepspeed, transformers, datasets; print('oldest-versions: torch', torch.__version__, '| deepspeed', deepspeed.__version__, '| transformers', transformers.__version__, '| datasets', datasets.__version__)"

# The main job as README's first command runs it, on this environment, with its own checkpoint directory.
ckpt=$(mktemp -d)
PYTHON=$py CHECKPOINT_DIR=$ckpt MAX_STEPS=$OLDEST_MAX_STEPS ./train-singlenode.sh --generate_prompt "Return the"
test -f "$ckpt/hf/model.safetensors"
rm -rf "$ckpt"
"$py" -m pytest -q tests/distributed/test_training.py -k "resume_after_kill_9 or loss_falls or export_loads"
