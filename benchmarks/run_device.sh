#!/usr/bin/env bash
# Runs on a GPU node (repo root): install the bundled wheels (.whl/, where present), normalise the environment, then
# run the benchmark invocations named by PLAN (the cases below, or shell commands calling bench()), each bounded, logs
# and JSON under $OUT. BUDGET: the seconds this script may run; PLANS runs several named plans in turn within it.
#   PLAN=h100 bash benchmarks/run_device.sh
#   PLANS="peer-checkpointing journeys" JOURNEYS=zero3-delayed BUDGET=560 bash benchmarks/run_device.sh
set -u
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/logs"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# flash-attn-4 and its CuTe DSL libraries (~69 MB as .tar.xz) come as split parts in .fa4/ (PART_BYTES each, for a
# transfer limit smaller than the bundle); they gather in /tmp/fa4-parts, over one run or several on the same node,
# and are unpacked once all are there (see README.md).
mkdir -p /tmp/fa4-parts
if compgen -G ".fa4/part-*" >/dev/null; then cp .fa4/part-* /tmp/fa4-parts/; fi
if [ ! -d /tmp/site-fa4 ] && [ -f /tmp/fa4-parts/part-aa ] && [ -f /tmp/fa4-parts/part-ab ]; then
  mkdir -p /tmp/site-fa4 && cat /tmp/fa4-parts/part-* | xz -d | tar x -C /tmp/site-fa4 || exit 1
fi
# nvidia-cutlass-dsl adds its packages through a .pth file, which PYTHONPATH entries do not run.
[ -d /tmp/site-fa4 ] && export PYTHONPATH=/tmp/site-fa4:/tmp/site-fa4/nvidia_cutlass_dsl/dsl_packages:${PYTHONPATH:-}
# TORCH_CUDA_ARCH_LIST (e.g. 9.0a in a CUDA container image) is normalised by the trainer and bench.py themselves.
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers, deepspeed, liger_kernel, accelerate; print('torch', torch.__version__, 'transformers', transformers.__version__, 'deepspeed', deepspeed.__version__, 'accelerate', accelerate.__version__)" 2>&1 | tail -1 | tee -a "$OUT/gpu.txt"
START=$(date +%s); BUDGET=${BUDGET:-540}
run_bench() {  # run_bench SCRIPT NAME SECONDS_NEEDED ARGS...: one invocation of a benchmark script, if time is left
  local script=$1 name=$2 need=$3; shift 3
  local left=$((BUDGET - ($(date +%s) - START)))
  if [ "$left" -lt "$need" ]; then echo "SKIP $name (left ${left}s < ${need}s)"; return; fi
  echo "=== $name ($(($(date +%s) - START))s)"
  # --log-dir: one folder per section, so runs of the same name in two sections keep both logs
  python3 "$script" --json "$OUT/results.jsonl" --log-dir "$OUT/logs/$name" --write-doc "$OUT/$name.md" "$@" 2>&1 \
    | grep -v '^\[rank' | tee "$OUT/$name.txt" | grep -E '^(\||engine|hf|ours|trl|full|lora|qlora|loss|Loss|#|Best|Round|Over)' \
    | cut -c1-400
}
bench() { run_bench benchmarks/bench.py "$@"; }  # bench NAME SECONDS_NEEDED bench.py-ARGS...
# sft NAME SECONDS_NEEDED sft_bench.py-ARGS...; each recompilation of a compiled layer is logged with its reason (a
# stalled step at a new shape names the shape in the run's log)
sft() { TORCH_LOGS=${SFT_TORCH_LOGS-recompiles} run_bench benchmarks/sft_bench.py "$@"; }
# Qwen3-4B at 131,072 tokens per step with the offload preset (ZeRO-2, the optimizer offloaded) and under ZeRO-3 with
# parameters and optimizer offloaded: the setups of the offload and zero3-* plans
Q4B_ZERO2=(--model qwen3-4b --ds_config configs/zero2-offload.json --global_batch_tokens 131072)
Q4B_ZERO3=(--model qwen3-4b --ds_config configs/zero3-offload.json --global_batch_tokens 131072)
# Supervised fine-tuning on chat data (sft_bench.py): one model (SFT_MODEL) and its modes (SFT_MODES) per run, 2048-token
# blocks, 65,536 block tokens per optimizer step, each side at its micro-batches; the model is written once per machine.
SFT_MODEL=${SFT_MODEL:-qwen3-1.7b}; SFT_MODES=${SFT_MODES:-full}; SFT_TAG=${SFT_TAG:-}
sft_args() {  # SFT_ARGS for SFT_MODES as it is now (a per-GPU subshell of the parallel plan sets its own)
  read -r -a SFT_MODE_LIST <<<"$SFT_MODES"
  SFT_ARGS=(--model "$SFT_MODEL" --modes "${SFT_MODE_LIST[@]}" --seq_len 2048 --global_batch_tokens 65536 --steps 20
            --warmup 2 --workdir "/tmp/sft-work-${CUDA_VISIBLE_DEVICES:-all}")
}
sft_args
# Vision-language fine-tuning on image chats (vlm_bench.py): qwen2.5-vl-7b, written once per machine under /tmp/vlm-work
# with 3,000 rows; 4096-token blocks, 16,384 block tokens per optimizer step (TRL: as many examples at their mean
# length), the vision tower frozen on both sides, activation checkpointing on both (TRL's default), 20 timed steps.
# vlm NAME SECONDS_NEEDED vlm_bench.py-ARGS...
vlm() { run_bench benchmarks/vlm_bench.py "$@"; }
VLM_ARGS=(--model qwen2.5-vl-7b --seq_len 4096 --global_batch_tokens 16384 --steps 20 --warmup 2 --max_examples 3000
          --gradient_checkpointing --workdir "/tmp/vlm-work-${CUDA_VISIBLE_DEVICES:-all}")
run_plan() {
case "$1" in
  h100)  # the issue's one-H100 table: each side at micro-batch 8, 12, 14, 16, both HF peers, one invocation (~6-7 min)
    bench best 470 --model qwen3-0.6b --micro_batch_size 8 12 14 16 --steps 6 --warmup 3 --timeout 150 --variants default \
      --compare-hf --title "Qwen3-0.6B, 1 H100: default path vs HF Trainer + DeepSpeed (with and without Liger), micro-batch 8, 12, 14, 16"
    ;;
  rounds)  # each side at its best micro-batch of the earlier invocations (ours 16, HF + Liger 12), 4 rounds in turn
    bench rounds 540 --model qwen3-0.6b --micro_batch_size 16 --hf-micro-batch-size 12 --compare-hf --hf-skip noliger \
      --variants default --steps 20 --warmup 3 --rounds 4 --timeout 150 \
      --title "Qwen3-0.6B, 1 H100: default path at 16 vs HF Trainer + DeepSpeed + Liger at 12, four rounds in turn"
    ;;
  h100-checks)  # the loss check, the attention kernels alone, Qwen3-4B with CPU optimizer offload
    bench losscheck 130 --model qwen3-0.6b --steps 1 --warmup 1 --variants --loss-check 50 --loss-check-mb 2 --loss-check-variants default --timeout 150 --title "Loss check"
    echo "=== attention ($(($(date +%s) - START))s)"
    python3 benchmarks/attention.py --batch 16 2>&1 | grep -E "^(\||shape|Flash)" | tee "$OUT/attention.txt"
    bench q4b_offload 150 --model qwen3-4b --ds_config configs/zero2-offload.json --gradient_checkpointing --micro_batch_size 2 --steps 3 --warmup 1 --timeout 300 --variants default --title "Qwen3-4B, ZeRO-2 + CPU optimizer offload, 1 H100"
    ;;
  offload)  # Qwen3-4B with the offload preset against HF Trainer + DeepSpeed + Liger, same config and global batch (~9 min)
    bench q4b_pair 540 --model qwen3-4b --ds_config configs/zero2-offload.json --global_batch_tokens 262144 \
      --micro_batch_size 2 --compare-hf --hf-skip noliger --variants default --steps 2 --warmup 1 --timeout 330 \
      --title "Qwen3-4B, ZeRO-2 + CPU optimizer offload, 1 H100, 262,144 tokens per step"
    ;;
  offload-profile)  # where a Qwen3-4B offload step goes: the micro-batches on the GPU against the CPU optimizer step
    # the phase timing and the GPU's idle gaps print first; the profiler's tables of a 4B step take minutes more
    bench q4b_profile 580 "${Q4B_ZERO2[@]}" \
      --micro_batch_size 2 --variants default --steps 2 --warmup 1 --profile --timeout 570 \
      --title "Qwen3-4B, ZeRO-2 + CPU optimizer offload, 1 H100, phase timing"
    ;;
  delayed)  # Qwen3-4B, offload preset, 131,072 tokens/step: the delayed update against HF Trainer + DeepSpeed + Liger at
    # 4 x 8 with activation checkpointing (its best, 16 x 2 with checkpointing, beside ours: PLAN=peer-checkpointing)
    bench q4b_delayed 520 "${Q4B_ZERO2[@]}" \
      --micro_batch_size 2 --hf-micro-batch-size 4 --hf-gradient-checkpointing on --compare-hf --hf-skip noliger \
      --variants delayed_update --steps 3 --warmup 1 --timeout 300 \
      --title "Qwen3-4B, ZeRO-2 + CPU optimizer offload, 1 H100, 131,072 tokens per step, delayed update against the peer at 4 x 8"
    ;;
  peer-checkpointing)  # the HF peer's settings with activation checkpointing under the offload preset, 131,072 tokens
    # per step: 8 x 4 and 16 x 2 (fewer micro-batches for a third more compute; at 4 x 8 without checkpointing the
    # preset's fp32 buffer does not fit beside its activations), then our delayed update at 2 x 16 beside them (~8.5 min)
    bench q4b_peer_ckpt 330 "${Q4B_ZERO2[@]}" --steps 2 --warmup 1 --micro_batch_size 8 --hf-micro-batch-size 8 16 \
      --hf-gradient-checkpointing on --variants --compare-hf --hf-skip noliger --timeout 200 \
      --title "Qwen3-4B, offload preset, HF Trainer + DeepSpeed + Liger at 8 x 4 and 16 x 2 with checkpointing"
    bench q4b_delayed_beside 200 "${Q4B_ZERO2[@]}" --steps 2 --warmup 1 --micro_batch_size 2 --variants delayed_update \
      --timeout 195 \
      --title "Qwen3-4B, offload preset, 131,072 tokens per step, our delayed update at 2 x 16"
    ;;
  delayed-ab)  # Qwen3-4B, offload preset, 131,072 tokens/step: the synchronous update against the delayed one
    bench q4b_delayed_ab 540 "${Q4B_ZERO2[@]}" \
      --micro_batch_size 2 --variants default delayed_update --steps 2 --warmup 1 --timeout 270 \
      --title "Qwen3-4B, ZeRO-2 + CPU optimizer offload, 1 H100, 131,072 tokens per step: synchronous and delayed update"
    ;;
  prefetch-ab)  # Qwen3-4B, offload preset, 131,072 tokens/step, one invocation: the delayed update without and with the
    # prefetch of its weights to a second GPU buffer, then the peer at its best (16 x 2 with checkpointing) (~8-9 min;
    # the first run compiles on a machine just started, past 190 s there)
    bench q4b_prefetch_ab 560 "${Q4B_ZERO2[@]}" --steps 2 --warmup 1 --micro_batch_size 2 \
      --variants delayed_update_no_prefetch delayed_update --compare-hf --hf-skip noliger --hf-micro-batch-size 16 \
      --hf-gradient-checkpointing on --timeout 230 \
      --title "Qwen3-4B, offload preset, 1 H100, 131,072 tokens per step: the delayed update without and with the prefetch, and the peer at 16 x 2"
    ;;
  zero2-micro)  # Qwen3-4B, offload preset, 131,072 tokens/step, the delayed update without the prefetch at micro-batch 2,
    # 4 and 1, one invocation: what each micro-batch costs beyond its tokens' work (~8 min on a machine just started)
    bench q4b_micro_sweep 590 "${Q4B_ZERO2[@]}" --steps 2 --warmup 1 --micro_batch_size 2 4 1 \
      --variants delayed_update_no_prefetch --timeout 230 \
      --title "Qwen3-4B, offload preset, 1 H100, 131,072 tokens per step: the delayed update at micro-batch 2, 4 and 1"
    ;;
  zero2-best)  # the table of record's Qwen3-4B row: our delayed update at 4 x 8 (--micro_batch_size 4; the prefetch
    # buffer does not fit beside it), then the peer at its best, 16 x 2 with checkpointing, one invocation (~6 min)
    bench q4b_zero2_best 470 "${Q4B_ZERO2[@]}" --steps 2 --warmup 1 --micro_batch_size 4 --variants delayed_update \
      --compare-hf --hf-skip noliger --hf-micro-batch-size 16 --hf-gradient-checkpointing on --timeout 230 \
      --title "Qwen3-4B, offload preset, 1 H100, 131,072 tokens per step: our delayed update at 4 x 8, the peer at 16 x 2"
    ;;
  sft)  # ours against TRL's SFTTrainer + DeepSpeed + Liger on the embedded chats: ours at micro-batch 4 and 8, TRL at
    # 1, 2 and 4 (padding-free: a micro-batch's bins are one row, whose SDPA mask grows with its square) (~8 min a mode)
    sft "sft-$SFT_MODEL-${SFT_MODES// /-}" 300 "${SFT_ARGS[@]}" --micro_batch_size 4 8 --peer-micro-batch-size 1 2 4 \
      --timeout 240 --title "Supervised fine-tuning, $SFT_MODEL ($SFT_MODES), 1 GPU: ours against TRL SFTTrainer"
    ;;
  sft-fa4)  # the fine-tuning headline: both sides at their best with FlashAttention-4 (TRL's padding-free rows are
    # supported with FlashAttention only), TRL at micro-batch SFT_PEER_MB (default 2 and 4: 4 its fastest of 4, 8 and
    # 16), ours at SFT_OURS_MB (8 and 16), 20 timed steps each; SFT_SKIP=ours or trl runs one side (the parallel plan
    # spreads a comparison over GPUs)
    read -r -a ours_mb <<<"${SFT_OURS_MB:-8 16}"; read -r -a peer_mb <<<"${SFT_PEER_MB:-2 4}"; read -r -a skip <<<"${SFT_SKIP:-}"
    sft "sft-fa4-$SFT_MODEL-${SFT_MODES// /-}$SFT_TAG" "${SFT_NEED:-420}" "${SFT_ARGS[@]}" --micro_batch_size "${ours_mb[@]}" \
      --peer-micro-batch-size "${peer_mb[@]}" --skip "${skip[@]}" --peer-attn flash_attention_4 \
      --timeout "${SFT_TIMEOUT:-240}" \
      --title "Supervised fine-tuning, $SFT_MODEL ($SFT_MODES), 1 GPU, FlashAttention-4 on both sides: ours against TRL"
    ;;
  sft-no-fa4)  # the same with FlashAttention-4 off on both sides: ours on PyTorch's varlen attention at 16 x 2 (50,149
    # tokens/s against 48,473 at 8 x 4), TRL on its path for SDPA (padding-free rows are supported with FlashAttention
    # only): examples padded per micro-batch, grouped by length, SFT_PEER_MB examples (~150 tokens each) per micro-batch
    # (8: 54 micro-batches a step, 10.4 s; 16: 6.4 s; 32: 3.8 s; 64: out of memory on an H200) (~8 min)
    read -r -a ours_mb <<<"${SFT_OURS_MB:-16}"; read -r -a peer_mb <<<"${SFT_PEER_MB:-16 32}"; read -r -a skip <<<"${SFT_SKIP:-}"
    sft "sft-nofa4-$SFT_MODEL-${SFT_MODES// /-}$SFT_TAG" "${SFT_NEED:-420}" "${SFT_ARGS[@]}" --micro_batch_size "${ours_mb[@]}" \
      --peer-micro-batch-size "${peer_mb[@]}" --skip "${skip[@]}" --peer-attn "${SFT_PEER_ATTN:-sdpa}" \
      --peer-packing grouped --timeout "${SFT_TIMEOUT:-300}" --attention_kernel varlen \
      --title "Supervised fine-tuning, $SFT_MODEL ($SFT_MODES), 1 GPU, FlashAttention-4 off on both: ours (varlen) against TRL"
    ;;
  vlm)  # vision-language fine-tuning against TRL's SFTTrainer for vision-language models (TRL refuses packing and
    # padding-free rows for images: its examples are padded per micro-batch), one invocation per mode of VLM_MODES:
    # lora (ours at 1, 2 and 4 blocks, TRL at 4 examples; ds_config.json) and full (1 and 2, 2 and 4; the 7.6B
    # trained weights' AdamW states take an H200's memory: on an H100 our preflight refuses it, TRL runs out of
    # memory). VLM_OURS_MB and VLM_PEER_MB replace the micro-batches, VLM_DS the DeepSpeed config, VLM_SKIP="ours" or
    # "trl" runs one side. Measured on one H100 (LoRA, 2026-12-07): writing the 7B and the rows ~70 s once; ours ~100 s
    # a run (24 s of setup, 22 steps of ~5 s); TRL at micro-batch 4 ~20 s a step (11 micro-batches), ~9 min for its
    # 22 steps with setup: run it alone (VLM_SKIP=ours VLM_TIMEOUT=560 VLM_NEED=560 BUDGET=590)
    read -r -a vlm_modes <<<"${VLM_MODES:-lora full}"; read -r -a skip <<<"${VLM_SKIP:-}"
    for mode in "${vlm_modes[@]}"; do
      if [ "$mode" = lora ]; then ours_mb=(1 2 4) peer_mb=(4) need=560; else ours_mb=(1 2) peer_mb=(2 4) need=560; fi
      read -r -a ours_mb <<<"${VLM_OURS_MB:-${ours_mb[*]}}"; read -r -a peer_mb <<<"${VLM_PEER_MB:-${peer_mb[*]}}"
      vlm "vlm-$mode" "${VLM_NEED:-$need}" "${VLM_ARGS[@]}" --modes "$mode" --ds_config "${VLM_DS:-ds_config.json}" \
        --micro_batch_size "${ours_mb[@]}" --peer-micro-batch-size "${peer_mb[@]}" --skip "${skip[@]}" \
        --timeout "${VLM_TIMEOUT:-200}" --title "Vision-language fine-tuning, qwen2.5-vl-7b ($mode), 1 GPU: ours against TRL SFTTrainer"
    done
    ;;
  your-model)  # a model of your own with Qwen3-0.6B's architecture against the preset itself, speed options off on
    # both (the kernels a model of your own gets), 2048-token blocks, micro-batch 8, 25 steps (means over the last 20)
    echo "=== your-model ($(($(date +%s) - START))s)"
    python3 benchmarks/your_model_timing.py --model qwen3-0.6b --seq_len 2048 --micro_batch_size 8 --steps 25 \
      --warmup 5 --json "$OUT/results.jsonl" --workdir /tmp/your-model-timing 2>&1 | tee "$OUT/your-model.txt" | tail -6
    ;;
  your-model-example)  # examples/your-model as docs/YOUR-MODEL.md runs it (three stages, a checkpoint each, the
    # export), under ds_config.json and configs/zero3.json (~4 min with setup)
    for ds in ds_config.json configs/zero3.json; do
      tag=$(basename "$ds" .json)
      echo "=== your-model-example $ds ($(($(date +%s) - START))s)"
      timeout 150 python3 src/train_deepspeed.py --model examples/your-model/model.py:build \
        --dataset examples/your-model/data.py:build --config examples/your-model/stages.yaml --ds_config "$ds" \
        --checkpoint_dir "/tmp/your-model-example-$tag" 2>&1 | grep -v '^\[rank' | tee "$OUT/your-model-example-$tag.txt" \
        | grep -E "^(stage|step|eval|export|  )" | cut -c1-220
    done
    ;;
  dpo)  # preference tuning (DPO) against TRL's DPOTrainer + DeepSpeed + Liger: Qwen3-1.7B, full fine-tuning, 2,000
    # embedded pairs, 32,768 block tokens a step, FlashAttention-4 on both sides; ours at 4 and 8 blocks, TRL at 8
    # pairs (its setup precomputes the reference over the pairs: minutes) (~8 min)
    run_bench benchmarks/dpo_bench.py dpo 420 --model qwen3-1.7b --modes full --seq_len 1024 --global_batch_tokens 32768 \
      --micro_batch_size 4 8 --peer-micro-batch-size 8 --steps 20 --warmup 2 --peer-attn flash_attention_4 \
      --max_examples 2000 --timeout 400 --workdir /tmp/dpo-work \
      --title "Preference tuning (DPO), Qwen3-1.7B, full, 1 GPU, FlashAttention-4 on both sides: ours against TRL"
    ;;
  small-gpu)  # LoRA and QLoRA on one GPU against the peers as their docs run them (docs/QLORA.md): SMALL_MODEL (default
    # llama-8b) at 2048-token blocks, 16,384 tokens a step, 20 timed steps, each side at its micro-batches: TRL + peft
    # + bitsandbytes (qlora), then Unsloth (lora, qlora) and axolotl (full, lora) from their own `pip install --target`
    # folders under PEER_DIR (they pin other transformers, TRL and datasets releases than ours), installed once
    small=(--model "${SMALL_MODEL:-llama-8b}" --seq_len 2048 --global_batch_tokens 16384 --steps 20 --warmup 2
           --gradient_checkpointing --lora_dropout 0 --micro_batch_size 1 2 4 8 --peer-micro-batch-size 1 2 4 8
           --timeout 600 --workdir /tmp/small-gpu-work)
    sft small-gpu-trl 900 "${small[@]}" --peer trl --modes qlora --title "QLoRA, 1 GPU: ours against TRL + peft + bitsandbytes"
    for peer in unsloth axolotl; do
      dir=${PEER_DIR:-/tmp/peers}/$peer
      [ -d "$dir" ] || python3 -m pip install -q --target "$dir" "$([ "$peer" = axolotl ] && echo 'axolotl[deepspeed]==0.19.0' || echo unsloth==2026.10.9)" \
        liger-kernel || { echo "SKIP small-gpu-$peer (no $peer installed in $dir)"; continue; }
      modes=(lora qlora); [ "$peer" = axolotl ] && modes=(full lora)
      sft "small-gpu-$peer" 1200 "${small[@]}" --peer "$peer" --peer-env "$dir" --modes "${modes[@]}" \
        --title "${modes[*]}, 1 GPU: ours against $peer"
    done
    ;;
  gpu-tests)  # the tests that need a GPU (skipped on CI's CPU machines): the delayed update's prefetch, the pinned
    # buffers of background saves and of offloaded activations
    echo "=== gpu-tests ($(($(date +%s) - START))s)"
    # (-k selects among every test named, so the prefetch's tests run apart from the others)
    { timeout 300 python3 -m pytest -q -p no:cacheprovider tests/distributed/test_delayed_update.py -k prefetch 2>&1 | tail -8
      timeout 200 python3 -m pytest -q -p no:cacheprovider \
        "tests/distributed/test_background_save.py::test_pinned_save_buffers_copy_from_the_gpu_exactly" \
        "tests/unit/models/test_offload.py::test_pinned_buffers_are_registered_at_their_exact_size_and_copy_back_exactly" \
        2>&1 | tail -8; } | tee "$OUT/gpu-tests.txt"
    ;;
  delayed-losses)  # Qwen3-0.6B, offload preset: 50 steps of the delayed update against the synchronous one
    bench q06_delayed_losses 300 --model qwen3-0.6b --ds_config configs/zero2-offload.json --global_batch_tokens 65536 \
      --steps 1 --warmup 1 --variants --loss-check 50 --loss-check-mb 2 --loss-check-reference default \
      --loss-check-variants delayed_update --timeout 280 --title "Delayed update: losses against the synchronous update"
    ;;
  zero3-offload)  # Qwen3-4B, ZeRO-3 with parameters and optimizer offloaded, 131,072 tokens/step, micro-batch 4 x 8 (the
    # automatic micro-batch's choice), against HF Trainer + DeepSpeed + Liger (~7 min)
    bench q4b_zero3_offload 480 "${Q4B_ZERO3[@]}" --micro_batch_size 4 \
      --steps 2 --warmup 1 --timeout 250 --variants default --compare-hf --hf-skip noliger \
      --title "Qwen3-4B, ZeRO-3 + parameter and optimizer offload, 1 H100, 131,072 tokens per step"
    ;;
  zero3-delayed)  # the same with the CPU update synchronous and delayed by one step from the first, against HF Trainer +
    # DeepSpeed + Liger, one invocation (~9 min: BUDGET=560)
    bench q4b_zero3_delayed 540 "${Q4B_ZERO3[@]}" --micro_batch_size 4 \
      --steps 2 --warmup 1 --timeout 230 --variants default delayed_update --compare-hf \
      --hf-skip noliger \
      --title "Qwen3-4B, ZeRO-3 + parameter and optimizer offload, delayed update, 1 H100, 131,072 tokens per step"
    ;;
  zero3-checkpointed)  # the fastest measured setting of both sides under ZeRO-3 + offload, one invocation: 16 x 2 with
    # activation checkpointing (2 parameter fetches a step instead of 8), our update delayed (~5 min: BUDGET=330)
    bench q4b_zero3_ckpt 320 "${Q4B_ZERO3[@]}" --micro_batch_size 16 --gradient_checkpointing \
      --variants delayed_update --compare-hf --hf-skip noliger --steps 2 --warmup 1 --timeout 230 \
      --title "Qwen3-4B, ZeRO-3 + offload, 1 H100, 16 x 2 with checkpointing on both sides, delayed update"
    ;;
  zero3-layers)  # ZeRO-3 + offload at 16 x 2 with checkpointing: our delayed update with every layer recomputed and with
    # --checkpointed_layers auto (the memory left over keeps the last layers' activations), beside the peer (~6.5 min)
    bench q4b_zero3_layers 560 "${Q4B_ZERO3[@]}" --micro_batch_size 16 --gradient_checkpointing \
      --variants delayed_update delayed_update_auto_layers --compare-hf --hf-skip noliger --steps 2 --warmup 1 \
      --timeout 200 --title "Qwen3-4B, ZeRO-3 + offload, 1 H100, 16 x 2 with checkpointing: all layers or auto, delayed update"
    ;;
  zero3-peer-checkpointing)  # the HF peer's other settings under ZeRO-3 + offload: 8 x 4 and 16 x 2 with activation
    # checkpointing (fewer micro-batches, each fetching the parameters twice, for a third more compute)
    bench q4b_zero3_peer_ckpt 500 "${Q4B_ZERO3[@]}" --micro_batch_size 8 \
      --hf-micro-batch-size 8 16 --hf-gradient-checkpointing on --variants --compare-hf \
      --hf-skip noliger --steps 2 --warmup 1 --timeout 240 \
      --title "Qwen3-4B, ZeRO-3 + offload, HF Trainer + DeepSpeed + Liger at 8 x 4 and 16 x 2 with checkpointing"
    ;;
  zero3-profile)  # where a ZeRO-3 + offload step goes (Qwen3-4B, 4 x 8, delayed update): the phase timing (host time
    # against GPU time of each forward, backward and step) and the GPU's idle gaps by the host's phase at their start
    bench q4b_zero3_profile 580 "${Q4B_ZERO3[@]}" --micro_batch_size 4 \
      --variants delayed_update --steps 2 --warmup 1 --profile --timeout 570 \
      --title "Qwen3-4B, ZeRO-3 + parameter and optimizer offload, 1 H100, phase timing"
    ;;
  zero3-buckets)  # the same run with ZeRO-3's prefetch and gradient buckets at the resolved "auto" (0.9 and 1 x hidden^2:
    # 5.9M and 6.6M elements for Qwen3-4B, below one projection's 10-25M) and raised to a few layers' worth
    Z=("${Q4B_ZERO3[@]}" --micro_batch_size 4 --variants delayed_update --steps 2 --warmup 1 --timeout 240)
    bench z3_buckets_auto 245 "${Z[@]}" --title "ZeRO-3 buckets: auto"
    bench z3_prefetch_3e8 160 "${Z[@]}" --ds-set zero_optimization.stage3_prefetch_bucket_size=300000000 \
      --title "ZeRO-3 buckets: prefetch 3e8"
    bench z3_buckets_3e8 160 "${Z[@]}" --ds-set zero_optimization.stage3_prefetch_bucket_size=300000000 \
      zero_optimization.reduce_bucket_size=300000000 --title "ZeRO-3 buckets: prefetch and reduce 3e8"
    ;;
  lora-activations)  # one decoder layer's kept activations at 2048 tokens (benchmarks/layer_activations.py): LoRA rank
    # 16 on Llama 3.2 1B's and Qwen3-1.7B's dimensions, compiled with dropout 0.05 and 0, eager, and Llama's layer
    # without LoRA compiled and eager; ~2 min each, those that fit BUDGET (two runs for all six)
    LA=(python3 benchmarks/layer_activations.py --seq_len 2048 --json "$OUT/lora_layers.jsonl")
    for args in "--models llama-1b --lora_rank 16" "--models qwen3-1.7b --lora_rank 16" \
        "--models llama-1b --lora_rank 16 --lora_dropout 0" "--models llama-1b --lora_rank 16 --compile off" \
        "--models llama-1b" "--models llama-1b --compile off"; do
      if (($(date +%s) - START + 150 > BUDGET)); then echo "SKIP layer_activations $args"; continue; fi
      echo "=== layer_activations $args ($(($(date +%s) - START))s)"
      # shellcheck disable=SC2086  # each entry holds several arguments
      timeout 240 "${LA[@]}" $args 2>&1 | grep -E "bytes per token|Error" | cut -c1-300
    done
    ;;
  journeys)  # the journeys named by JOURNEYS (benchmarks/journey.sh), by default the ZeRO-3 + offload pairs (Qwen3-0.6B,
    # 4 micro-batches a step) with the update synchronous and delayed: train to 6, resume to 12
    echo "=== journeys ${JOURNEYS:=zero3-offload zero3-delayed} ($(($(date +%s) - START))s)"
    # a *-large-resume journey's own checkpoint would not fit the 64 GiB disk beside its large journey's 55 GiB one: a
    # tmpfs with room holds its directory (the run is killed before it saves)
    if (($(df -B1 --output=avail /dev/shm | tail -1) > 60 * 2 ** 30)); then
      export JOURNEY_RESUME_ROOT=${JOURNEY_RESUME_ROOT:-/dev/shm}
    fi
    JOURNEY_ONLY="$JOURNEYS" JOURNEY_DIR=/tmp/journey bash benchmarks/journey.sh 2>&1 | tail -8
    mkdir -p "$OUT/journey" && cp /tmp/journey/*.log /tmp/journey/journey.txt "$OUT/journey/"
    ;;
  q4b-losses)  # Qwen3-4B, offload preset: 50 steps of 8,192 tokens of the unoptimised path (~8 min alone: both paths
    # take longer than one run's BUDGET), compared with the default path's 50 steps recorded in h100-2026-11-25.jsonl
    bench q4b_losses_reference 590 --model qwen3-4b --ds_config configs/zero2-offload.json --steps 1 --warmup 1 \
      --variants --loss-check 50 --loss-check-mb 2 --loss-check-reference nofused --loss-check-variants --timeout 570 \
      --title "Qwen3-4B, offload preset: the unoptimised path's losses"
    python3 - "$OUT/results.jsonl" benchmarks/results/h100-2026-11-25.jsonl <<'EOF' | tee "$OUT/q4b_losses.txt"
import json, sys
sys.path.insert(0, "benchmarks")
from report import loss_check
def run(path, name):
    rows = [json.loads(line) for line in open(path)]
    return next(r["result"] for r in reversed(rows) if r["job"]["name"] == name and r["job"]["model"] == "qwen3-4b")
print("Loss check, Qwen3-4B, unoptimised against default:",
      json.dumps(loss_check(run(sys.argv[1], "losscheck-nofused-mb2"), run(sys.argv[2], "losscheck-default-mb2"))))
EOF
    ;;
  q8b-2gpu|q8b-2gpu-peer)  # Qwen3-8B on one host of two GPUs (nvidia-h100-x2 or -h200-x2: 256 GiB host, where the
    # ~150 GiB of offloaded states fit; one GPU's 128 GiB node does not hold them): the seeds' config shape (ZeRO-2,
    # optimizer offloaded), 262,144 tokens per step. q8b-2gpu: our delayed update at the automatic micro-batch (2 x 16
    # per GPU), then HF Trainer + DeepSpeed + Liger at 4 x 8 per GPU with checkpointing (its best setting at 4B), each
    # run within 290 s (one 8B setup on one H200: ~100 s); q8b-2gpu-peer: the peer alone, where the pair ran out of time
    Q8B_ZERO2=(--nproc 2 --model qwen3-8b --ds_config configs/zero2-offload.json --global_batch_tokens 262144
               --steps 2 --warmup 1)
    PEER_ARGS=(--micro_batch_size 4 --gradient_checkpointing --variants --compare-hf --hf-skip noliger)
    if [ "$1" = q8b-2gpu ]; then
      bench q8b_2gpu 580 "${Q8B_ZERO2[@]}" --timeout 290 --micro_batch_size 2 --variants delayed_update \
        --title "Qwen3-8B, ZeRO-2 + CPU optimizer offload, 2 GPUs, 262,144 tokens per step, delayed update"
      bench q8b_2gpu_peer 280 "${Q8B_ZERO2[@]}" --timeout 275 "${PEER_ARGS[@]}" \
        --title "Qwen3-8B, ZeRO-2 + CPU optimizer offload, 2 GPUs, 262,144 tokens per step, HF + Liger at 4 x 8"
    else
      bench q8b_2gpu_peer 570 "${Q8B_ZERO2[@]}" --timeout 560 "${PEER_ARGS[@]}" \
        --title "Qwen3-8B, ZeRO-2 + CPU optimizer offload, 2 GPUs, 262,144 tokens per step, HF + Liger at 4 x 8"
    fi
    ;;
  q8b-2gpu-zero3|q8b-2gpu-zero3-peer|q8b-2gpu-zero3-layers|q8b-2gpu-zero3-all-layers)  # the same host under ZeRO-3
    # with parameters and optimizer offloaded (~184 GiB host for both ranks), each side at 16 x 2 per GPU with
    # checkpointing (auto's choice with it); q8b-2gpu-zero3: ours with --checkpointed_layers auto and the delayed
    # update, then the peer, within 290 s each; -layers: ours alone (~4 min); -peer: the peer alone; -all-layers: ours
    # with every layer recomputed
    Q8B_ZERO3=(--nproc 2 --model qwen3-8b --ds_config configs/zero3-offload.json --global_batch_tokens 262144
               --micro_batch_size 16 --gradient_checkpointing --steps 2 --warmup 1)
    PEER_ARGS=(--variants --compare-hf --hf-skip noliger
               --title "Qwen3-8B, ZeRO-3 + offload, 2 GPUs, 262,144 tokens per step, HF + Liger at 16 x 2 with checkpointing")
    OURS_LAYERS=(--variants delayed_update_auto_layers
                 --title "Qwen3-8B, ZeRO-3 + offload, 2 GPUs, 262,144 tokens per step, 16 x 2, --checkpointed_layers auto, delayed update")
    case "$1" in
      q8b-2gpu-zero3)
        bench q8b_2gpu_zero3_layers 580 "${Q8B_ZERO3[@]}" --timeout 290 "${OURS_LAYERS[@]}"
        bench q8b_2gpu_zero3_peer 280 "${Q8B_ZERO3[@]}" --timeout 275 "${PEER_ARGS[@]}" ;;
      q8b-2gpu-zero3-layers) bench q8b_2gpu_zero3_layers 300 "${Q8B_ZERO3[@]}" --timeout 290 "${OURS_LAYERS[@]}" ;;
      q8b-2gpu-zero3-all-layers)
        bench q8b_2gpu_zero3 300 "${Q8B_ZERO3[@]}" --timeout 290 --variants delayed_update \
          --title "Qwen3-8B, ZeRO-3 + offload, 2 GPUs, 262,144 tokens per step, 16 x 2 with checkpointing, delayed update" ;;
      *) bench q8b_2gpu_zero3_peer 570 "${Q8B_ZERO3[@]}" --timeout 560 "${PEER_ARGS[@]}" ;;
    esac
    ;;
  partial-offload)  # one H200 (124 GiB free): Qwen3-8B, ZeRO-3 with 55% of the optimizer offloaded and the parameters on
    # the GPU (the preflight's fix there: ~109 GiB host, ~96 GiB GPU by the estimate; 86.7 and 99.2 measured), micro-batch
    # 1 x 32; PEER=1: against HF Trainer + DeepSpeed + Liger (~7.5 min)
    bench q8b_partial 560 --model qwen3-8b --ds_config configs/zero3-offload.json \
      --ds-set zero_optimization.offload_optimizer.ratio=0.55 'zero_optimization.offload_param.device="none"' \
      --global_batch_tokens 131072 --micro_batch_size 1 \
      --variants default ${PEER:+--compare-hf --hf-skip noliger} --steps 2 --warmup 1 --timeout 285 \
      --title "Qwen3-8B, ZeRO-3 + partial optimizer offload (ratio 0.55), parameters on the GPU, 1 H200, 131,072 tokens per step"
    ;;
  partial-offload-layers|partial-offload-mb2)  # Qwen3-8B and the partial offload above at the automatic
    # micro-batch's choices, on one GPU (--nproc 1 also on a host of two): partial-offload-layers, with checkpointing,
    # 16 x 2 and --checkpointed_layers auto (33 of 36 recomputed, ~123 GiB by the estimate; PEER=1: beside HF Trainer
    # + DeepSpeed + Liger at 16 x 2 with checkpointing); partial-offload-mb2, without, 2 x 16 (~116 GiB); ~3.5 min each
    PARTIAL_8B=(--nproc 1 --model qwen3-8b --ds_config configs/zero3-offload.json --global_batch_tokens 131072
                --steps 2 --warmup 1
                --ds-set zero_optimization.offload_optimizer.ratio=0.55 'zero_optimization.offload_param.device="none"')
    if [ "$1" = partial-offload-layers ]; then
      bench q8b_partial_layers 200 "${PARTIAL_8B[@]}" --micro_batch_size 16 --gradient_checkpointing \
        --variants delayed_update_auto_layers ${PEER:+--compare-hf --hf-skip noliger} --timeout 200 \
        --title "Qwen3-8B, partial offload (0.55), 1 H200, 16 x 2, --checkpointed_layers auto, delayed update"
    else
      bench q8b_partial_mb2 220 "${PARTIAL_8B[@]}" --micro_batch_size 2 --variants delayed_update --timeout 215 \
        --title "Qwen3-8B, partial offload (0.55), 1 H200, 2 x 16 without checkpointing (auto's choice), delayed update"
    fi
    ;;
  zero3-4gpu)  # Qwen3-8B, configs/zero3.json, 4 GPUs, 262,144 tokens per step at 4 x 4, the parameters partitioned
    # (persistence at Hugging Face's 10 x hidden): ours with the layers compiled (each a ZeRO-3 leaf module) and eager
    # (hooks on every submodule), then HF Trainer + DeepSpeed + Liger at 4 x 4, its best (8 does not fit without
    # checkpointing), one invocation (~8 min)
    bench q8b_zero3_4gpu 540 --nproc 4 --model qwen3-8b --ds_config configs/zero3.json --global_batch_tokens 262144 \
      --micro_batch_size 4 --steps 3 --warmup 2 --timeout 200 --variants default eager_layers --compare-hf \
      --hf-skip noliger --ds-set zero_optimization.stage3_param_persistence_threshold=40960 \
      --title "Qwen3-8B, ZeRO-3, 4 GPUs, 262,144 tokens per step, partitioned: compiled and eager layers, HF + Liger"
    ;;
  zero3-whole)  # configs/zero3.json on 4 GPUs, 262,144 tokens per step at 4 x 4, the default path (on 4 H200s "auto"
    # keeps every parameter whole) against HF Trainer + DeepSpeed + Liger at 4 x 4, the Llama-2-7B-shaped preset, then
    # Qwen3-8B (~7 min)
    for model in llama-7b qwen3-8b; do
      W=(--nproc 4 --model "$model" --ds_config configs/zero3.json --global_batch_tokens 262144 --micro_batch_size 4
         --steps 3 --warmup 2 --timeout 170)
      bench "${model}_zero3_whole" 150 "${W[@]}" --variants default \
        --title "$model, ZeRO-3, 4 GPUs, 4 x 4, the default path (whole parameters where they fit)"
      bench "${model}_zero3_peer" 110 "${W[@]}" --variants --compare-hf --hf-skip noliger \
        --title "$model, ZeRO-3, 4 GPUs, 4 x 4: HF + Liger"
    done
    ;;
  zero3-4gpu-profile)  # Qwen3-8B, configs/zero3.json, 4 GPUs, 262,144 tokens per step at 4 x 4, the default path: where
    # rank 0's step goes (each phase synchronised, then kernels, host operators and the GPU's idle gaps by phase) (~5 min)
    bench q8b_zero3_profile 300 --nproc 4 --model qwen3-8b --ds_config configs/zero3.json --global_batch_tokens 262144 \
      --micro_batch_size 4 --steps 2 --warmup 1 --profile --timeout 280 --variants default \
      --title "Qwen3-8B, ZeRO-3, 4 GPUs: where a step goes"
    ;;
  zero3-scaling)  # Qwen3-0.6B (the ZeRO-2 scaling's model), configs/zero3.json, micro-batch 8 x 4096: tokens/s per GPU
    # on 1, 2 and 4 GPUs (as many as the machine has) at 1 and at 4 micro-batches per step, then ZeRO-2
    # (ds_config.json) on 4 and 1 at 1 (~1-1.5 min each once compiled; the first run compiles: ~2 min)
    gpus=$(nvidia-smi -L | wc -l)
    S=(--model qwen3-0.6b --micro_batch_size 8 --steps 6 --warmup 2 --timeout 200 --variants default)
    for accumulation in 1 4; do
      for n in 1 2 4; do
        ((n <= gpus)) || continue
        bench "q06_zero3_${n}gpu_acc${accumulation}" 100 --nproc "$n" "${S[@]}" --ds_config configs/zero3.json \
          --global_batch_tokens $((n * accumulation * 8 * 4096)) \
          --title "Qwen3-0.6B, ZeRO-3, $n GPU(s), 8 x $accumulation x 4096 tokens per GPU and step"
      done
    done
    for n in 4 1; do
      ((n <= gpus)) || continue
      bench "q06_zero2_${n}gpu" 80 --nproc "$n" "${S[@]}" --global_batch_tokens $((n * 8 * 4096)) \
        --title "Qwen3-0.6B, ZeRO-2 (ds_config.json), $n GPU(s), 8 x 4096 tokens per GPU and step"
    done
    ;;
  zero3-vs-zero2)  # Z2_MODEL (the Llama-2-7B-shaped preset; qwen3-8b too) on 4 GPUs, 262,144 tokens per step at one
    # micro-batch (4 on an H200, 2 on an H100, where whole ZeRO-3 parameters fit): configs/zero3.json (whole
    # parameters) against ds_config.json (ZeRO-2), which the preflight names where both fit (~6 min)
    : "${Z2_MODEL:=llama-7b}"
    mb=2; (($(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1) > 100000)) && mb=4
    for config in configs/zero3.json ds_config.json; do
      # ZeRO-2's engine sets up in ~110 s at 7B (ZeRO-3's in ~20 s), and 8B's did not reach its timed steps in 170 s
      bench "${Z2_MODEL}_$(basename "$config" .json)_mb$mb" 250 --nproc 4 --model "$Z2_MODEL" --ds_config "$config" \
        --global_batch_tokens 262144 --micro_batch_size "$mb" --steps 3 --warmup 2 --timeout 240 --variants default \
        --title "$Z2_MODEL, 4 GPUs, $mb x $((262144 / (4 * 4096 * mb))): $config"
    done
    ;;
  zero3-h100)  # configs/zero3.json on 4 H100s, 262,144 tokens per step: ours at the automatic micro-batch (whole
    # parameters at 2 x 8 for the Llama-shaped preset, 1 x 16 for Qwen3-8B) against HF Trainer + DeepSpeed + Liger at
    # 2 x 8, its largest without checkpointing (at 1 x 16 where 2 runs out of memory), each of Z3_MODELS in turn
    # (~4.5 min a model)
    read -r -a models <<<"${Z3_MODELS:-llama-7b qwen3-8b}"
    for model in "${models[@]}"; do
      H=(--nproc 4 --model "$model" --ds_config configs/zero3.json --global_batch_tokens 262144 --steps 3 --warmup 2
         --timeout 170)
      bench "${model}_zero3_auto" 150 "${H[@]}" --variants default \
        --title "$model, ZeRO-3, 4 GPUs, the automatic micro-batch (whole parameters where they fit)"
      bench "${model}_zero3_peer" 100 "${H[@]}" --micro_batch_size 2 --variants --compare-hf --hf-skip noliger \
        --title "$model, ZeRO-3, 4 GPUs, 2 x 8: HF + Liger"
      if grep -q "out of memory" "$OUT/${model}_zero3_peer.txt" 2>/dev/null; then
        bench "${model}_zero3_peer_mb1" 100 "${H[@]}" --micro_batch_size 1 --variants --compare-hf --hf-skip noliger \
          --title "$model, ZeRO-3, 4 GPUs, 1 x 16: HF + Liger"
      fi
    done
    ;;
  zero3-levers)  # Qwen3-8B, configs/zero3.json, 262,144 tokens per step at 4 x 4 on 4 GPUs, the parameters
    # partitioned (the levers act on their gathers): the default path with one DeepSpeed lever changed each (the
    # prefetch bucket at Hugging Face's 0.9 h^2 instead of one layer; ZeRO++'s quantized weights, qwZ; its quantized
    # gradients, qgZ: both change the numerics), then 50 steps of Qwen3-0.6B under ZeRO-3 on 4 GPUs against the
    # unoptimised path where time is left (~8 min for the three levers); the partitioned baseline is PLAN=zero3-4gpu's
    Z3_8B=(--nproc 4 --model qwen3-8b --ds_config configs/zero3.json --global_batch_tokens 262144 --micro_batch_size 4
           --steps 3 --warmup 2 --timeout 170 --variants default)
    # one --ds-set for both settings: of several, the last one given counts
    partitioned=zero_optimization.stage3_param_persistence_threshold=40960
    prefix=zero_optimization
    bench q8b_zero3_prefetch_h2 175 "${Z3_8B[@]}" --ds-set "$partitioned" "$prefix.stage3_prefetch_bucket_size=15099494" \
      --title "Qwen3-8B, ZeRO-3, 4 GPUs: the prefetch bucket at 0.9 h^2"
    bench q8b_zero3_qwz 175 "${Z3_8B[@]}" --ds-set "$partitioned" "$prefix.zero_quantized_weights=true" \
      --title "Qwen3-8B, ZeRO-3, 4 GPUs: ZeRO++ quantized weights"
    bench q8b_zero3_qgz 175 "${Z3_8B[@]}" --ds-set "$partitioned" "$prefix.zero_quantized_gradients=true" \
      --title "Qwen3-8B, ZeRO-3, 4 GPUs: ZeRO++ quantized gradients"
    bench q06_zero3_losses 175 --nproc 4 --model qwen3-0.6b --ds_config configs/zero3.json --steps 1 --warmup 1 \
      --variants --loss-check 50 --loss-check-mb 2 --loss-check-variants default --timeout 170 \
      --title "ZeRO-3, 4 GPUs: 50 steps of the default path against the unoptimised one"
    ;;
  zero3-2gpu)  # Qwen3-8B, configs/zero3.json, 262,144 tokens per step at 4 x 8 on 2 GPUs: ours, then HF Trainer +
    # DeepSpeed + Liger at 4 x 8, one invocation (~6 min): the 2-GPU row beside zero3-4gpu's
    bench q8b_zero3_2gpu 400 --nproc 2 --model qwen3-8b --ds_config configs/zero3.json --global_batch_tokens 262144 \
      --micro_batch_size 4 --steps 2 --warmup 2 --timeout 200 --variants default --compare-hf --hf-skip noliger \
      --title "Qwen3-8B, ZeRO-3, 2 GPUs, 262,144 tokens per step: ours and HF + Liger at 4 x 8"
    ;;
  scale)  # per-GPU scaling on 1/2/4 H200 (default path), Qwen3-8B ZeRO-3, the loss check, then the peers if time
    C=(--steps 6 --warmup 3 --timeout 150 --variants default)
    bench h200_1gpu 60 --nproc 1 --micro_batch_size 8 "${C[@]}" --title "Qwen3-0.6B, 1 H200, default path"
    bench h200_2gpu 50 --nproc 2 --micro_batch_size 8 "${C[@]}" --title "Qwen3-0.6B, 2 H200, default path"
    bench h200_4gpu 55 --nproc 4 --micro_batch_size 8 "${C[@]}" --title "Qwen3-0.6B, 4 H200, default path"
    bench q8b_zero3 80 --nproc 4 --model qwen3-8b --ds_config configs/zero3.json --micro_batch_size 2 --steps 4 --warmup 2 --timeout 200 --variants default --title "Qwen3-8B, ZeRO-3, 4 H200"
    bench losscheck 130 --nproc 1 --model qwen3-0.6b --steps 1 --warmup 1 --variants --loss-check 50 --loss-check-mb 2 --loss-check-variants default --timeout 150 --title "Loss check, 1 H200"
    bench h200_1gpu_hf 90 --nproc 1 --micro_batch_size 8 --steps 6 --warmup 3 --timeout 150 --variants --compare-hf --title "HF Trainer + DeepSpeed (with and without Liger), micro-batch 8, 1 H200"
    bench h200_4gpu_z1 55 --nproc 4 --micro_batch_size 8 "${C[@]}" --zero_stage 1 --title "Qwen3-0.6B, 4 H200, ZeRO-1"
    ;;
  layout-rounds)  # the same default path from two trees in turn: BEFORE (another commit's tree, e.g. `git archive REV
    # src benchmarks | tar x -C .before`) and this one, Qwen3-0.6B at micro-batch 16 on one GPU, ROUNDS rounds (~70 s each)
    for round in $(seq "${ROUNDS:=2}"); do
      run_bench "${BEFORE:=.before}/benchmarks/bench.py" "before-$round" 110 --nproc 1 --model qwen3-0.6b \
        --micro_batch_size 16 --steps 20 --warmup 3 --variants default --timeout 150 --title "before, round $round"
      bench "after-$round" 110 --nproc 1 --model qwen3-0.6b --micro_batch_size 16 --steps 20 --warmup 3 \
        --variants default --timeout 150 --title "after, round $round"
    done
    ;;
  long-context)  # sequence parallelism on 2 GPUs (benchmarks/long_context.py): the loss of Qwen3-0.6B at 16,384 tokens
    # split across 2 GPUs against one GPU holding them (30 steps each), then the longest llama-1b-shaped sequence one
    # optimizer step trains on 1 GPU and split across 2, activation checkpointing on (~8 min)
    run_bench benchmarks/long_context.py parity 200 --model qwen3-0.6b --seq_len 16384 --sequence_parallel 1 2 --steps 30 --skip 3 \
      --title "Qwen3-0.6B, 16,384 tokens: one GPU against 2 splitting each sequence"
    run_bench benchmarks/long_context.py lengths-1gpu 150 --model llama-1b --seq_len 65536 131072 --sequence_parallel 1 --steps 3 \
      --stop-at-oom --timeout 200 --title "llama-1b, one GPU" -- --gradient_checkpointing
    run_bench benchmarks/long_context.py lengths-2gpu 150 --model llama-1b --seq_len 131072 --sequence_parallel 2 --steps 3 \
      --stop-at-oom --timeout 200 --title "llama-1b, 2 GPUs splitting each sequence" -- --gradient_checkpointing
    ;;
  long-context-memory)  # one GPU at 131,072 tokens (llama-1b shape, checkpointing) with and without the recomputed
    # layers' inputs offloaded to host memory, then 262,144 tokens (--rope_scaling yarn:2) split across 2 GPUs with
    # them offloaded; SDPA on all, the layers eager (reentrant checkpointing under torch.compile is not measured) (~7 min)
    LC=(--model llama-1b --steps 3 --timeout 240)
    run_bench benchmarks/long_context.py offload-1gpu 120 "${LC[@]}" --seq_len 131072 --sequence_parallel 1 \
      --title "llama-1b, 131,072, one GPU, inputs offloaded" -- --gradient_checkpointing --offload_activations --compile off
    run_bench benchmarks/long_context.py kept-1gpu 120 "${LC[@]}" --seq_len 131072 --sequence_parallel 1 \
      --title "llama-1b, 131,072, one GPU, inputs kept" -- --gradient_checkpointing --compile off
    run_bench benchmarks/long_context.py offload-2gpu 150 "${LC[@]}" --seq_len 262144 --sequence_parallel 2 \
      --title "llama-1b, 262,144, 2 GPUs split, inputs offloaded" -- --gradient_checkpointing --offload_activations \
      --compile off --rope_scaling yarn:2
    ;;
  long-context-8b)  # the Llama-3.1-8B shape (llama-8b, --rope_scaling yarn:2) at 262,144 tokens: one GPU (ZeRO-3 with
    # parameters and optimizer offloaded, its first step: a run of 2, since the schedule's warm-up step must be shorter
    # than the run) beside two GPUs splitting each sequence (configs/zero3.json, two steps), checkpointing on, each run
    # ended once its steps are logged (an 8B save is not what is measured); the one-GPU run eager (--compile off: its one
    # step would otherwise time the compilation too) (~6 min)
    LC8=(--model llama-8b --seq_len "${LC8_SEQ_LEN:-262144}" --steps 2 --timeout "${LC8_TIMEOUT:-530}")
    LC8_TRAINER=(-- --gradient_checkpointing --rope_scaling yarn:"${LC8_ROPE:-2}")
    CUDA_VISIBLE_DEVICES=0 run_bench benchmarks/long_context.py llama-8b-1gpu 300 "${LC8[@]}" --sequence_parallel 1 \
      --stop-after-steps 1 --skip 0 \
      --ds_config configs/zero3-offload.json --workdir /tmp/lc-1gpu --title "llama-8b, one GPU, offloaded" \
      "${LC8_TRAINER[@]}" --compile off &
    CUDA_VISIBLE_DEVICES=1,2 run_bench benchmarks/long_context.py llama-8b-2gpu 300 "${LC8[@]}" --sequence_parallel 2 \
      --stop-after-steps \
      --ds_config configs/zero3.json --workdir /tmp/lc-2gpu --title "llama-8b, 2 GPUs splitting each sequence" \
      "${LC8_TRAINER[@]}" &
    wait
    ;;
  long-context-lora)  # llama-8b (--rope_scaling yarn:2) at LCL_SEQ_LEN tokens on one GPU each, LoRA of rank 16: the
    # frozen weights on the GPU (ds_config.json: ZeRO-2), each recomputed layer's input in pinned host memory
    # (--offload_activations), --tiled_mlp LCL_TILED_MLP (auto: tiles, for LoRA; off: the MLPs whole), checkpointing;
    # on GPU 0 eager, its first step; beside it on GPU 1 (where there is one) compiled, its first two steps; each
    # run's host peak against a one-GPU machine's 128 GiB (~8 min)
    LCL=(--model llama-8b --seq_len "${LCL_SEQ_LEN:-262144}" --sequence_parallel 1 --steps 2 --skip 0
         --ds_config ds_config.json --timeout "${LCL_TIMEOUT:-520}")
    LCL_TRAINER=(-- --gradient_checkpointing --rope_scaling yarn:2 --offload_activations --lora_rank 16
                 --tiled_mlp "${LCL_TILED_MLP:-auto}")
    CUDA_VISIBLE_DEVICES=0 run_bench benchmarks/long_context.py lora-1gpu-eager 300 "${LCL[@]}" --stop-after-steps 1 \
      --workdir /tmp/lcl-eager --title "llama-8b LoRA, one GPU, eager" "${LCL_TRAINER[@]}" --compile off &
    if (($(nvidia-smi -L | wc -l) > 1)); then
      CUDA_VISIBLE_DEVICES=1 run_bench benchmarks/long_context.py lora-1gpu-compiled 300 "${LCL[@]}" --stop-after-steps \
        --workdir /tmp/lcl-compiled --title "llama-8b LoRA, one GPU, compiled" "${LCL_TRAINER[@]}" &
    fi
    wait
    ;;
  long-context-one-gpu)  # issue 59's one-GPU goal on an 80 GB H100's memory (GPU_MEMORY_GIB=79.2 on a larger GPU: each
    # run plans for it and its allocator is held to it), both sides with expandable segments (the allocator's setting
    # for long sequences): llama-8b LoRA rank 16 (RoPE scaled by YaRN to the length, checkpointing, ds_config.json), one
    # optimizer step each, ended once it is logged: ours at LC1_SEQ_LEN (360,448 by default; 401,408, the longest
    # measured, with LC1_TIMEOUT=555 BUDGET=575) with its offloaded tensors in pinned host memory and the MLPs tiled
    # (auto), its layers as LC1_COMPILE says (off: eager, as measured; auto: compiled, the default a user gets),
    # attention as LC1_ATTENTION says (sdpa: PyTorch's, as the peer's; auto: flash-attn-4 where installed); the peer (HF
    # Trainer + DeepSpeed + Liger, no sequence parallelism, the same adapters) at LC1_PEER_SEQ_LENS until it runs out of
    # memory (114,688 by default: it trains, 131,072 does not, as measured), after ours where the run's BUDGET leaves
    # time; the preflight at twice ours (ours alone takes ~8 min at 360,448: ~2 to start, ~6 for its step; the peer ~2.5
    # min: LC1_SIDES="ours" or "peer" runs one side per run)
    export GPU_MEMORY_GIB=${LC1_GPU_MEMORY_GIB:-79.2} PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
    : "${LC1_COMPILE:=off}" "${LC1_ATTENTION:=sdpa}"
    read -r -a lc1_peer_lens <<<"${LC1_PEER_SEQ_LENS:-114688}"
    LC1=(--model llama-8b --sequence_parallel 1 --ds_config ds_config.json --steps 2 --skip 0 --stop-after-steps 1)
    : "${LC1_SEQ_LEN:=360448}"
    lc1_yarn=$(((LC1_SEQ_LEN + 131071) / 131072))  # Llama 3.1's 131,072 positions, scaled to hold the sequence
    LC1_TRAINER=(-- --gradient_checkpointing --rope_scaling "yarn:$lc1_yarn" --lora_rank 16)
    lc1_sides=" ${LC1_SIDES:-ours peer} "
    [[ $lc1_sides == *" ours "* ]] && run_bench benchmarks/long_context.py lc1-ours 240 "${LC1[@]}" --seq_len "$LC1_SEQ_LEN" \
      --timeout "${LC1_TIMEOUT:-480}" --workdir /tmp/lc1-ours \
      --title "ours, LoRA, one GPU held to $GPU_MEMORY_GIB GiB, inputs offloaded, MLPs tiled (auto), --compile $LC1_COMPILE, attention $LC1_ATTENTION" \
      "${LC1_TRAINER[@]}" --offload_activations --tiled_mlp auto --compile "$LC1_COMPILE" --attention_kernel "$LC1_ATTENTION"
    [[ $lc1_sides == *" peer "* ]] && run_bench benchmarks/long_context.py lc1-peer 90 "${LC1[@]}" --seq_len "${lc1_peer_lens[@]}" --peer --stop-at-oom \
      --timeout "${LC1_PEER_TIMEOUT:-240}" --workdir /tmp/lc1-peer \
      --title "HF Trainer + DeepSpeed + Liger, LoRA, one GPU held to $GPU_MEMORY_GIB GiB" "${LC1_TRAINER[@]}"
    if (($(date +%s) - START + 60 < BUDGET)); then
      python3 src/train_deepspeed.py --model llama-8b --seq_len $((2 * LC1_SEQ_LEN)) --rope_scaling "yarn:$((2 * lc1_yarn))" \
        --gradient_checkpointing --lora_rank 16 --offload_activations --dummy_data 8 --preflight 2>&1 \
        | tee "$OUT/lc1-preflight-past-longest.txt" | grep -E "long sequences|needs|fix|host" | cut -c1-400
    else
      echo "SKIP the preflight past the longest (BUDGET)"
    fi
    unset GPU_MEMORY_GIB PYTORCH_CUDA_ALLOC_CONF
    ;;
  zero3-one-gpu)  # configs/zero3.json against ds_config.json (ZeRO-2) on one GPU held to an H100's 79.2 GiB: the
    # long-sft journey's settings on random blocks (llama-8b, LoRA rank 16, 65,536 tokens, checkpointing, inputs
    # offloaded, MLPs tiled (auto), eager), 2 steps each, the second timed (~5 min)
    export GPU_MEMORY_GIB=79.2 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
    for cfg in configs/zero3.json ds_config.json; do
      name=lc65-$(basename "$cfg" .json)
      run_bench benchmarks/long_context.py "$name" 150 --model llama-8b --sequence_parallel 1 --ds_config "$cfg" \
        --steps 2 --skip 1 --stop-after-steps --seq_len 65536 --timeout 185 --workdir "/tmp/$name" \
        --title "ours, LoRA, 65,536 tokens, $cfg, journey settings (offload, tiled auto, eager)" \
        -- --gradient_checkpointing --lora_rank 16 --offload_activations --tiled_mlp auto --compile off
    done
    unset GPU_MEMORY_GIB PYTORCH_CUDA_ALLOC_CONF
    ;;
  long-context-peer)  # ours against Hugging Face Trainer's Ulysses path (long_context_peer.py: accelerate's
    # ParallelismConfig as transformers' guide sets it, SDPA, Liger, checkpointing), LC_MODEL split over LC_GPUS GPUs,
    # configs/zero3.json, 2 steps each stopped before the final save: ours at LC_SEQ_LENS, the peer at LC_PEER_SEQ_LENS
    # until one runs out of memory (its longest) (~9 min for llama-8b on 4 GPUs)
    read -r -a lc_lens <<<"${LC_SEQ_LENS:-131072}"; read -r -a lc_peer_lens <<<"${LC_PEER_SEQ_LENS:-131072 262144}"
    LCP=(--model "${LC_MODEL:-llama-8b}" --sequence_parallel "${LC_GPUS:-4}" --ds_config configs/zero3.json --steps 2
         --stop-after-steps --timeout "${LC_TIMEOUT:-250}")
    run_bench benchmarks/long_context.py lc-ours 150 "${LCP[@]}" --seq_len "${lc_lens[@]}" \
      --title "ours, ${LC_GPUS:-4} GPUs splitting each sequence" -- --gradient_checkpointing --rope_scaling yarn:2
    run_bench benchmarks/long_context.py lc-peer 150 "${LCP[@]}" --seq_len "${lc_peer_lens[@]}" --peer --stop-at-oom \
      --title "HF Trainer + DeepSpeed Ulysses, ${LC_GPUS:-4} GPUs" -- --gradient_checkpointing --rope_scaling yarn:2
    ;;
  document-attention)  # attention within documents alone (benchmarks/attention.py): the dense mask, FlashAttention-4's
    # variable-length kernels, PyTorch's varlen_attn and SDPA once per document, outputs and gradients against the
    # mask's, at the 7B fine-tuning journey's shape (examples of ~600 tokens) and Qwen3-0.6B's (~2 min)
    python3 benchmarks/attention.py --batch 5 --heads 32 --kv_heads 32 --document_length 600 | tee "$OUT/attn-sft-7b.txt"
    python3 benchmarks/attention.py --batch 8 --heads 16 --kv_heads 8 --document_length 1000 \
      | tee "$OUT/attn-qwen3-0.6b.txt"
    ;;
  save-stall)  # one rank's host copy of a 7B ZeRO-3 state on 4 GPUs (23 GiB), first and second save, by each way of
    # pinning (benchmarks/save_stall.py, ~1-2 min)
    timeout 200 python3 benchmarks/save_stall.py --gpus 4 --json "$OUT/save-stall.jsonl" 2>&1 \
      | tee -a "$OUT/save-stall.txt"
    ;;
  host-memory)  # touch HOST_MEMORY_GIB (default 180) of host memory on 16 threads, then free it: a machine whose memory
    # grows as it is used (KINDS.md: MemTotal starts at 31 GiB) then shows its room to the preflight's MemAvailable; nothing
    # where MemTotal reads HOST_MEMORY_GIB already
    grep -E "MemTotal|MemAvailable" /proc/meminfo
    (($(awk '/MemTotal/ {print int($2 / 2^20)}' /proc/meminfo) < ${HOST_MEMORY_GIB:-180})) && python3 - "${HOST_MEMORY_GIB:-180}" <<'EOF'
import sys, time
from concurrent.futures import ThreadPoolExecutor
import torch
gib = int(sys.argv[1]); t = time.perf_counter()
with ThreadPoolExecutor(16) as pool:
    chunks = list(pool.map(lambda _: torch.ones(2**30, dtype=torch.uint8), range(gib)))
print(f"touched {gib} GiB in {time.perf_counter() - t:.1f}s")
EOF
    grep -E "MemTotal|MemAvailable" /proc/meminfo
    ;;
  parallel)  # GPUn_PLANS on GPU n beside those of the others, each GPU's in turn, with its SFT modes GPUn_SFT_MODES and
    # its settings GPUn_ENV (NAME=VALUE words, e.g. "SFT_SKIP=ours SFT_PEER_MB=4"): one-GPU measurements at once on a
    # machine of several GPUs (each side-by-side pair on one GPU, or its sides on two GPUs of the same node)
    gpus=$(nvidia-smi --list-gpus | wc -l)
    for ((gpu = 0; gpu < gpus; gpu++)); do
      plans_var="GPU${gpu}_PLANS" modes_var="GPU${gpu}_SFT_MODES" env_var="GPU${gpu}_ENV"
      [ -n "${!plans_var:-}" ] || continue
      (
        export CUDA_VISIBLE_DEVICES=$gpu SFT_MODES=${!modes_var:-$SFT_MODES} SFT_TAG=-gpu$gpu
        # shellcheck disable=SC2086  # NAME=VALUE words
        [ -z "${!env_var:-}" ] || export ${!env_var}
        sft_args
        for plan in ${!plans_var}; do
          if (($(date +%s) - START + 90 > BUDGET)); then echo "SKIP $plan on GPU $gpu"; continue; fi
          run_plan "$plan"
        done
      ) >"$OUT/gpu$gpu.txt" 2>&1 &
    done
    wait
    cat "$OUT"/gpu*.txt
    ;;
  *) eval "$1" ;;  # a custom plan: shell commands that may use bench()
esac
}
if [ -n "${PLANS:-}" ]; then
  for plan in $PLANS; do run_plan "$plan"; done
else
  run_plan "${PLAN:-h100}"
fi
echo "=== done $(($(date +%s) - START))s"
# $OUT ends as one archive (all.tgz): one file to copy off the node, however many logs the plans wrote.
(cd "$OUT" && tar czf /tmp/all.tgz . && find . -mindepth 1 -delete && mv /tmp/all.tgz .)
