#!/bin/bash
# hpcpar training job for Slurm (cpu variant). Submit with: sbatch <this file>
# Rendered by: hpcpar job render --scheduler slurm --variant cpu
# Re-render rather than edit by hand; docs/jobs.md explains every line.
#SBATCH --job-name=hpcpar
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=4
#SBATCH --cpus-per-task=8
#SBATCH --time=01:00:00
#SBATCH --output=%x-%j.out
#SBATCH --open-mode=append
#SBATCH --signal=B:USR1@300
#SBATCH --requeue

# --- Site setup: load your MPI and Python environment here, for example
#   module load mpich python
#   source "$HOME/venvs/hpcpar/bin/activate"

set -u

# One BLAS/OpenMP thread per core of each rank.
export OMP_NUM_THREADS=8
# Parallel file systems (Lustre, GPFS) often lack the POSIX locks HDF5 asks for.
export HDF5_USE_FILE_LOCKING=FALSE

# Slurm sends USR1 to this script 300 s before the time limit (--signal=B:...);
# scancel or preemption sends TERM. Either way, pass USR1 on to the ranks: they agree to
# stop at the next step boundary, save a checkpoint and exit 75 (EX_TEMPFAIL: "checkpoint
# saved, please requeue").
launch_pid=""
stop_requested=0
forward_stop() {
    stop_requested=1
    if [ -n "$launch_pid" ]; then
        kill -USR1 "$launch_pid" 2>/dev/null || true
    fi
}
trap forward_stop USR1 TERM

# Rank 0 leaves this file when it stops for a requeue: a launcher may lose the ranks' exit
# status when it forwards a signal (Debian 12's MPICH 4.0.2 mpiexec returned 0 for about one
# job in three), and then the file still says 75.
export HPCPAR_REQUEUE_MARKER="$PWD/.hpcpar-requeue-$SLURM_JOB_ID"
rm -f "$HPCPAR_REQUEUE_MARKER"

# The run always resumes from the latest checkpoint, so a requeued job continues.
# >>> launch
srun --kill-on-bad-exit=1 --cpu-bind=cores --cpus-per-task=8 \
    hpcpar train run.toml --set checkpoint.resume=auto &
# <<< launch
launch_pid=$!
# A signal that came before the launch still reaches the ranks.
if [ "$stop_requested" -eq 1 ]; then
    forward_stop
fi

# `wait` returns early whenever a trapped signal arrives: keep waiting for the job step.
while true; do
    wait "$launch_pid"
    status=$?
    kill -0 "$launch_pid" 2>/dev/null || break
done
if [ "$status" -eq 0 ] && [ -e "$HPCPAR_REQUEUE_MARKER" ]; then
    status=75
fi
rm -f "$HPCPAR_REQUEUE_MARKER"

if [ "$status" -eq 75 ]; then
    echo "hpcpar: checkpoint saved before the time limit; requeueing job $SLURM_JOB_ID" >&2
    scontrol requeue "$SLURM_JOB_ID"
fi
exit "$status"
