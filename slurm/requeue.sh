# Sourced by the sbatch scripts after their srun step: the relaunch rule
# of train.py's exit codes, Slurm's way.
#   42: preempted (SIGTERM from `scancel --signal=TERM`, or --signal before the
#       time limit): a checkpoint is saved, so requeue and resume from it.
#   75: a peer task was lost: requeue and resume from the last checkpoint.
#   anything else (2 is bad input): fail; a relaunch would fail the same way.
# The job must be requeueable (#SBATCH --requeue). SLURM_RESTART_COUNT counts
# the requeues; MAX_REQUEUES (default 10) stops a job that never gets further.
requeue_on_relaunch_code() {
    local code=$1
    if [[ $code -eq 42 || $code -eq 75 ]]; then
        if (( ${SLURM_RESTART_COUNT:-0} < ${MAX_REQUEUES:-10} )); then
            echo "exit code $code: requeueing job $SLURM_JOB_ID to resume from its checkpoint" \
                "(restart $(( ${SLURM_RESTART_COUNT:-0} + 1 )) of at most ${MAX_REQUEUES:-10})"
            scontrol requeue "$SLURM_JOB_ID"
        else
            echo "exit code $code, but the job was requeued ${SLURM_RESTART_COUNT} times already: giving up"
        fi
    fi
    exit "$code"
}

# A port range of this job's own, so two jobs sharing a node do not collide:
# 10 ports a job (a node's tasks take consecutive ports), 4000 jobs apart.
job_port() {
    echo $(( 20000 + (SLURM_JOB_ID % 4000) * 10 ))
}
