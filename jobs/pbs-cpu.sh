#!/bin/bash
# hpcpar training job for PBS Pro / OpenPBS (cpu variant). Submit with: qsub <this file>
# Rendered by: hpcpar job render --scheduler pbs --variant cpu
# Re-render rather than edit by hand; docs/jobs.md explains every line.
#PBS -N hpcpar
#PBS -l select=1:ncpus=32:mpiprocs=4:ompthreads=8
#PBS -l walltime=01:00:00
#PBS -j oe
#PBS -r y

# --- Site setup: load your MPI and Python environment here, for example
#   module load mpich python
#   source "$HOME/venvs/hpcpar/bin/activate"

set -u
cd "$PBS_O_WORKDIR" || exit 1

# One BLAS/OpenMP thread per core of each rank.
export OMP_NUM_THREADS=8
# Parallel file systems (Lustre, GPFS) often lack the POSIX locks HDF5 asks for.
export HDF5_USE_FILE_LOCKING=FALSE

# PBS has no portable "signal me before the walltime" option, so a timer in this script
# sends USR1 300 s before the 01:00:00 walltime (`qsig -s USR1 <job>` does the
# same by hand); a qdel or preemption sends TERM. Either way, pass USR1 on to the ranks: they
# agree to stop at the next step boundary, save a checkpoint and exit 75 (EX_TEMPFAIL:
# "checkpoint saved, please requeue").
launch_pid=""
stop_requested=0
forward_stop() {
    stop_requested=1
    if [ -n "$launch_pid" ]; then
        kill -USR1 "$launch_pid" 2>/dev/null || true
    fi
}
trap forward_stop USR1 TERM

# Sends USR1 to process $2 after $1 seconds; a TERM cancels it without leaving a sleep behind.
stop_timer() {
    local sleep_pid
    trap 'kill "$sleep_pid" 2>/dev/null; exit 0' TERM
    sleep "$1" &
    sleep_pid=$!
    wait "$sleep_pid" && kill -USR1 "$2"
}
stop_timer 3300 "$$" &
timer_pid=$!

# Rank 0 leaves this file when it stops for a requeue: a launcher may lose the ranks' exit
# status when it forwards a signal (Debian 12's MPICH 4.0.2 mpiexec returned 0 for about one
# job in three), and then the file still says 75.
export HPCPAR_REQUEUE_MARKER="$PWD/.hpcpar-requeue-$PBS_JOBID"
rm -f "$HPCPAR_REQUEUE_MARKER"

# The run always resumes from the latest checkpoint, so a resubmitted job continues.
# >>> launch
mpiexec -n 4 -ppn 4 -bind-to core:8 \
    hpcpar train run.toml --set checkpoint.resume=auto &
# <<< launch
launch_pid=$!
# A signal that came before the launch still reaches the ranks.
if [ "$stop_requested" -eq 1 ]; then
    forward_stop
fi

# `wait` returns early whenever a trapped signal arrives: keep waiting for the ranks.
while true; do
    wait "$launch_pid"
    status=$?
    kill -0 "$launch_pid" 2>/dev/null || break
done
if [ "$status" -eq 0 ] && [ -e "$HPCPAR_REQUEUE_MARKER" ]; then
    status=75
fi
rm -f "$HPCPAR_REQUEUE_MARKER"
kill "$timer_pid" 2>/dev/null || true

if [ "$status" -eq 75 ]; then
    # Requeueing a job from inside itself is site policy under PBS (qrerun usually needs
    # operator rights), so say what to do instead of trying.
    echo "hpcpar: checkpoint saved before the walltime; submit this script again (qsub) to continue" \
         "from it, or run \`qrerun $PBS_JOBID\` where your site allows users to rerun jobs" >&2
fi
exit "$status"
