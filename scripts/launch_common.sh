# shellcheck shell=bash
# Shared settings and helpers of the launchers (train.sbatch, train-singlenode.sh,
# train-pyxis.sbatch, train-pyxis-singlenode.sh, setup-pyxis.sh). Sourced, never run.
#
# Every setting appears once below as `: "${VAR:=default}"`; set it in the
# environment to override it. docs/LAUNCHERS.md describes each one.

# ---- Trainer settings. Empty: the flag is not passed and the trainer's own default applies.
: "${CONFIG:=}"              # --config: a YAML file of trainer flags (relative paths: from the repository root)
: "${DATASET:=}"             # --dataset
: "${DATASET_CONFIG_NAME:=}" # --dataset_config_name
: "${LOCAL_DATASET:=}"       # --local_dataset (true, false or auto)
: "${MODEL:=}"               # --model
: "${TOKENIZER:=}"           # --tokenizer
: "${MAX_STEPS:=}"           # --max_steps
: "${CHECKPOINT_FREQ:=}"     # --checkpoint_freq
: "${CHECKPOINT_DIR:=}"      # --checkpoint_dir (relative paths: from the repository root)
: "${DS_CONFIG:=}"           # --ds_config (relative paths: from the repository root)
: "${SEQ_LEN:=}"             # --seq_len
: "${SEQUENCE_PARALLEL:=}"    # --sequence_parallel (GPUs of a node that share each sequence)
: "${OUTPUT_DIR:=}"          # --export_dir

# ---- Launcher settings.
: "${GPUS_PER_NODE:=}"  # empty: counted by detect_gpus_per_node (0: CPU mode, one process per node)
: "${CPU_PROCS:=2}"     # processes of a run without SLURM and without GPU
: "${NODES:=}"          # sbatch launchers: empty keeps the script's #SBATCH --nodes
: "${PARTITION:=}"      # empty: the cluster's default partition
: "${MASTER_PORT:=}"    # empty: 29500 + SLURM_JOB_ID % 1000 under SLURM
: "${PYTHON:=}"         # empty: python of VENV, else .venv/bin/python if it exists, else python3
: "${VENV:=}"           # a virtual environment activated in every task on every node
: "${CUDA_VERSION:=}"   # e.g. 12.8: use CUDA_ROOT/cuda-12.8, or `module load cuda/12.8` under Lmod
: "${CUDA_ROOT:=/usr/local}"
: "${CONTAINER_IMAGE:=deepspeed-lm-trainer.sqsh}" # Pyxis image: a .sqsh file (relative: repository root) or a registry image
: "${CONTAINER_MOUNTS:=}" # extra Pyxis mounts SRC:DST[,...], added to the repository and CHECKPOINT_DIR
: "${CONTAINER_EDF:=}"    # CSCS Container Engine: an EDF (.toml path, or a name in ~/.edf) replacing image and mounts
: "${CONTAINER_ENGINE:=}" # setup-pyxis.sh: docker or podman; empty: the first one found
: "${IMAGE_TAG:=deepspeed-lm-trainer:latest}" # setup-pyxis.sh: the tag of the built image
: "${BASE_IMAGE:=}"       # setup-pyxis.sh: empty keeps the Dockerfile's NGC PyTorch base
: "${DRY_RUN:=0}"       # 1: print the commands, run nothing
: "${PREFLIGHT:=0}"     # 1: run the trainer's --preflight checks on this machine and exit

TRAINER_SCRIPT=src/train_deepspeed.py
LAUNCHER=$(basename "$0")

# Per-task wrapper run by srun: the same environment on every node, the rank
# variables from SLURM (LOCAL_WORLD_SIZE: the ranks sharing the node's cores),
# then the trainer as the task's own process (exec), so that signals from SLURM
# reach the Python workers directly.
# shellcheck disable=SC2016 # expanded by the task's shell, not here
TASK_WRAPPER='[[ -z ${VENV:-} ]] || source "$VENV/bin/activate"; export RANK=$SLURM_PROCID LOCAL_RANK=$SLURM_LOCALID WORLD_SIZE=$SLURM_NTASKS LOCAL_WORLD_SIZE=${SLURM_NTASKS_PER_NODE:-1}; echo "task: rank $RANK/$WORLD_SIZE on $SLURMD_NODENAME"; exec "$@"'

# Exit status with which the trainer reports "checkpoint saved after a signal, run me again": the trainer's own
# constant, read from its module, so the two cannot disagree.
trainer_exit_status() { # trainer_exit_status NAME: the value of NAME in src/model_utils/core/exit_status.py
    local key value
    while read -r key _ value _; do
        [[ $key == "$1" ]] && echo "$value" && return
    done <src/model_utils/core/exit_status.py
}
RESUME_STATUS=$(trainer_exit_status STOPPED_BY_SIGNAL)
if [[ ! $RESUME_STATUS =~ ^[0-9]+$ ]]; then
    echo "$(basename "$0"): error: no STOPPED_BY_SIGNAL in src/model_utils/core/exit_status.py: run from a complete checkout" >&2
    exit 1
fi
# A TERM this close to the time limit (seconds) is the limit itself: the job is requeued as after USR1.
REQUEUE_TERM_WITHIN=120
# Seconds the other ranks of a run on this machine get to exit after one rank failed, before KILL.
RANK_STOP_GRACE=30

die() {
    echo "$LAUNCHER: error: $*" >&2
    exit 1
}

log() {
    echo "[$LAUNCHER $(date '+%F %T')] $*"
}

# Print a command as it can be pasted into a shell.
show_cmd() {
    local arg line="+"
    for arg in "$@"; do
        if [[ $arg =~ ^[][A-Za-z0-9_./:=,@%+-][][A-Za-z0-9_./:=,@%+#-]*$ ]]; then
            line+=" $arg"
        else
            line+=" '${arg//\'/\'\\\'\'}'"
        fi
    done
    echo "$line"
}

# Print the command; run it unless DRY_RUN=1.
run_cmd() {
    show_cmd "$@"
    [[ $DRY_RUN == 1 ]] || "$@"
}

need_cmd() { # need_cmd CMD WHY
    command -v "$1" >/dev/null 2>&1 || die "$1 not found: $2"
}

in_batch_job() { [[ -n ${SLURM_JOB_ID:-} && ${ENVIRONMENT:-} == BATCH ]]; }
in_allocation() { [[ -n ${SLURM_JOB_ID:-} ]]; }

# ---- Settings checks (all run before anything is allocated).

check_settings() {
    case $LOCAL_DATASET in
        "" | true | false | auto) ;;
        *) die "LOCAL_DATASET=$LOCAL_DATASET is not one of true, false, auto: fix or unset it" ;;
    esac
    [[ -z $CONFIG || -f $CONFIG ]] \
        || die "CONFIG=$CONFIG: no such file (relative to $PWD): point CONFIG at a YAML file of trainer flags (configs/runs/) or unset it"
    [[ -z $DS_CONFIG || -f $DS_CONFIG ]] \
        || die "DS_CONFIG=$DS_CONFIG: no such file (relative to $PWD): point DS_CONFIG at a DeepSpeed JSON config or unset it"
    [[ $DRY_RUN == [01] ]] || die "DRY_RUN=$DRY_RUN: use 1 (print commands only) or 0"
    [[ $PREFLIGHT == [01] ]] || die "PREFLIGHT=$PREFLIGHT: use 1 (checks only) or 0"
    [[ -z $GPUS_PER_NODE || $GPUS_PER_NODE =~ ^[0-9]+$ ]] \
        || die "GPUS_PER_NODE=$GPUS_PER_NODE is not a number: set a count or unset it to detect"
    [[ -z $MASTER_PORT || $MASTER_PORT =~ ^[0-9]+$ ]] \
        || die "MASTER_PORT=$MASTER_PORT is not a port number: fix or unset it"
    [[ $CPU_PROCS =~ ^[1-9][0-9]*$ ]] || die "CPU_PROCS=$CPU_PROCS: set a positive number"
}

# The interpreter, in the order: PYTHON, VENV's (or the container's) python, .venv/bin/python, python3.
resolve_python() {
    if [[ -n $PYTHON ]]; then
        :
    elif [[ -n $VENV || ${CONTAINER:-0} == 1 ]]; then
        PYTHON=python
    elif [[ -x .venv/bin/python ]]; then
        PYTHON=.venv/bin/python
    else
        PYTHON=python3
    fi
}

activate_venv() {
    [[ -z $VENV ]] && return 0
    [[ -f $VENV/bin/activate ]] \
        || die "VENV=$VENV has no bin/activate: create it (python3 -m venv \"$VENV\") or unset VENV"
    # shellcheck disable=SC1091 # the user's environment
    source "$VENV/bin/activate"
}

# The Python environment on this machine can run the trainer.
check_python() {
    command -v "$PYTHON" >/dev/null 2>&1 \
        || die "PYTHON=$PYTHON not found: install the project (pip install -e .) and set PYTHON or VENV"
    local missing
    missing=$("$PYTHON" -c 'import importlib.util as u
print(" ".join(m for m in ("torch", "deepspeed", "transformers", "datasets") if u.find_spec(m) is None))') \
        || die "PYTHON=$PYTHON does not run: set PYTHON or VENV to a working Python environment"
    [[ -z $missing ]] \
        || die "PYTHON=$PYTHON lacks $missing: install the project into it (pip install -e .) or set PYTHON/VENV"
}

# ---- CUDA toolkit and architectures.

installed_cuda_versions() {
    local dir versions=() modules=()
    for dir in "$CUDA_ROOT"/cuda-*/; do
        [[ -d $dir ]] && versions+=("$(basename "$dir" | sed 's/^cuda-//')")
    done
    # Lmod writes `avail` to stderr.
    [[ -z ${LMOD_CMD:-} ]] || mapfile -t modules < <("$LMOD_CMD" bash -t avail cuda 2>&1 >/dev/null | sed -n 's|^cuda/||p')
    versions+=("${modules[@]}")
    echo "${versions[*]:-none}"
}

major_minor() { [[ $1 =~ ^([0-9]+\.[0-9]+) ]] && echo "${BASH_REMATCH[1]}"; }

# The CUDA release of the nvcc on PATH (e.g. 12.9), empty without one.
nvcc_release() {
    command -v nvcc >/dev/null 2>&1 || return 0
    nvcc --version | sed -n 's/.*release \([0-9]*\.[0-9]*\).*/\1/p'
}

# Put CUDA_VERSION first on PATH (CUDA_ROOT/cuda-X, or Lmod's cuda/X module).
select_cuda() {
    if [[ -n ${TORCH_CUDA_ARCH_LIST:-} ]]; then
        # The trainer's own normalisation (9.0a -> 9.0, +PTX kept), which also names a malformed entry.
        local normalized
        normalized=$("${PYTHON:-python3}" src/model_utils/core/cuda_arch.py "$TORCH_CUDA_ARCH_LIST" 2>&1) || die "$normalized"
        export TORCH_CUDA_ARCH_LIST=$normalized
    fi
    [[ -z $CUDA_VERSION ]] && return 0
    local dir=$CUDA_ROOT/cuda-$CUDA_VERSION
    # NVIDIA's images (NGC PyTorch included) export CUDA_VERSION as major.minor.patch, while toolkits install as
    # cuda-major.minor: accept that spelling for the installed toolkit.
    if [[ ! -d $dir && $CUDA_VERSION =~ ^([0-9]+\.[0-9]+)\.[0-9]+$ && -d $CUDA_ROOT/cuda-${BASH_REMATCH[1]} ]]; then
        dir=$CUDA_ROOT/cuda-${BASH_REMATCH[1]}
    fi
    if [[ -d $dir ]]; then
        export CUDA_HOME=$dir
        export PATH=$dir/bin:$PATH
        export LD_LIBRARY_PATH=$dir/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    elif [[ -n ${LMOD_CMD:-} ]] && "$LMOD_CMD" bash -t avail "cuda/$CUDA_VERSION" 2>&1 | grep -q "^cuda/$CUDA_VERSION"; then
        eval "$("$LMOD_CMD" bash load "cuda/$CUDA_VERSION")"
    elif [[ $(nvcc_release) == "$(major_minor "$CUDA_VERSION")" ]]; then
        log "CUDA_VERSION=$CUDA_VERSION: the toolkit already on PATH ($(command -v nvcc)) is that version"
    else
        die "CUDA_VERSION=$CUDA_VERSION is not installed ($dir missing, no cuda/$CUDA_VERSION module); installed: $(installed_cuda_versions)"
    fi
}

# ---- Nodes and GPUs.

check_node_exists() { # check_node_exists NODE
    need_cmd scontrol "running on node $1 needs SLURM's client tools"
    scontrol show node "$1" >/dev/null 2>&1 \
        || die "unknown node '$1': pick one of $(sinfo -h -o %N 2>/dev/null | sort -u | paste -sd ' ') (sinfo -N lists them)"
}

# "NAME NODE_COUNT" of PARTITION, or of the default partition.
partition_nodes() {
    scontrol show partition ${PARTITION:+"$PARTITION"} -o 2>/dev/null | awk -v want="$PARTITION" '
        (want == "" && /Default=YES/) || (want != "" && $1 == "PartitionName=" want) {
            for (i = 1; i <= NF; i++) if ($i ~ /^TotalNodes=/) { sub(/TotalNodes=/, "", $i); sub(/PartitionName=/, "", $1); print $1, $i; exit }
        }'
}

check_node_count() { # check_node_count WANTED
    need_cmd scontrol "submitting jobs needs SLURM's client tools"
    [[ $1 =~ ^[1-9][0-9]*$ ]] || die "NODES=$1 is not a positive number: fix or unset it"
    local name have
    read -r name have < <(partition_nodes) || true
    [[ -n $have ]] || die "PARTITION=${PARTITION:-(default)} not found: set PARTITION to one of $(sinfo -h -o %R | paste -sd ' ')"
    ((have >= $1)) || die "NODES=$1 but partition $name has $have nodes: set NODES<=$have or another PARTITION"
}

# The GPUs SLURM has configured (Gres=gpu[:type]:N) on NODE, or on every node of
# the partition (the smallest count); 0 when it has none.
configured_gpus() { # configured_gpus node NAME | configured_gpus partition [NAME]
    local gres
    if [[ $1 == node ]]; then
        gres=$(scontrol show node "$2" -o 2>/dev/null | grep -o 'Gres=[^ ]*' || true)
    else
        gres=$(sinfo -h ${2:+--partition="$2"} -o %G 2>/dev/null || true)
    fi
    sed -n 's/.*gpu:\([^:(,]*:\)\{0,1\}\([0-9][0-9]*\).*/\2/p; t; s/.*/0/p' <<<"$gres" | sort -n | head -n1
}

# The GPUs per node a job asks for: GPUS_PER_NODE, else those SLURM has configured on the nodes.
gpus_to_request() { # gpus_to_request node NAME | gpus_to_request partition [NAME]
    echo "${GPUS_PER_NODE:-$(configured_gpus "$@")}"
}

# The nodes a batch script asks for: NODES, else its #SBATCH --nodes line.
script_nodes() { # script_nodes SCRIPT
    echo "${NODES:-$(sed -n 's/^#SBATCH --nodes=//p' "$1")}"
}

# Ask for the GPUs (without a GPU request, nodes that constrain devices show a job none).
GRES_ARGS=()
request_gpus() { # request_gpus node NAME | request_gpus partition [NAME]
    local gpus
    gpus=$(gpus_to_request "$@")
    GRES_ARGS=()
    ((${gpus:-0} > 0)) && GRES_ARGS=(--gres=gpu:"$gpus")
    return 0
}

# GPUs of one node of the job: GPUS_PER_NODE; outside SLURM the entries of CUDA_VISIBLE_DEVICES where it is set (the
# GPUs the user gave the run: a process for each, LOCAL_RANK indexing them); else `nvidia-smi -L` on the node (0
# without nvidia-smi).
detect_gpus_per_node() {
    if [[ -n $GPUS_PER_NODE ]]; then
        echo "$GPUS_PER_NODE"
        return
    fi
    if ! in_allocation && [[ -v CUDA_VISIBLE_DEVICES ]]; then
        count_devices "$CUDA_VISIBLE_DEVICES"
        return
    fi
    local probe=(bash -c 'command -v nvidia-smi >/dev/null && nvidia-smi -L || true')
    # Under salloc this shell is not on the job's nodes: ask the first one.
    in_batch_job || ! in_allocation || probe=(srun --nodes=1 --ntasks=1 "${probe[@]}")
    "${probe[@]}" | grep -c '^GPU ' || true
}

# Entries of a comma-separated device list (CUDA_VISIBLE_DEVICES, SLURM_JOB_GPUS); 0 for none (empty, NoDevFiles).
count_devices() {
    if [[ -z $1 || $1 == NoDevFiles ]]; then
        echo 0
    else
        local entries
        IFS=, read -ra entries <<<"$1"
        echo "${#entries[@]}"
    fi
}

# GPUs SLURM gave this job on this node: SLURM_GPUS_ON_NODE, else the entries of SLURM_JOB_GPUS or
# CUDA_VISIBLE_DEVICES; 0 when it gave none.
allocated_gpus() {
    if [[ -n ${SLURM_GPUS_ON_NODE:-} ]]; then
        echo "$SLURM_GPUS_ON_NODE"
    else
        count_devices "${SLURM_JOB_GPUS:-${CUDA_VISIBLE_DEVICES:-}}"
    fi
}

# Inside a job on a cluster where SLURM manages GPUs (GresTypes has gpu): stop before anything starts when the node
# has GPUs (nvidia-smi lists them, or its Gres says so) but the job was given none. Such a job would train on CPU, or
# on GPUs it was not allocated. An --exclusive job is given all of its nodes' GRES (sbatch's documentation), so this
# catches a configuration or SLURM version that does not, and a GPU request removed from the script.
check_job_gpus() { # check_job_gpus VISIBLE_GPUS
    [[ -n $GPUS_PER_NODE ]] && return 0  # the user said how many
    in_allocation || return 0
    local config
    config=$(scontrol show config 2>/dev/null || true)  # read whole: grep -q would cut the pipe (pipefail)
    grep -Eq '^GresTypes *= *.*gpu' <<<"$config" || return 0
    local node=${SLURMD_NODENAME:-$(hostname -s)} configured
    configured=$(configured_gpus node "$node")
    (($1 > 0 || configured > 0)) || return 0
    (($(allocated_gpus) > 0)) && return 0
    die "job ${SLURM_JOB_ID} was given no GPUs, but node $node has $(($1 > configured ? $1 : configured)): it would train on CPU. Submit with ./$LAUNCHER (it requests them), or sbatch --gpus-per-node=N $LAUNCHER, or uncomment the '#SBATCH --gpus-per-node' line in $LAUNCHER"
}

# ---- Command lines.

# TRAINER_ARGS: the flags of the settings that are set, --preflight, then "$@" (the trainer lets the flags after
# --config override the file's).
build_trainer_args() {
    local pair var
    TRAINER_ARGS=()
    for pair in CONFIG:--config DATASET:--dataset DATASET_CONFIG_NAME:--dataset_config_name LOCAL_DATASET:--local_dataset \
        MODEL:--model TOKENIZER:--tokenizer MAX_STEPS:--max_steps CHECKPOINT_FREQ:--checkpoint_freq \
        CHECKPOINT_DIR:--checkpoint_dir DS_CONFIG:--ds_config SEQ_LEN:--seq_len SEQUENCE_PARALLEL:--sequence_parallel \
        OUTPUT_DIR:--export_dir; do
        var=${pair%%:*}
        [[ -n ${!var} ]] && TRAINER_ARGS+=("${pair#*:}" "${!var}")
    done
    [[ $PREFLIGHT == 1 ]] && TRAINER_ARGS+=(--preflight)
    TRAINER_ARGS+=("$@")
}

# Where the run would go, for PREFLIGHT=1 (the trainer plans the batch, memory and resume for that many ranks): set by
# the launcher's mode before check_before_allocation. standalone: this machine; sbatch SCRIPT; salloc [NODE].
RUN_TARGET=()

# The ranks of a run on this machine without SLURM: one per GPU, else CPU_PROCS.
standalone_world_size() {
    local gpus
    gpus=$(detect_gpus_per_node)
    echo $((gpus > 0 ? gpus : CPU_PROCS))
}

# The world size of the run RUN_TARGET describes: nodes x one rank per GPU (one rank on a node without GPUs).
planned_world_size() {
    local nodes=1 gpus
    case ${RUN_TARGET[0]:-} in
        standalone) standalone_world_size; return ;;
        sbatch) nodes=$(script_nodes "${RUN_TARGET[1]}") ;;
        salloc) ;;
        *) return 0 ;;
    esac
    if [[ -n ${RUN_TARGET[1]:-} && ${RUN_TARGET[0]} == salloc ]]; then
        gpus=$(gpus_to_request node "${RUN_TARGET[1]}")
    else
        gpus=$(gpus_to_request partition "$PARTITION")
    fi
    echo $((${nodes:-1} * $(tasks_per_node "${gpus:-0}")))
}

# PREFLIGHT=1: the trainer's checks with this machine's Python, no allocation, for the world size the run would have.
run_preflight() {
    local world
    if [[ $CONTAINER == 1 ]]; then  # the checks run on this host, outside the container: its Python
        activate_venv
        CONTAINER=0 resolve_python
        check_python
    fi
    world=$(planned_world_size)
    if [[ -n $world ]]; then
        export WORLD_SIZE=$world
        log "preflight: planned for the $world processes this launcher would start (${RUN_TARGET[*]})"
    fi
    build_trainer_args "$@"
    show_cmd "$PYTHON" "$TRAINER_SCRIPT" "${TRAINER_ARGS[@]}"
    [[ $DRY_RUN == 1 ]] && exit 0
    exec "$PYTHON" "$TRAINER_SCRIPT" "${TRAINER_ARGS[@]}"
}

# Pyxis flags: the image, mounts covering the repository and CHECKPOINT_DIR, workdir. With CONTAINER_EDF (CSCS
# Alps), the Environment Definition File names the image, mounts and workdir instead: --environment=EDF.
container_args() {
    local image=$CONTAINER_IMAGE mounts="$PWD:$PWD" ckpt
    if [[ -n $CONTAINER_EDF ]]; then
        local edf=$CONTAINER_EDF
        if [[ $edf == */* || $edf == *.toml ]]; then
            [[ -f $edf ]] || die "CONTAINER_EDF=$edf: no such file: copy configs/cscs-edf.toml, set its paths, and point CONTAINER_EDF at it"
            edf=$(cd "$(dirname "$edf")" && pwd)/$(basename "$edf")
            grep -qF "$PWD" "$edf" || log "warning: $edf does not mention $PWD: its mounts and workdir must cover the repository"
        else
            [[ -f $HOME/.edf/$edf.toml ]] || die "CONTAINER_EDF=$edf: no $HOME/.edf/$edf.toml: copy configs/cscs-edf.toml there, or give a path"
        fi
        CONTAINER_ARGS=(--environment="$edf")
        return 0
    fi
    if [[ $image == *.sqsh || $image == /* || $image == ./* ]]; then
        [[ -f $image ]] || die "CONTAINER_IMAGE=$image: no such file: build it with ./setup-pyxis.sh or set CONTAINER_IMAGE"
        image=$(cd "$(dirname "$image")" && pwd)/$(basename "$image")
    fi
    if [[ $CHECKPOINT_DIR == /* && $CHECKPOINT_DIR != "$PWD"/* ]]; then
        ckpt=${CHECKPOINT_DIR%/}
        mounts+=",$ckpt:$ckpt"
    fi
    CONTAINER_ARGS=(--container-image="$image" --container-mounts="$mounts${CONTAINER_MOUNTS:+,$CONTAINER_MOUNTS}"
        --container-workdir="$PWD")
}

# ---- Running.

job_header() { # job_header WORLD_SIZE GPUS_PER_NODE
    log "job ${SLURM_JOB_ID:-none} on ${SLURM_JOB_NODELIST:-$(hostname)}; world size $1 ($2 GPUs per node); restart count ${SLURM_RESTART_COUNT:-0}"
    log "MASTER_ADDR=${MASTER_ADDR:-} MASTER_PORT=${MASTER_PORT:-}"
    local setting
    for setting in $(compgen -e | grep -E '^(NCCL_|FI_|TORCH_CUDA_ARCH_LIST$|CUDA_HOME$|VENV$)' || true); do
        log "$setting=${!setting}"
    done
}

# One task per GPU; one (CPU, gloo) on a node without GPUs.
tasks_per_node() { # tasks_per_node GPUS
    echo $(($1 > 0 ? $1 : 1))
}

# STEP: the srun command of the training step, TASKS_PER_NODE tasks on each
# node of the allocation (CONTAINER=1 adds the Pyxis flags).
compose_job_step() { # compose_job_step TASKS_PER_NODE CPUS_PER_TASK
    STEP=(srun --ntasks-per-node="$1" ${2:+--cpus-per-task="$2"} --chdir="$PWD")
    if [[ ${CONTAINER:-0} == 1 ]]; then
        container_args
        STEP+=("${CONTAINER_ARGS[@]}")
    fi
    STEP+=(bash -c "$TASK_WRAPPER" _ "$PYTHON" "$TRAINER_SCRIPT" "${TRAINER_ARGS[@]}")
}

# Run "$@" in the background, forward USR1 and TERM (and INT, as TERM) to it,
# and return its exit status once it has really exited.
run_forwarding_signals() {
    "$@" &
    local pid=$! status
    trap 'FORWARDED=1 FORWARDED_SIGNAL=USR1; log "USR1: forwarding to the training step (checkpoint, then stop)"; kill -USR1 "$pid"' USR1
    trap 'FORWARDED=1 FORWARDED_SIGNAL=TERM; log "TERM: forwarding to the training step (checkpoint, then stop)"; kill -TERM "$pid"' TERM
    trap 'FORWARDED=1 FORWARDED_SIGNAL=INT; log "INT: forwarding TERM to the training step (checkpoint, then stop)"; kill -TERM "$pid"' INT
    while :; do
        FORWARDED=0
        wait "$pid" && status=0 || status=$?
        # Above 128 after a trapped signal: wait was interrupted, or the step died of a signal.
        ((FORWARDED && status > 128)) || break
        kill -0 "$pid" 2>/dev/null && continue # still running: wait for it again
        # It exited just after the signal: its own status, which the interrupted wait did not return. Bash can lose
        # it when the step exits during the trap (wait then says 127, or -1): the interrupted status stands then.
        local again=0
        wait "$pid" || again=$?
        ((again == 127 || again < 0)) || status=$again
        break
    done
    trap - USR1 TERM INT
    return "$status"
}

# Seconds this job has left (squeue's %L: [D-][HH:]MM:SS), 0 past its limit, -1 without a limit.
job_seconds_left() {
    local left days=0 seconds=0 part
    left=$(squeue -h -j "$SLURM_JOB_ID" -o %L 2>/dev/null | head -n1)
    case $left in
        "" | UNLIMITED | NOT_SET) echo -1; return ;;
        INVALID) echo 0; return ;;
    esac
    if [[ $left == *-* ]]; then days=${left%%-*}; left=${left#*-}; fi
    IFS=: read -ra parts <<<"$left"
    for part in "${parts[@]}"; do seconds=$((seconds * 60 + 10#$part)); done
    echo $((days * 86400 + seconds))
}

# Whether the trainer stopped because the job's time is running out: SLURM's warning signal (USR1, from
# --signal=B:USR1@N), or TERM at the time limit. TERM with time left is scancel or an administrator.
stopped_for_time() {
    [[ ${FORWARDED_SIGNAL:-} == USR1 ]] && return 0
    local left
    left=$(job_seconds_left)
    ((left >= 0 && left <= REQUEUE_TERM_WITHIN))
}

# Inside an allocation (sbatch or salloc): one srun task per GPU, one per node
# without GPU. A batch job whose trainer stopped with RESUME_STATUS after a
# signal requeues itself; the requeued run resumes from CHECKPOINT_DIR.
run_job_step() {
    local gpus tasks hosts cpus status
    check_settings
    [[ ${CONTAINER:-0} == 1 ]] || select_cuda
    resolve_python
    build_trainer_args "$@"
    gpus=$(detect_gpus_per_node)
    check_job_gpus "$gpus"
    tasks=$(tasks_per_node "$gpus")
    cpus=${SLURM_JOB_CPUS_PER_NODE:-1}
    cpus=${cpus%%[(,]*}
    mapfile -t hosts < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
    export MASTER_ADDR=${hosts[0]}
    export MASTER_PORT=${MASTER_PORT:-$((29500 + SLURM_JOB_ID % 1000))}
    compose_job_step "$tasks" "$((cpus / tasks > 0 ? cpus / tasks : 1))"
    job_header "$((${#hosts[@]} * tasks))" "$gpus"
    show_cmd "${STEP[@]}"
    [[ $DRY_RUN == 1 ]] && return 0
    run_forwarding_signals "${STEP[@]}" && status=0 || status=$?
    log "training step finished with status $status"
    if ((status == RESUME_STATUS)) && in_batch_job && ! stopped_for_time; then
        # scancel arrives as TERM too: the checkpoint is saved, but a job the user stopped stays stopped.
        log "stopped by ${FORWARDED_SIGNAL:-a signal} with time left (scancel?): not requeueing; submitting the job again resumes from the checkpoint"
    elif ((status == RESUME_STATUS)) && in_batch_job; then
        log "the trainer saved a checkpoint and stopped: requeueing job $SLURM_JOB_ID"
        run_cmd scontrol requeue "$SLURM_JOB_ID"
    elif ((status == RESUME_STATUS)); then
        log "the trainer saved a checkpoint and stopped: run the same command again to resume"
    fi
    return "$status"
}

# DRY_RUN=1 before an allocation: what the job will run on its first node.
preview_job_step() {
    resolve_python
    build_trainer_args "$@"
    local gpus=${GPUS_PER_NODE:-}  # what the job will use; else the GPUs requested, or N: counted on the node
    [[ -n $gpus || ${#GRES_ARGS[@]} -eq 0 ]] || gpus=${GRES_ARGS[0]#--gres=gpu:}
    if [[ -n $gpus ]]; then
        compose_job_step "$(tasks_per_node "$gpus")" ""
        echo "# then in the allocation, with MASTER_ADDR its first node:"
    else
        compose_job_step N ""
        echo "# then in the allocation, with MASTER_ADDR its first node and N the GPUs nvidia-smi -L counts there (1 without GPU):"
    fi
    show_cmd "${STEP[@]}"
}

# Outside SLURM: one trainer process per local GPU, or CPU_PROCS processes, started by run_local_ranks.
run_standalone() {
    local gpus nproc status
    RUN_TARGET=(standalone)
    check_before_allocation "$@"
    build_trainer_args "$@"
    gpus=$(detect_gpus_per_node)
    nproc=$(standalone_world_size)
    export MASTER_ADDR=127.0.0.1
    if [[ $DRY_RUN == 1 ]]; then
        log "this machine: $nproc processes ($gpus GPUs), each running with RANK=LOCAL_RANK=0..$((nproc - 1)) WORLD_SIZE=$nproc MASTER_ADDR=$MASTER_ADDR MASTER_PORT=${MASTER_PORT:-<a free port>}:"
    else
        export MASTER_PORT=${MASTER_PORT:-$(free_port)}
        log "this machine: $nproc processes ($gpus GPUs), each running with RANK=LOCAL_RANK=0..$((nproc - 1)) WORLD_SIZE=$nproc MASTER_ADDR=$MASTER_ADDR MASTER_PORT=$MASTER_PORT:"
    fi
    local cmd=("$PYTHON" "$TRAINER_SCRIPT" "${TRAINER_ARGS[@]}")
    show_cmd "${cmd[@]}"
    [[ $DRY_RUN == 1 ]] && exit 0
    run_local_ranks "$nproc" "${cmd[@]}" && status=0 || status=$?
    log "training finished with status $status"
    ((status != RESUME_STATUS)) || log "the trainer saved a checkpoint and stopped: run the same command again to resume"
    exit "$status"
}

# A TCP port free on this machine now (the kernel picks it).
free_port() {
    "$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# Run NPROC copies of COMMAND as the ranks of one job on this machine (RANK, LOCAL_RANK, WORLD_SIZE set) and return
# the job's exit status: the first failing rank's, else 75 when the ranks stopped after a signal's checkpoint, else 0.
# Started here rather than by torchrun, so that USR1 and TERM (and INT, as TERM) reach every rank and the status is
# the trainer's own: torchrun exits 1 with a traceback when it is signalled. A rank that fails stops the others (TERM,
# then KILL after RANK_STOP_GRACE seconds) instead of leaving them waiting in a collective.
run_local_ranks() { # run_local_ranks NPROC COMMAND...
    local nproc=$1 rank pid code status=0 failed=0 killer=""
    shift
    local -a ranks=() running=()
    local -A rank_of=()
    export WORLD_SIZE=$nproc LOCAL_WORLD_SIZE=$nproc
    for ((rank = 0; rank < nproc; rank++)); do
        RANK=$rank LOCAL_RANK=$rank "$@" &
        ranks+=("$!")
        rank_of[$!]=$rank
    done
    trap 'FORWARDED_SIGNAL=USR1; log "USR1: forwarding to the $nproc ranks (checkpoint, then stop)"; kill -USR1 "${ranks[@]}" 2>/dev/null || true' USR1
    trap 'FORWARDED_SIGNAL=TERM; log "TERM: forwarding to the $nproc ranks (checkpoint, then stop)"; kill -TERM "${ranks[@]}" 2>/dev/null || true' TERM
    trap 'FORWARDED_SIGNAL=INT; log "INT: forwarding TERM to the $nproc ranks (checkpoint, then stop)"; kill -TERM "${ranks[@]}" 2>/dev/null || true' INT
    while ((${#ranks[@]})); do
        # A trapped signal interrupts this wait at once; a rank's exit is seen within a second.
        sleep 1 >/dev/null 2>&1 &
        wait "$!" || true
        running=()
        for pid in "${ranks[@]}"; do
            if kill -0 "$pid" 2>/dev/null; then
                running+=("$pid")
                continue
            fi
            wait "$pid" && code=0 || code=$?
            if ((code == RESUME_STATUS && status == 0)); then
                status=$code
            elif ((code != 0 && code != RESUME_STATUS && !failed)); then
                failed=1 status=$code
                log "rank ${rank_of[$pid]} exited with status $code: stopping the other ranks"
            fi
        done
        ranks=("${running[@]}")
        if ((failed && ${#ranks[@]})) && [[ -z $killer ]]; then
            kill -TERM "${ranks[@]}" 2>/dev/null || true
            (sleep "$RANK_STOP_GRACE" && kill -KILL "${ranks[@]}") >/dev/null 2>&1 &
            killer=$!
        fi
    done
    [[ -z $killer ]] || kill "$killer" 2>/dev/null || true
    trap - USR1 TERM INT
    return "$status"
}

# Before anything is allocated: every check of the settings and the
# environment (CONTAINER says which); PREFLIGHT=1 then runs the trainer's own
# checks here and exits.
check_before_allocation() { # check_before_allocation TRAINER_ARGS...
    check_settings
    if [[ $CONTAINER == 1 ]]; then
        [[ -z $CUDA_VERSION ]] || log "CUDA_VERSION=$CUDA_VERSION ignored: the container image brings its CUDA"
        container_args
    else
        select_cuda
        activate_venv
        resolve_python
        check_python
    fi
    [[ $PREFLIGHT == 1 ]] && run_preflight "$@"
    return 0
}

# The sbatch launchers: inside the batch job, run the training step; outside,
# check everything, then submit SCRIPT with sbatch (NODES, PARTITION and
# GPUS_PER_NODE override its #SBATCH lines).
sbatch_main() { # sbatch_main SCRIPT CONTAINER(0|1) TRAINER_ARGS...
    local script=$1
    CONTAINER=$2
    LAUNCHER=$(basename "$script")
    shift 2
    if in_batch_job; then
        run_job_step "$@"
        return
    fi
    RUN_TARGET=(sbatch "$script")
    check_before_allocation "$@"
    check_node_count "$(script_nodes "$script")"
    request_gpus partition "$PARTITION"
    local submit=(sbatch ${PARTITION:+--partition="$PARTITION"} ${NODES:+--nodes="$NODES"} "${GRES_ARGS[@]}")
    [[ $DRY_RUN == 1 ]] || mkdir -p logs
    run_cmd "${submit[@]}" "$script" "$@"
    [[ $DRY_RUN == 1 ]] && preview_job_step "$@"
    return 0
}

# The single-node launchers. With a first argument NODE (or always, for the
# container), allocate one node with salloc and run this launcher again inside
# the allocation; inside an allocation, run the training step; otherwise run
# on this machine (run_standalone).
single_node_main() { # single_node_main CONTAINER(0|1) [NODE] TRAINER_ARGS...
    CONTAINER=$1
    shift
    local node=""
    if [[ $# -gt 0 && $1 != -* ]]; then
        node=$1
        shift
    fi
    if [[ -z $node ]] && in_allocation; then
        run_job_step "$@"
        return
    fi
    if [[ -z $node && $CONTAINER == 0 ]]; then
        run_standalone "$@"
    fi
    [[ -z $node ]] || check_node_exists "$node"
    RUN_TARGET=(salloc ${node:+"$node"})
    check_before_allocation "$@"
    if [[ -n $node ]]; then
        request_gpus node "$node"
    else
        request_gpus partition "$PARTITION"
    fi
    local alloc=(salloc --nodes=1 --exclusive --job-name="${LAUNCHER%.sh}" ${node:+--nodelist="$node"}
        ${PARTITION:+--partition="$PARTITION"} "${GRES_ARGS[@]}")
    run_cmd "${alloc[@]}" "$PWD/$LAUNCHER" "$@"
    [[ $DRY_RUN == 1 ]] && preview_job_step "$@"
    return 0
}
