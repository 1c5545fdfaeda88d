#!/usr/bin/env bash
# Shared by the sbatch scripts in slurm/: environment set-up, experiment directories, the torchrun launch, and
# checkpoint-then-requeue on Slurm's warning signal. Nothing here is site-specific; every setting below can be
# given in the environment (`sbatch --export=ALL,RUNS_DIR=/scratch/runs ...` or exported before sbatch).
#
#   REPO_DIR        the collab-vit checkout                 (default: the directory sbatch was called from)
#   ENV_SETUP       a shell file sourced first: `module load ...`, `conda activate ...`   (default: none)
#   VENV            a virtual environment to activate      (default: $REPO_DIR/.venv when it exists)
#   PYTHON          the Python that runs the jobs          (default: python)
#   RUNS_DIR        where experiment directories go        (default: $REPO_DIR/runs)
#   EXPERIMENT      experiment name = directory under RUNS_DIR (default: the config's file name, e.g. deit_base_collab_k192)
#   NPROC_PER_NODE  training processes per node            (default: the GPUs Slurm gave each node, else 1)
#   RDZV_PORT       rendezvous port on the first node      (default: 29500 + job id mod 1000)
#
# Partition, account, GPUs, CPUs, memory and time are sbatch options (`sbatch -p P -A A --gpus-per-node=8 ...`).

REPO_DIR=${REPO_DIR:-${SLURM_SUBMIT_DIR:-$PWD}}
RUNS_DIR=${RUNS_DIR:-$REPO_DIR/runs}
PYTHON=${PYTHON:-python}
export REPO_DIR RUNS_DIR PYTHON

# Activate the Python environment and move to the checkout.
setup_env() {
    cd "$REPO_DIR" || { echo "error: REPO_DIR $REPO_DIR does not exist" >&2; exit 2; }
    if [[ -n ${ENV_SETUP:-} ]]; then
        # shellcheck disable=SC1090  # a file of the user's
        source "$ENV_SETUP"
    fi
    local venv=${VENV:-$REPO_DIR/.venv}
    if [[ -f $venv/bin/activate ]]; then
        # shellcheck disable=SC1091  # the user's environment
        source "$venv/bin/activate"
    elif [[ -n ${VENV:-} ]]; then
        echo "error: VENV $VENV has no bin/activate" >&2
        exit 2
    fi
}

# GPUs per node that Slurm allocated (SLURM_GPUS_ON_NODE, else the count in SLURM_GPUS_PER_NODE), else 1.
default_nproc_per_node() {
    local gpus=${SLURM_GPUS_ON_NODE:-${SLURM_GPUS_PER_NODE:-}}
    gpus=${gpus##*:}  # "a100:8" -> "8"
    if [[ $gpus =~ ^[0-9]+$ ]] && (( gpus > 0 )); then echo "$gpus"; else echo 1; fi
}

# Export what slurm/launch.sh needs: NNODES, NPROC_PER_NODE, RDZV_ENDPOINT (first node), RDZV_ID (the job id).
set_rendezvous() {
    local first_node
    first_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
    NNODES=${SLURM_JOB_NUM_NODES:-1}
    NPROC_PER_NODE=${NPROC_PER_NODE:-$(default_nproc_per_node)}
    RDZV_ENDPOINT=$first_node:${RDZV_PORT:-$((29500 + SLURM_JOB_ID % 1000))}
    RDZV_ID=$SLURM_JOB_ID
    export NNODES NPROC_PER_NODE RDZV_ENDPOINT RDZV_ID
    if [[ -n ${SLURM_CPUS_PER_TASK:-} && -z ${OMP_NUM_THREADS:-} ]]; then
        export OMP_NUM_THREADS=$(( SLURM_CPUS_PER_TASK / NPROC_PER_NODE > 0 ? SLURM_CPUS_PER_TASK / NPROC_PER_NODE : 1 ))
    fi
}

# One job step with one task per node (each runs slurm/launch.sh: a torchrun agent), logs in $exp_dir/logs.
srun_per_node() {
    local exp_dir=$1
    shift
    local cpus=()
    [[ -n ${SLURM_CPUS_PER_TASK:-} ]] && cpus=(--cpus-per-task="$SLURM_CPUS_PER_TASK")
    srun --nodes="$NNODES" --ntasks-per-node=1 "${cpus[@]}" --kill-on-bad-exit=1 --open-mode=append \
        --output="$exp_dir/logs/%x-%j-node%n.log" bash "$REPO_DIR/slurm/launch.sh" "$@"
}

# Wait for the background process PID and return its exit status; a trap that runs meanwhile interrupts `wait`, so
# wait again until the process has ended.
wait_child() {
    local pid=$1 status=0
    while true; do
        wait "$pid" && status=0 || status=$?
        kill -0 "$pid" 2>/dev/null || break
    done
    return "$status"
}

# Run "$@" in the background and wait. SIGUSR1 (sbatch --signal=B:USR1@T, or scancel --batch --signal=USR1)
# or SIGTERM to the batch shell create $exp_dir/STOP: the trainer checkpoints at its next update and exits.
# Sets REQUEUE_ASKED=1 when the signal was USR1 (time limit near: requeue afterwards).
run_stoppable() {
    local exp_dir=$1
    shift
    REQUEUE_ASKED=0
    trap 'REQUEUE_ASKED=1; touch "$exp_dir/STOP"; echo "$(date -Is) SIGUSR1: asked the trainer to checkpoint"' USR1
    trap 'touch "$exp_dir/STOP"; echo "$(date -Is) SIGTERM: asked the trainer to checkpoint"' TERM
    "$@" &
    local pid=$! status=0
    wait_child "$pid" || status=$?
    trap - USR1 TERM
    return "$status"
}

# Train CONFIG in $RUNS_DIR/$EXPERIMENT across all nodes of this job, resuming from last.pth when it exists,
# and requeue this job when Slurm's warning signal stopped it before the end.
train_job() {
    local config=$1
    shift
    [[ -f $REPO_DIR/$config || -f $config ]] || { echo "error: config not found: $config" >&2; exit 2; }
    local experiment=${EXPERIMENT:-$(basename "$config" .yaml)}
    local exp_dir=$RUNS_DIR/$experiment
    mkdir -p "$exp_dir/logs"
    if [[ -f $exp_dir/model.safetensors ]]; then
        echo "$experiment already finished ($exp_dir/model.safetensors); nothing to do"
        return 0
    fi
    local resume=()
    [[ -f $exp_dir/last.pth ]] && resume=(--resume)
    set_rendezvous
    echo "$(date -Is) job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}): $experiment on $NNODES node(s) x" \
        "$NPROC_PER_NODE process(es), rendezvous $RDZV_ENDPOINT, ${resume[*]:-new run} -> $exp_dir" |
        tee -a "$exp_dir/logs/jobs.log"
    local status=0
    run_stoppable "$exp_dir" srun_per_node "$exp_dir" train.py -c "$config" --output "$exp_dir" "${resume[@]}" "$@" ||
        status=$?
    if [[ -f $exp_dir/model.safetensors ]]; then
        echo "$(date -Is) job $SLURM_JOB_ID: $experiment finished" | tee -a "$exp_dir/logs/jobs.log"
    elif (( REQUEUE_ASKED )) && (( status == 0 )); then
        echo "$(date -Is) job $SLURM_JOB_ID: checkpoint saved, requeueing" | tee -a "$exp_dir/logs/jobs.log"
        scontrol requeue "$SLURM_JOB_ID"
    fi
    return "$status"
}

# `collab-vit convert "$@"` (--out OUT among them) as one job step on this task's CPUs, its log in OUT's folder/logs,
# on the job's GPU where it has one (--device defaults to cuda there). Slurm's warning signal (USR1: the time limit is
# near) or a preemption's SIGTERM stops the conversion at once (its finished layers stay committed in OUT.partial) and
# requeues the job: the same command then resumes where it stopped and ends with an uninterrupted run's weights.
# Sets CONVERT_REQUEUED=1 when it requeued; returns the conversion's exit status.
convert_job() {
    local out="" args=("$@") i
    for (( i = 0; i < ${#args[@]}; i++ )); do
        [[ ${args[i]} == --out ]] && out=${args[i + 1]:-}
        [[ ${args[i]} == --out=* ]] && out=${args[i]#--out=}
    done
    [[ -n $out ]] || { echo "error: collab-vit convert needs --out OUT" >&2; exit 2; }
    mkdir -p "$(dirname "$out")/logs"
    local threads=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}} cpus=()
    [[ -n ${SLURM_CPUS_PER_TASK:-} ]] && cpus=(--cpus-per-task="$SLURM_CPUS_PER_TASK")
    CONVERT_REQUEUED=0  # read by the caller
    local stop=0
    srun --nodes=1 --ntasks=1 "${cpus[@]}" --open-mode=append --output="$(dirname "$out")/logs/%x-%j-convert.log" \
        env OMP_NUM_THREADS="$threads" "$PYTHON" -m collab_vit.cli convert "$@" &
    local pid=$! status=0
    trap 'stop=1; echo "$(date -Is) job ${SLURM_JOB_ID:-}: SIGUSR1, stopping the conversion"; kill -TERM "$pid" || true' USR1
    trap 'stop=1; echo "$(date -Is) job ${SLURM_JOB_ID:-}: SIGTERM, stopping the conversion"; kill -TERM "$pid" || true' TERM
    wait_child "$pid" || status=$?
    trap - USR1 TERM
    if (( stop )) && [[ -d $out.partial || ! -e $out ]]; then
        echo "$(date -Is) job ${SLURM_JOB_ID:-}: requeueing; the same command resumes from $out.partial"
        # shellcheck disable=SC2034  # read by the caller
        CONVERT_REQUEUED=1
        scontrol requeue "$SLURM_JOB_ID"
        return 0
    fi
    return "$status"
}
