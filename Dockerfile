# Training image for Pyxis/Enroot (./setup-pyxis.sh builds it and converts it to a .sqsh).
# The NGC PyTorch image brings CUDA, NCCL, the EFA/IB libraries and its own torch build: nothing below replaces it.
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:25.06-py3
FROM ${BASE_IMAGE}

# GPU architectures the DeepSpeed ops are compiled for: A100, A10/A40, L4/L40/Ada, H100/H200, B200/GB200, B300.
# Plain X.Y entries (DeepSpeed's op builder cannot parse suffixes such as 9.0a); it also sets
# TORCH_CUDA_ARCH_LIST for ops built at run time, overriding the base image's value.
ARG CUDA_ARCHS="8.0;8.6;8.9;9.0;10.0;10.3"
ENV TORCH_CUDA_ARCH_LIST=${CUDA_ARCHS} \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# Dependencies first, so this layer (and DeepSpeed's op build) is rebuilt only when pyproject.toml changes: the
# project's dependency list with its [gpu] extra (Liger's fused kernels, FlashAttention-4), installed against a stub
# of the package.
# The image's torch build and its companions are held by a constraint so pip keeps them, the versions this project
# was tested with the same way; DeepSpeed's CPU Adam and fused Adam ops are built ahead of time (the configs use them).
WORKDIR /opt/deepspeed-lm-trainer
COPY pyproject.toml ./
# The versions are pinned through the constraint file, which hadolint cannot see.
# hadolint ignore=DL3013
RUN mkdir -p src/model_utils && touch src/model_utils/__init__.py README.md \
 && pip list --format=freeze | grep -iE '^(torch|torchvision|torchaudio|triton|pytorch-triton)==' > /tmp/constraints.txt \
 && printf '%s\n' deepspeed==0.19.8 transformers==5.23.0 datasets==5.2.0 tqdm==4.70.1 safetensors==0.8.0 \
        liger-kernel==0.8.5 flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 >> /tmp/constraints.txt \
 && PIP_CONSTRAINT=/tmp/constraints.txt DS_BUILD_CPU_ADAM=1 DS_BUILD_FUSED_ADAM=1 \
    pip install --no-cache-dir --no-build-isolation ".[gpu]" \
 && rm -f /tmp/constraints.txt \
 && ds_report

# The project itself, over the stub (README.md is its long description); its dependencies are in place.
COPY README.md ./
COPY src ./src
RUN pip install --no-cache-dir --no-build-isolation --no-deps .
