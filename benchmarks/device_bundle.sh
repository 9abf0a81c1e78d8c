#!/usr/bin/env bash
# Builds, in the repository root, a wheel bundle for a GPU node that cannot reach a package index (an offline,
# air-gapped cluster node) or whose image lacks the project's GPU set; build it beside a package index and copy the
# folders over, and run_device.sh installs them: .whl/ (DeepSpeed built as a wheel, Liger, datasets, TRL and the
# packages of theirs the image lacks) and .fa4/part-aa, part-ab (flash-attn-4 with its CuTe DSL libraries, unpacked and
# xz-compressed: ~69 MB, split into PART_BYTES parts for a transfer limit smaller than the bundle, joined again on the
# node; README.md). Both folders are ignored by git (.gitignore). Versions: benchmarks/constraints.txt.
#   bash benchmarks/device_bundle.sh          # needs pip with a package index and, for DeepSpeed's wheel, torch
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

: "${PYTHON:=python3}"            # builds DeepSpeed's wheel: needs torch importable
: "${PYTHON_VERSION:=3.12}"      # the GPU node's Python
: "${PART_BYTES:=36500000}"      # each .fa4 part's size: two parts (run_device.sh joins part-aa, part-ab)

pin() { grep -E "^$1==" benchmarks/constraints.txt | cut -d= -f3; }
platforms=(--python-version "$PYTHON_VERSION" --implementation cp --only-binary=:all: --platform any)
for n in 17 24 27 28 31 34 35; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64)

rm -rf .whl .fa4
mkdir -p .whl .fa4

# DeepSpeed ships no wheel: build one against the torch here (its ops compile on the GPU machine when first used).
cmd=("$PYTHON" -m pip wheel -q --no-deps --no-build-isolation -w .whl "deepspeed==$(pin deepspeed)")
echo "+ ${cmd[*]}"
"${cmd[@]}"
# What a CUDA image with torch and transformers typically lacks besides. TRL's vision-language path (vlm_bench.py)
# needs nothing more: Pillow (datasets' Image feature) and torchvision (the Qwen-VL processors) come with the image.
cmd=("$PYTHON" -m pip download -q --no-deps "${platforms[@]}" -d .whl "liger-kernel==$(pin liger-kernel)"
     "datasets==$(pin datasets)" "dill<0.4.2" "multiprocess<0.70.20" pydantic==2.13.4 pydantic-core==2.46.4 annotated-types
     typing-inspection hjson "trl==$(pin trl)")
echo "+ ${cmd[*]}"
"${cmd[@]}"

staging=$(mktemp -d)
trap 'rm -rf "$staging"' EXIT
cmd=("$PYTHON" -m pip download -q --no-deps "${platforms[@]}" -d "$staging/wheels"
     "flash-attn-4==$(pin flash-attn-4)" "nvidia-cutlass-dsl==$(pin nvidia-cutlass-dsl)"
     "nvidia-cutlass-dsl-libs-base==$(pin nvidia-cutlass-dsl)" "nvidia-cutlass-dsl-libs-core==$(pin nvidia-cutlass-dsl)"
     "nvidia-cutlass-dsl-libs-cu13==$(pin nvidia-cutlass-dsl)" apache-tvm-ffi quack-kernels torch-c-dlpack-ext)
echo "+ ${cmd[*]}"
"${cmd[@]}"
mkdir -p "$staging/site"
for wheel in "$staging"/wheels/*.whl; do
    "$PYTHON" -m zipfile -e "$wheel" "$staging/site"
done
tar -C "$staging/site" -cf - . | xz -9e -T0 >"$staging/fa4site.tar.xz"
split -b "$PART_BYTES" "$staging/fa4site.tar.xz" .fa4/part-
ls -l .whl .fa4
