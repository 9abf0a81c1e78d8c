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

# Pin the image's torch build (and its companions) so that pip keeps them, then install the trainer's
# dependencies and build DeepSpeed's CPU Adam and fused Adam ops ahead of time (the configs use them).
RUN pip list --format=freeze | grep -iE '^(torch|torchvision|torchaudio|triton|pytorch-triton)==' > /tmp/base-constraints.txt \
 && PIP_CONSTRAINT=/tmp/base-constraints.txt DS_BUILD_CPU_ADAM=1 DS_BUILD_FUSED_ADAM=1 \
    pip install --no-cache-dir --no-build-isolation \
        deepspeed==0.19.8 transformers==5.23.0 datasets==5.2.0 tqdm==4.70.1 safetensors==0.8.0 \
 && ds_report

# The project itself, without dependencies: the image's torch stays.
WORKDIR /opt/deepspeed-lm-trainer
COPY pyproject.toml README.md ./
COPY src ./src
RUN pip install --no-cache-dir --no-deps . \
 && rm -rf /tmp/base-constraints.txt
