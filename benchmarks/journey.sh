#!/usr/bin/env bash
# The user journeys on one GPU machine, each run through ./train-singlenode.sh to its end, one line per run:
#
#   default     Qwen3-0.6B at the automatic micro-batch: train, evaluate, checkpoint, export, generate
#   resume      the same checkpoint directory, more steps: resumes from default's last checkpoint
#   delayed     ZeRO-2 + optimizer offload with --delayed_update_from_step 5: train to 30, then resume to 40
#   zero3-offload  ZeRO-3 + parameter and optimizer offload, accumulating 4 micro-batches: train to 6, resume to 12
#   zero3-delayed  the same with --delayed_update_from_step 3
#   zero3-large JOURNEY_LARGE_MODEL (Qwen3-4B) at the recommended ZeRO-3 + offload settings: --gradient_checkpointing,
#               the automatic micro-batch (16 x 2 at 131,072 tokens per step on one H100) and checkpointed layers (the
#               fewest that fit), the delayed update from step 2; train 4 steps, save (55 GiB), evaluate, export
#               (7.5 GiB) and generate
#   zero3-large-resume  resumed from zero3-large's checkpoint into a directory of JOURNEY_RESUME_ROOT and killed with
#               SIGKILL once its first step is logged, before its own checkpoint (a second does not fit a 64 GiB disk)
#   zero2-large JOURNEY_LARGE_MODEL at the recommended ZeRO-2 + optimizer offload settings (configs/zero2-offload.json):
#               the automatic micro-batch (4 x 8 at 131,072 tokens per step on one H100, the fastest measured; the
#               prefetch does not fit beside it), the delayed update from step 2; train 4 steps, save (55 GiB),
#               evaluate, export (7.5 GiB) and generate
#   zero2-large-resume  the same from zero2-large's checkpoint
#   presets     every configs/*.json (ZeRO-1, ZeRO-2 + optimizer offload, ZeRO-3, ZeRO-3 + offload, fp16)
#   documents   --document_mask
#   checkpointing  --gradient_checkpointing
#   finetune    the model default exported, fine-tuned (MODEL=<its hf directory>)
#   saves       a save every 10 steps, in the background and synchronously: how long training stands still per save
#   saves-large one save of JOURNEY_LARGE_MODEL (Qwen3-4B: 55 GiB, one fits the disk) with ZeRO-2 + optimizer offload
#   seeds-large the seeds' shape: JOURNEY_SEEDS_MODEL (llama-7b: Llama 2 7B's dimensions, random weights written once
#               as a Hugging Face model, the stand-in for a hub checkpoint) fine-tuned on the embedded chats with
#               configs/zero3.json on every GPU of the node at the automatic micro-batch: 2 steps, save (~88 GiB)
#   seeds-large-resume  the same directory resumed to step 3: evaluate, save (the older checkpoint then deleted),
#               ZeRO-3 export, a sample; then `python -m model_utils.generate --chat` on the export
#               (JOURNEY_ONLY="seeds-large seeds-large-resume" runs the pair; where one run's time limit does not hold
#               both, JOURNEY_ONLY=seeds-large JOURNEY_KEEP_LARGE=1, then JOURNEY_ONLY=seeds-large-resume)
#   sft-lora    JOURNEY_SFT_MODEL (llama-1b: Llama 3.2 1B's dimensions, random weights written once as a Hugging Face
#               model) fine-tuned with LoRA (rank 16) on the embedded chats at 2048 tokens, the automatic micro-batch:
#               6 steps with a checkpoint at 4, evaluation, the adapter and the merged model exported
#   sft-lora-resume  the same run resumed to step 8, then the merged export prompted through
#               `python -m model_utils.generate --chat`, and the adapter loaded by peft on the base model beside the
#               merged model (their logits' largest difference printed)
#   seeds-speed the seeds' shape at speed: JOURNEY_SEEDS_MODEL fine-tuned on the embedded chats with configs/zero3.json
#               on every GPU, once per --attention_kernel of JOURNEY_SEEDS_KERNELS (varlen: FlashAttention-4 off, the
#               stand-in for GPUs before Hopper; fa4), JOURNEY_SEEDS_STEPS steps and the last step's checkpoint, killed
#               (SIGKILL) once its host copy is done (the training stall), before its writes end: the steady tokens/s
#               and MFU, the stall (a 128 GiB disk holds one 7B checkpoint: no periodic saves)
#   long-sft    long-context fine-tuning: JOURNEY_LONG_MODEL (llama-8b: Llama 3.1 8B's dimensions, random weights written
#               once as a Hugging Face model) on chats of ~JOURNEY_LONG_TOKENS tokens (benchmarks/long_chats.py: standard-
#               library modules and a question on a function of one of them), each sequence split over
#               JOURNEY_LONG_SP GPUs (default: all), configs/zero3.json (ds_config.json on a node of one GPU),
#               checkpointing, LoRA of rank JOURNEY_LONG_LORA (0: full fine-tuning, whose two 8B checkpoints a 235 GiB
#               disk does not hold beside the model): 3 steps, evaluate, save; resumed to 6 and killed (SIGKILL) once
#               step 5 is logged; resumed again to 6: the step 4-5 losses against the killed run's (step 4 bit for
#               bit, step 5 within bf16 noise on GPUs), evaluate, save, export, a sample, then
#               `python -m model_utils.generate --chat` on the export
#   qlora       the seeds' small GPU: JOURNEY_QLORA_MODEL (llama-8b: Llama 3.1 8B's dimensions, random weights written
#               once as a Hugging Face model, loaded in 4 bits as a hub checkpoint is; a preset's own random init runs
#               on the host's CPU, minutes for 8B) with LoRA of rank 16 on
#               a 4-bit base (--load_in_4bit), the GPU held to JOURNEY_QLORA_GPU_GIB (15: a T4's 16 GB) in
#               JOURNEY_QLORA_DS_CONFIG's precision (configs/fp16.json: a T4 has no bf16), 2048-token chats at the
#               automatic micro-batch: the preflight's plan without a GPU (a login node), then 6 steps with an evaluation
#               and a checkpoint at 3, killed (SIGKILL) once step 5 is logged; resumed to 6: the step 4-5 losses
#               against the killed run's, evaluate, save, the merged model exported; then `python -m
#               model_utils.generate --chat` on the export (the resume prints no sample: loading the export beside the
#               engine needs ~21 GiB)
#   qlora-l40   the same on an L40's 48 GB: the GPU held to 44 GiB, in bf16 (ds_config.json)
#   vlm         the seeds' multimodal user on one node: JOURNEY_VLM_MODEL (qwen2.5-vl-7b: Qwen2.5-VL 7B's dimensions,
#               random weights written once as a Hugging Face model with its processor) fine-tuned on the embedded
#               picture questions (embedded-vision: some rows without an image) with configs/zero3.json, LoRA of rank
#               16 on the language model beside the frozen vision tower, checkpointing, JOURNEY_VLM_SEQ_LEN tokens, the
#               automatic micro-batch: the preflight's plan, then 6 steps with an evaluation and a checkpoint at 3,
#               killed (SIGKILL) once step 5 is logged; resumed to 6: the step 4-5 losses against the killed run's,
#               evaluate, save, the merged model exported with its processor; then `python -m model_utils.generate
#               --image FILE --chat` on the export
#   fp16        benchmarks/fp16_check.py on the first GPU: the tiny preset in fp16, its loss scale logged, overflows
#               skipped and counted, a kill -9 and resume continuing the scale and the losses exactly
#
#   bash benchmarks/journey.sh                       # all of them (~45 min on one H100: docs/JOURNEY.md walls)
#   JOURNEY_ONLY="presets" bash benchmarks/journey.sh
#
# Rerun it whenever the GPU path changes; docs/JOURNEY.md holds its latest output.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

: "${JOURNEY_MODEL:=qwen3-0.6b}"
: "${JOURNEY_MICRO_BATCH:=auto}" # the presets' own choice (16 for Qwen3-0.6B on one H100, the fastest measured)
: "${JOURNEY_DIR:=/tmp/journey}"
: "${JOURNEY_LARGE_MODEL:=qwen3-4b}" # saves-large: configs/zero2-offload.json, micro-batch 1, activation checkpointing
: "${JOURNEY_RESUME_ROOT:=$JOURNEY_DIR}" # holds the *-large-resume journeys' checkpoint directories (room for one more)
: "${JOURNEY_SEEDS_MODEL:=llama-7b}" # seeds-large: a preset written as a Hugging Face model, or a model directory
: "${JOURNEY_SEEDS_KERNELS:=varlen fa4}" # seeds-speed: the attention kernels, one run each
: "${JOURNEY_SEEDS_STEPS:=16}" # seeds-speed: steps before its checkpoint
: "${JOURNEY_MEASURE_SECONDS:=300}" # seeds-speed: a run not at its pattern by then is killed
: "${JOURNEY_SFT_MODEL:=llama-1b}" # sft-lora: a preset written as a Hugging Face model, or a model directory
: "${JOURNEY_WRITES:=background synchronous}" # the saves journeys' ways of writing checkpoints
: "${JOURNEY_ONLY:=}" # names of the journeys to run (space-separated); empty: all
: "${JOURNEY_KEEP_LARGE:=0}" # 1: a *-large journey's checkpoint stays for its -resume in a later invocation
: "${JOURNEY_QLORA_MODEL:=llama-8b}" # qlora: a preset written as a Hugging Face model, or a model directory
: "${JOURNEY_QLORA_GPU_GIB:=15}" # qlora: the GPU memory it may use (GPU_MEMORY_GIB; qlora-l40: 44)
: "${JOURNEY_QLORA_DS_CONFIG:=configs/fp16.json}" # qlora: its precision (qlora-l40: ds_config.json, bf16)
: "${JOURNEY_QLORA_FLAGS:=}" # qlora, qlora-l40: more trainer flags, e.g. "--micro_batch_size 4" (split on spaces)
: "${JOURNEY_VLM_MODEL:=qwen2.5-vl-7b}" # vlm: a vision preset written as a Hugging Face model, or a model directory
: "${JOURNEY_VLM_SEQ_LEN:=2048}" # vlm: the block length (images resized to at most a quarter of it in tokens)
: "${JOURNEY_LONG_MODEL:=llama-8b}" # long-sft: a preset written as a Hugging Face model, or a model directory
: "${JOURNEY_LONG_TOKENS:=131072}" # long-sft: the sequence length; its chats are about this long
: "${JOURNEY_LONG_SP:=0}" # long-sft: GPUs per sequence (0: every GPU of the node)
: "${JOURNEY_LONG_LORA:=16}" # long-sft: the LoRA rank (0: full fine-tuning)
: "${JOURNEY_LONG_FLAGS:=}" # long-sft: more trainer flags, e.g. "--offload_activations" (split on spaces)
: "${JOURNEY_LONG_DS_CONFIG:=}" # long-sft: empty: configs/zero3.json, ds_config.json (ZeRO-2) on a node of one GPU

mkdir -p "$JOURNEY_DIR"
failed=0

wanted() { [[ -z $JOURNEY_ONLY || " $JOURNEY_ONLY " == *" $1 "* ]]; }

# launch MODE NAME CHECKPOINT_DIR ENV-ASSIGNMENTS... -- TRAINER-FLAGS...: the launcher, its output in JOURNEY_DIR/NAME.log.
# MODE foreground: waits for it, its exit status in launched_status; detached: in the background in a process group of
# its own (setsid), its process id (the group's) in launched_pid.
launch() {
    local mode=$1 name=$2 dir=$3
    shift 3
    local settings=()
    while [[ $1 != -- ]]; do
        settings+=("$1")
        shift
    done
    shift
    local command=(env MODEL="$JOURNEY_MODEL" CHECKPOINT_DIR="$dir" "${settings[@]}" ./train-singlenode.sh "$@")
    if [[ $mode == detached ]]; then
        setsid "${command[@]}" >"$JOURNEY_DIR/$name.log" 2>&1 &
        launched_pid=$!
    else
        "${command[@]}" >"$JOURNEY_DIR/$name.log" 2>&1 && launched_status=0 || launched_status=$?
    fi
}

# run NAME CHECKPOINT_DIR ENV-ASSIGNMENTS... -- TRAINER-FLAGS...: one line with the run's exit status and summary.
run() {
    local name=$1 dir=$2 start status
    start=$(date +%s)
    launch foreground "$@"
    status=$launched_status
    python3 - "$name" "$status" "$(($(date +%s) - start))" "$dir" "$JOURNEY_DIR/$name.log" <<'EOF' | tee -a "$JOURNEY_DIR/journey.txt"
import json, re, sys
from pathlib import Path

name, status, wall, ckpt, log = sys.argv[1], int(sys.argv[2]), sys.argv[3], Path(sys.argv[4]), Path(sys.argv[5])
text = log.read_text(errors="replace")
summary = json.loads((ckpt / "summary.json").read_text()) if (ckpt / "summary.json").exists() else {}
def grab(pattern):
    found = re.findall(pattern, text)
    return found[-1] if found else None
parts = [f"journey {name}: exit {status}", f"wall {wall}s"]
if summary:
    mfu = summary.get("mean_mfu")
    parts += [f"steps {summary['steps']}", f"{summary.get('mean_tokens_per_s') or 0:,.0f} tokens/s",
              f"MFU {100 * mfu:.1f}%" if mfu else "MFU n/a", f"peak {summary.get('peak_mem_gib') or 0:.1f} GiB",
              f"eval loss {summary['final_eval_loss']:.4f}" if summary.get("final_eval_loss") else "no eval",
              f"skipped {summary.get('skipped_steps')}", f"export {'yes' if summary.get('export') else 'no'}"]
for label, pattern in (("precision", r"precision (\w+)"), ("attention", r"attention: ([^(;]+)"),
                       ("estimate", r"memory: ~([\d.]+ GiB) per GPU"), ("resumed from", r"resume: continuing from \S+ at step (\d+)"),
                       ("sample", r"sample: (.{0,60})")):
    value = grab(pattern)
    if value:
        parts.append(f"{label} {value.strip()!r}" if label == "sample" else f"{label} {value.strip()}")
metrics = ckpt / "metrics.jsonl"
stalls = [json.loads(line).get("checkpoint_s") for line in metrics.read_text().splitlines()] if metrics.exists() else []
stalls = [f"{s:.1f}" for s in stalls if s is not None]
if stalls:
    parts.append(f"save stalls {', '.join(stalls)} s")
copies = re.findall(r"in host memory after ([\d.]+)s", text)
if copies:
    parts.append(f"host copies {', '.join(copies)} s")
if status:
    parts.append("last error: " + (grab(r"(?m)^.*(?:[Ee]rror|Traceback).*$") or "see log")[:200])
print(" | ".join(parts))
EOF
    ((status == 0)) || failed=1
    # Checkpoints take disk (8 GiB each for Qwen3-0.6B, 55 GiB for Qwen3-4B): only those a later journey resumes from
    # stay.
    [[ $name == default || $name == resume || $name == delayed || $name == zero3-offload || $name == zero3-delayed ||
        $name == sft-lora || $name == long-sft || $name == long-sft-resume || $name == qlora*-resume ]] \
        || { [[ $name == *-large ]] && { wanted "$name-resume" || ((JOURNEY_KEEP_LARGE)); }; } || rm -rf "$dir"
}

# kill_at NAME CHECKPOINT_DIR PATTERN SECONDS ENV-ASSIGNMENTS... -- TRAINER-FLAGS...: `run`'s launch, killed with
# SIGKILL (all its processes) once its log shows PATTERN (or SECONDS have passed; 0: no limit). Sets killed_status
# ("killed", or how it ended otherwise) and killed_wall (seconds).
kill_at() {
    local name=$1 dir=$2 pattern=$3 seconds=$4 start pid
    shift 4
    start=$(date +%s) killed_status=killed
    launch detached "$name" "$dir" "$@"
    pid=$launched_pid
    until grep -qsE "$pattern" "$JOURNEY_DIR/$name.log"; do
        if ! kill -0 "$pid" 2>/dev/null; then
            wait "$pid" && killed_status="exit 0 before the kill" || killed_status="exit $? before the kill"
            break
        fi
        if ((seconds && $(date +%s) - start > seconds)); then
            killed_status="killed after ${seconds}s without its pattern"
            break
        fi
        sleep 1
    done
    if [[ $killed_status == killed* ]]; then
        kill -KILL -- "-$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
    fi
    killed_wall=$(($(date +%s) - start))
}

# crash NAME CHECKPOINT_DIR PATTERN ENV-ASSIGNMENTS... -- TRAINER-FLAGS...: kill_at PATTERN, a crash at a known point;
# one line with what the run logged before it.
crash() {
    local name=$1 dir=$2 pattern=$3 status
    shift 3
    kill_at "$name" "$dir" "$pattern" 0 "$@"
    status=$killed_status
    python3 - "$name" "$status" "$killed_wall" "$dir" "$JOURNEY_DIR/$name.log" <<'EOF' | tee -a "$JOURNEY_DIR/journey.txt"
import json, re, sys
from pathlib import Path

name, status, wall, ckpt, log = sys.argv[1], sys.argv[2], sys.argv[3], Path(sys.argv[4]), Path(sys.argv[5])
text = log.read_text(errors="replace")
resumed = re.findall(r"resume: continuing from \S+ at step (\d+)", text)
parts = [f"journey {name}: {'SIGKILL after its pattern, as planned' if status == 'killed' else status}",
         f"wall {wall}s", f"resumed from {resumed[-1]}" if resumed else "not resumed"]
records = [json.loads(line) for line in (ckpt / "metrics.jsonl").read_text().splitlines()] \
    if (ckpt / "metrics.jsonl").exists() else []
steps = [r for r in records if "tokens_per_s" in r and "loss" in r]
if steps and (not resumed or steps[-1]["step"] > int(resumed[-1])):
    r = steps[-1]
    parts += [f"step {r['step']} loss {r['loss']:.4f}", f"{r['tokens_per_s']:,.0f} tokens/s",
              f"peak {r.get('peak_mem_gib') or 0:.1f} GiB", f"host peak {r.get('host_peak_mem_gib') or 0:.1f} GiB"]
print(" | ".join(parts))
EOF
    [[ $status == killed ]] || failed=1
}

# measure NAME CHECKPOINT_DIR PATTERN ENV-ASSIGNMENTS... -- TRAINER-FLAGS...: kill_at PATTERN (or
# JOURNEY_MEASURE_SECONDS), then one line of the speed it trained at: the mean tokens/s and MFU of the steps after the
# second, the save's stall (its host copy), the attention in force, the memory estimate, the batch.
measure() {
    local name=$1 dir=$2 pattern=$3 status
    shift 3
    kill_at "$name" "$dir" "$pattern" "$JOURNEY_MEASURE_SECONDS" "$@"
    status=$killed_status
    python3 - "$name" "$status" "$killed_wall" "$dir" "$JOURNEY_DIR/$name.log" <<'EOF' | tee -a "$JOURNEY_DIR/journey.txt"
import json, re, statistics, sys
from pathlib import Path

name, status, wall, ckpt, log = sys.argv[1], sys.argv[2], sys.argv[3], Path(sys.argv[4]), Path(sys.argv[5])
text = log.read_text(errors="replace")
records = [json.loads(line) for line in (ckpt / "metrics.jsonl").read_text().splitlines()] \
    if (ckpt / "metrics.jsonl").exists() else []
steps = [r for r in records if "tokens_per_s" in r and "loss" in r and r["step"] > 2]
parts = [f"journey {name}: {'SIGKILL after its pattern, as planned' if status == 'killed' else status}",
         f"wall {wall}s"]
if steps:
    mfu = [r["mfu"] for r in steps if r.get("mfu")]
    parts += [f"steps 3-{steps[-1]['step']}: {statistics.fmean(r['tokens_per_s'] for r in steps):,.0f} tokens/s",
              f"MFU {100 * statistics.fmean(mfu):.1f}%" if mfu else "MFU n/a",
              f"peak {max(r.get('peak_mem_gib') or 0 for r in steps):.1f} GiB", f"last loss {steps[-1]['loss']:.4f}"]
copies = re.findall(r"in host memory after ([\d.]+)s", text)  # the training stall of each save
parts.append(f"save stalls (host copies) {', '.join(copies)} s" if copies else "no save")
for label, pattern in (("attention", r"attention: ([^;\n]+)"), ("estimate", r"memory: ~([\d.]+ GiB) per GPU"),
                       ("batch", r"batch: (micro \d+ x grad_acc \d+ x world \d+)")):
    found = re.findall(pattern, text)
    if found:
        parts.append(f"{label} {found[-1].strip()[:120]}")
if status != "killed":
    found = re.findall(r"(?m)^.*(?:[Ee]rror|Traceback).*$", text)
    parts.append("last error: " + (found[-1][:200] if found else "see log"))
print(" | ".join(p for p in parts if p))
EOF
    [[ $status == killed ]] || failed=1
}

flags=(--micro_batch_size "$JOURNEY_MICRO_BATCH" --log_interval 5 --eval_iters 8)
if wanted default; then
    run default "$JOURNEY_DIR/default" MAX_STEPS=30 -- "${flags[@]}" --eval_interval 20 --checkpoint_freq 20 \
        --generate_prompt "The"
fi
if wanted resume; then
    run resume "$JOURNEY_DIR/default" MAX_STEPS=40 -- "${flags[@]}" --eval_interval 20 --checkpoint_freq 20
fi
if wanted delayed; then
    # ZeRO-2 + optimizer offload with the delayed update from step 5: train, evaluate, checkpoint, export; then resume
    run delayed "$JOURNEY_DIR/delayed" MAX_STEPS=30 DS_CONFIG=configs/zero2-offload.json -- "${flags[@]}" \
        --eval_interval 20 --checkpoint_freq 20 --delayed_update_from_step 5
    run delayed-resume "$JOURNEY_DIR/delayed" MAX_STEPS=40 DS_CONFIG=configs/zero2-offload.json -- "${flags[@]}" \
        --eval_interval 20 --checkpoint_freq 20 --delayed_update_from_step 5
fi
if wanted zero3-offload; then
    # ZeRO-3 with parameters and optimizer offloaded, 4 micro-batches a step: train, evaluate, checkpoint, export; resume
    z3_flags=(--micro_batch_size 4 --gradient_accumulation_steps 4 --log_interval 1 --eval_iters 4 --eval_interval 6
              --checkpoint_freq 6)
    run zero3-offload "$JOURNEY_DIR/zero3-offload" MAX_STEPS=6 DS_CONFIG=configs/zero3-offload.json -- "${z3_flags[@]}"
    run zero3-offload-resume "$JOURNEY_DIR/zero3-offload" MAX_STEPS=12 DS_CONFIG=configs/zero3-offload.json -- \
        "${z3_flags[@]}"
fi
if wanted zero3-delayed; then
    # the same with the delayed update from step 3: each step's CPU update beside the next step's micro-batches
    z3_flags=(--micro_batch_size 4 --gradient_accumulation_steps 4 --log_interval 1 --eval_iters 4 --eval_interval 6
              --checkpoint_freq 6 --delayed_update_from_step 3)
    run zero3-delayed "$JOURNEY_DIR/zero3-delayed" MAX_STEPS=6 DS_CONFIG=configs/zero3-offload.json -- "${z3_flags[@]}"
    run zero3-delayed-resume "$JOURNEY_DIR/zero3-delayed" MAX_STEPS=12 DS_CONFIG=configs/zero3-offload.json -- \
        "${z3_flags[@]}"
fi
# The large journeys: 4 steps, then a resume from step 4's checkpoint into a directory of JOURNEY_RESUME_ROOT (its own
# final checkpoint must fit there, which the preflight checks) killed once step 5 is logged, before that checkpoint.
large_common=(--global_batch_tokens 131072 --delayed_update_from_step 2 --log_interval 1 --eval_interval 4 --eval_iters 2
              --checkpoint_freq 0)
for stage in zero3 zero2; do
    case $stage in
        zero3) stage_flags=(--micro_batch_size auto --gradient_checkpointing --checkpointed_layers auto) ;;
        zero2) stage_flags=(--micro_batch_size auto) ;;
    esac
    config=configs/$stage-offload.json
    if wanted "$stage-large"; then
        run "$stage-large" "$JOURNEY_DIR/$stage-large" MAX_STEPS=4 MODEL="$JOURNEY_LARGE_MODEL" DS_CONFIG="$config" -- \
            "${stage_flags[@]}" "${large_common[@]}" --generate_prompt "The"
    fi
    if wanted "$stage-large-resume"; then
        crash "$stage-large-resume" "$JOURNEY_RESUME_ROOT/$stage-large-resume" 'step 5 [|] loss' MAX_STEPS=6 \
            MODEL="$JOURNEY_LARGE_MODEL" DS_CONFIG="$config" -- "${stage_flags[@]}" "${large_common[@]}" \
            --resume_from_checkpoint "$JOURNEY_DIR/$stage-large/step-00000004"
        rm -rf "${JOURNEY_DIR:?}/$stage-large" "${JOURNEY_RESUME_ROOT:?}/$stage-large-resume"
    fi
done
if wanted presets; then
    for preset in configs/*.json; do
        name=preset-$(basename "$preset" .json)
        run "$name" "$JOURNEY_DIR/$name" MAX_STEPS=8 DS_CONFIG="$preset" -- --micro_batch_size 8 --log_interval 2 \
            --eval_iters 2 --checkpoint_freq 0
    done
fi
if wanted documents; then
    run documents "$JOURNEY_DIR/documents" MAX_STEPS=10 -- "${flags[@]}" --document_mask --checkpoint_freq 0
fi
if wanted checkpointing; then
    run checkpointing "$JOURNEY_DIR/checkpointing" MAX_STEPS=10 -- "${flags[@]}" --gradient_checkpointing \
        --checkpoint_freq 0
fi
if wanted saves; then
    for writes in $JOURNEY_WRITES; do
        extra=()
        [[ $writes == background ]] || extra=(--no-background_checkpoint)
        run "saves-$writes" "$JOURNEY_DIR/saves-$writes" MAX_STEPS=40 -- "${flags[@]}" --eval_interval 0 \
            --checkpoint_freq 10 --keep_last_checkpoints 1 --no-export "${extra[@]}"
    done
fi
if wanted saves-large; then
    for writes in $JOURNEY_WRITES; do
        extra=()
        [[ $writes == background ]] || extra=(--no-background_checkpoint)
        # Without offload Qwen3-4B does not fit one H100 (67.5 GiB allocated before the first Adam step, against the
        # preflight's 63 GiB); with it, the host copy does not fit beside the offloaded states on a 128 GiB node, so
        # the preflight writes synchronously and says why.
        run "saves-large-$writes" "$JOURNEY_DIR/saves-large-$writes" MAX_STEPS=2 MODEL="$JOURNEY_LARGE_MODEL" \
            DS_CONFIG=configs/zero2-offload.json PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True -- \
            --micro_batch_size 1 --gradient_checkpointing --log_interval 1 --eval_interval 0 --eval_iters 1 \
            --checkpoint_freq 0 --no-export "${extra[@]}"
    done
fi
if wanted finetune; then
    [[ -d $JOURNEY_DIR/default/hf ]] || echo "journey finetune: needs the default journey's export ($JOURNEY_DIR/default/hf)"
    run finetune "$JOURNEY_DIR/finetune" MAX_STEPS=10 JOURNEY_MODEL="$JOURNEY_DIR/default/hf" \
        MODEL="$JOURNEY_DIR/default/hf" -- --micro_batch_size 8 --log_interval 5 --eval_iters 2 --checkpoint_freq 0
fi
python=$(command -v python3) # the launchers' choice (resolve_python): the repository's .venv where one exists
[[ -x .venv/bin/python ]] && python=$PWD/.venv/bin/python
# compare_resumed NAME KILLED_METRICS RESUMED_METRICS RESUME_STEP: the steps a killed run trained after RESUME_STEP,
# trained again by the run resumed from there (its log, JOURNEY_DIR/NAME-resume.log, names that step), give the same
# losses (one line; sets failed where they do not).
compare_resumed() {
    "$python" - "$2" "$3" "$1" "$4" "$JOURNEY_DIR/$1-resume.log" <<'EOF' | tee -a "$JOURNEY_DIR/journey.txt" || failed=1
import json, math, re, sys

def losses(path):  # each step's last record: a resumed run logs its steps again
    found = {}
    for line in open(path):
        record = json.loads(line)
        if "loss" in record and "lr" in record:
            found[record["step"]] = record["loss"]
    return found

killed, resumed = losses(sys.argv[1]), losses(sys.argv[2])
steps = sorted(s for s in set(killed) & set(resumed) if s > int(sys.argv[4]))
# The first step after the resume point trains the restored weights on the restored data: its loss is the killed run's
# bit for bit. Later steps follow gradients that GPU kernels sum in no fixed order (attention's backward): equal on
# CPU, within bf16 noise on GPUs.
def off(s):  # relative difference; nan where either loss is not finite
    k, r = killed[s], resumed[s]
    return abs(k - r) / max(abs(k), 1e-12) if math.isfinite(k) and math.isfinite(r) else math.nan

later = [off(s) for s in steps[1:]]
resumed_from = re.findall(r"resume: continuing from \S+ at step (\d+)", open(sys.argv[5], errors="replace").read())
if resumed_from[-1:] != [sys.argv[4]]:
    verdict = f"not resumed from step {sys.argv[4]} (from {resumed_from[-1] if resumed_from else 'none'})"
elif len(steps) < 2 or killed[steps[0]] != resumed[steps[0]] or not all(d <= 0.01 for d in later):
    verdict = "not equal"  # (a nan compares false) or fewer than the two steps the killed run trained again
elif max(later) == 0:
    verdict = "equal"
else:
    verdict = f"step {steps[0]} equal, later within {max(later):.2%}"
print(f"journey {sys.argv[3]}: " + ", ".join(f"step {s} loss {killed[s]:.5f} killed, {resumed[s]:.5f} resumed" for s in steps)
      + f" ({verdict})")
sys.exit(0 if verdict == "equal" or verdict.startswith("step") else 1)
EOF
}

# hf_model PRESET_OR_DIRECTORY: a preset written once under JOURNEY_DIR/models as a random-init Hugging Face model (the
# stand-in for a hub checkpoint), or the directory given; its path on stdout
hf_model() {
    "$python" -c 'import sys; sys.path.insert(0, "benchmarks"); from pathlib import Path
from fine_tuning_work import model_directory; print(model_directory(sys.argv[1], 0, Path(sys.argv[2])))' \
        "$1" "$JOURNEY_DIR/models" | tail -1
}

if wanted sft-lora; then
    sft_model=$(hf_model "$JOURNEY_SFT_MODEL")
    sft=(MODEL="$sft_model" DATASET=embedded-chat OUTPUT_DIR="$JOURNEY_DIR/sft-lora-hf")
    sft_flags=(--seq_len 2048 --lora_rank 16 --export_merged --log_interval 1 --eval_iters 2 --checkpoint_freq 4)
    run sft-lora "$JOURNEY_DIR/sft-lora" "${sft[@]}" MAX_STEPS=6 -- "${sft_flags[@]}"
    run sft-lora-resume "$JOURNEY_DIR/sft-lora" "${sft[@]}" MAX_STEPS=8 -- "${sft_flags[@]}"
    command=("$python" -m model_utils.generate --model "$JOURNEY_DIR/sft-lora-hf/merged" --chat "What does json.dumps do?")
    echo "${command[*]}"
    (cd src && "${command[@]}") 2>&1 | tail -3 | cut -c1-300 | tee -a "$JOURNEY_DIR/journey.txt" || failed=1
    "$python" - "$sft_model" "$JOURNEY_DIR/sft-lora-hf" <<'EOF' 2>&1 | tail -1 | tee -a "$JOURNEY_DIR/journey.txt" || failed=1
import json
import sys
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM
base, export = sys.argv[1], sys.argv[2]
adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), f"{export}/adapter")
merged = AutoModelForCausalLM.from_pretrained(f"{export}/merged", dtype=torch.float32)
saved = json.loads(open(f"{export}/merged/config.json").read())
saved_dtype = saved.get("dtype") or saved.get("torch_dtype")
ids = torch.arange(1, 33).reshape(1, 32)
with torch.no_grad():
    reference = adapted(ids).logits
    diff = (reference - merged(ids).logits).abs().max().item()
# the merge adds B A into the trained 16-bit weights, so bf16 training rounds the merged weights once more
print("journey sft-lora exports: the adapter on the base model and the merged model, logits differ by at most "
      f"{diff:.2e} (largest logit {reference.abs().max().item():.2f}; merged weights saved as {saved_dtype})")
EOF
fi
if wanted seeds-large || wanted seeds-large-resume; then
    seeds_model=$(hf_model "$JOURNEY_SEEDS_MODEL")
    seeds=(MODEL="$seeds_model" DATASET=embedded-chat DS_CONFIG=configs/zero3.json OUTPUT_DIR="$JOURNEY_DIR/seeds-hf")
    seeds_flags=(--log_interval 1 --eval_iters 2 --checkpoint_freq 0 --keep_last_checkpoints 1)
    if wanted seeds-large; then
        run seeds-large "$JOURNEY_DIR/seeds" "${seeds[@]}" MAX_STEPS=2 -- "${seeds_flags[@]}" --eval_interval 0 \
            --no-export
    fi
    if wanted seeds-large-resume; then
        run seeds-large-resume "$JOURNEY_DIR/seeds" "${seeds[@]}" MAX_STEPS=3 -- "${seeds_flags[@]}" \
            --generate_prompt "What does json.dumps do?"
        command=("$python" -m model_utils.generate --model "$JOURNEY_DIR/seeds-hf" --chat "What does os.path.join do?")
        echo "${command[*]}"
        (cd src && "${command[@]}") 2>&1 | tail -3 | cut -c1-300 | tee -a "$JOURNEY_DIR/journey.txt" || failed=1
    fi
fi
if wanted seeds-speed; then
    seeds_model=$(hf_model "$JOURNEY_SEEDS_MODEL")
    for kernel in $JOURNEY_SEEDS_KERNELS; do
        measure "seeds-speed-$kernel" "$JOURNEY_DIR/seeds-speed" "in host memory after" MODEL="$seeds_model" \
            DATASET=embedded-chat DS_CONFIG=configs/zero3.json MAX_STEPS="$JOURNEY_SEEDS_STEPS" -- \
            --attention_kernel "$kernel" --log_interval 1 --checkpoint_freq 0 --keep_last_checkpoints 1 \
            --eval_interval 0 --no-export
        rm -rf "$JOURNEY_DIR/seeds-speed"  # the next kernel's run starts fresh; a 7B checkpoint leaves room for no other
    done
fi
if wanted long-sft; then
    long_model=$(hf_model "$JOURNEY_LONG_MODEL")
    long_gpus=$("$python" -c 'import torch; print(torch.cuda.device_count())')
    long_split=$JOURNEY_LONG_SP
    # every GPU of the node; two processes where there is none (CPU, gloo)
    ((long_split)) || long_split=$((long_gpus ? long_gpus : 2))
    read -r -a long_more <<<"$JOURNEY_LONG_FLAGS"
    "$python" benchmarks/long_chats.py --tokens "$JOURNEY_LONG_TOKENS" --examples 24 \
        --out "$JOURNEY_DIR/long-chats.jsonl" | tail -1
    # ZeRO-3 partitions nothing on one GPU, yet gathers every layer's parameters each pass (and each MLP tile): an 8B
    # LoRA step at 65,536 tokens took 40.4 s there against 17.3 s under ZeRO-2 (docs/PERFORMANCE.md, Long sequences)
    long_ds_config=$JOURNEY_LONG_DS_CONFIG
    [[ -n $long_ds_config ]] || { ((long_gpus == 1)) && long_ds_config=ds_config.json || long_ds_config=configs/zero3.json; }
    rm -rf "$JOURNEY_DIR/long"  # a checkpoint left by an interrupted journey would be resumed
    long=(MODEL="$long_model" DATASET="$JOURNEY_DIR/long-chats.jsonl" DS_CONFIG="$long_ds_config"
          SEQUENCE_PARALLEL="$long_split" OUTPUT_DIR="$JOURNEY_DIR/long-hf")
    long_flags=(--seq_len "$JOURNEY_LONG_TOKENS" --micro_batch_size 1 --gradient_checkpointing --lora_rank
                "$JOURNEY_LONG_LORA" --log_interval 1 --eval_iters 1 --checkpoint_freq 0 --keep_last_checkpoints 1
                "${long_more[@]}")
    long_export=$JOURNEY_DIR/long-hf
    if ((JOURNEY_LONG_LORA)); then  # the adapter and the merged model; the merged one is prompted
        long_flags+=(--export_merged)
        long_export+=/merged
    fi
    run long-sft "$JOURNEY_DIR/long" "${long[@]}" MAX_STEPS=3 -- "${long_flags[@]}" --eval_interval 3 --no-export
    crash long-sft-killed "$JOURNEY_DIR/long" "^step 5 " "${long[@]}" MAX_STEPS=6 -- "${long_flags[@]}" \
        --eval_interval 0 --no-export
    cp "$JOURNEY_DIR/long/metrics.jsonl" "$JOURNEY_DIR/long-killed-metrics.jsonl"
    run long-sft-resume "$JOURNEY_DIR/long" "${long[@]}" MAX_STEPS=6 -- "${long_flags[@]}" --eval_interval 6 \
        --generate_prompt "What does json.dumps do?"
    compare_resumed long-sft "$JOURNEY_DIR/long-killed-metrics.jsonl" "$JOURNEY_DIR/long/metrics.jsonl" 3
    rm -rf "$JOURNEY_DIR/long"
    command=("$python" -m model_utils.generate --model "$long_export" --chat "What does os.path.join do?")
    echo "${command[*]}"
    (cd src && "${command[@]}") 2>&1 | tail -3 | cut -c1-300 | tee -a "$JOURNEY_DIR/journey.txt" || failed=1
fi
# qlora_journey NAME GPU_GIB DS_CONFIG: the qlora journey under NAME (its logs, checkpoint and exports), the GPU held to
# GPU_GIB in DS_CONFIG's precision.
qlora_journey() {
    local name=$1 gib=$2 ds_config=$3
    local dir=$JOURNEY_DIR/$name export=$JOURNEY_DIR/$name-hf model more command
    rm -rf "$dir" "$export"  # a checkpoint left by an interrupted journey would be resumed
    model=$(hf_model "$JOURNEY_QLORA_MODEL")
    local settings=(MODEL="$model" DATASET=embedded-chat DS_CONFIG="$ds_config" GPU_MEMORY_GIB="$gib"
                    OUTPUT_DIR="$export")
    local flags=(--lora_rank 16 --load_in_4bit --gradient_checkpointing --seq_len 2048 --log_interval 1 --eval_iters 2
                 --checkpoint_freq 3 --eval_interval 3 --keep_last_checkpoints 1 --export_merged)
    read -r -a more <<<"$JOURNEY_QLORA_FLAGS"
    flags+=("${more[@]}")
    # the plan as a login node prints it: no GPU visible, GPU_MEMORY_GIB the GPU nodes' size
    (cd src && CUDA_VISIBLE_DEVICES="" GPU_MEMORY_GIB="$gib" "$python" train_deepspeed.py --preflight \
        --model "$model" --dataset embedded-chat --ds_config "../$ds_config" "${flags[@]}") \
        2>&1 | grep -E "^(batch|micro-batch|memory|QLoRA|preflight)" | cut -c1-300 | sed "s/^/journey $name preflight: /" \
        | tee -a "$JOURNEY_DIR/journey.txt" || failed=1
    crash "$name-killed" "$dir" "^step 5 " "${settings[@]}" MAX_STEPS=6 -- "${flags[@]}" --no-export
    cp "$dir/metrics.jsonl" "$JOURNEY_DIR/$name-killed-metrics.jsonl"
    # no --generate_prompt: its sample loads the merged export beside the engine (~21 GiB), more than a T4 holds; the
    # export is prompted below, in a process of its own
    run "$name-resume" "$dir" "${settings[@]}" MAX_STEPS=6 -- "${flags[@]}"
    compare_resumed "$name" "$JOURNEY_DIR/$name-killed-metrics.jsonl" "$dir/metrics.jsonl" 3
    command=("$python" -m model_utils.generate --model "$export/merged" --chat "What does os.path.join do?")
    echo "${command[*]}"
    (cd src && "${command[@]}") 2>&1 | tail -3 | cut -c1-300 | tee -a "$JOURNEY_DIR/journey.txt" || failed=1
    rm -rf "$dir" "$export"
}
if wanted qlora; then
    qlora_journey qlora "$JOURNEY_QLORA_GPU_GIB" "$JOURNEY_QLORA_DS_CONFIG"
fi
if wanted qlora-l40; then
    qlora_journey qlora-l40 44 ds_config.json
fi
if wanted vlm; then
    vlm_model=$(hf_model "$JOURNEY_VLM_MODEL")
    vlm_dir=$JOURNEY_DIR/vlm vlm_export=$JOURNEY_DIR/vlm-hf
    rm -rf "$vlm_dir" "$vlm_export"  # a checkpoint left by an interrupted journey would be resumed
    vlm=(MODEL="$vlm_model" DATASET=embedded-vision DS_CONFIG=configs/zero3.json OUTPUT_DIR="$vlm_export")
    vlm_flags=(--lora_rank 16 --gradient_checkpointing --seq_len "$JOURNEY_VLM_SEQ_LEN" --log_interval 1 --eval_iters 2
               --checkpoint_freq 3 --eval_interval 3 --keep_last_checkpoints 1 --export_merged)
    (cd src && "$python" train_deepspeed.py --preflight --model "$vlm_model" --dataset embedded-vision \
        --ds_config ../configs/zero3.json "${vlm_flags[@]}") 2>&1 \
        | grep -E "^(batch|micro-batch|memory|vision-language|preflight)" | cut -c1-300 | sed "s/^/journey vlm preflight: /" \
        | tee -a "$JOURNEY_DIR/journey.txt" || failed=1
    crash vlm-killed "$vlm_dir" "^step 5 " "${vlm[@]}" MAX_STEPS=6 -- "${vlm_flags[@]}" --no-export
    cp "$vlm_dir/metrics.jsonl" "$JOURNEY_DIR/vlm-killed-metrics.jsonl"
    run vlm-resume "$vlm_dir" "${vlm[@]}" MAX_STEPS=6 -- "${vlm_flags[@]}"
    compare_resumed vlm "$JOURNEY_DIR/vlm-killed-metrics.jsonl" "$vlm_dir/metrics.jsonl" 3
    # a held-out picture of the embedded questions (its first row with an image)
    picture=$(cd src && "$python" -c 'import json; from pathlib import Path
from model_utils.data.vision.shapes import build_vision_corpus
d = build_vision_corpus(); rows = (json.loads(line) for line in open(d / "validation.jsonl"))
print(d / next(r for r in rows if r["images"])["images"][0])')
    command=("$python" -m model_utils.generate --model "$vlm_export/merged" --image "$picture" --chat
             "What colour are the shapes?")
    echo "${command[*]}"
    (cd src && "${command[@]}") 2>&1 | tail -3 | cut -c1-300 | tee -a "$JOURNEY_DIR/journey.txt" || failed=1
    rm -rf "$vlm_dir" "$vlm_export"
fi
if wanted fp16; then
    "$python" benchmarks/fp16_check.py --out "$JOURNEY_DIR/fp16" | tee -a "$JOURNEY_DIR/journey.txt" || failed=1
fi
exit "$failed"
