"""The Dockerfile, built unchanged on a stand-in base (docker/standin-base.sh: Debian, Python 3.11, CPU
torch), trains inside the image as its non-root user: one process into a mounted run directory,
two gloo ranks under torchrun that resume, the SLURM launcher's container dry run, and a bad option.

Needs a Docker engine, and root with debootstrap to build the stand-in base once (it is reused by
tag). Without them the tests skip on a developer's machine and fail in CI (``CI=true``), where
.ci/docker_engine.sh starts the engine. Each docker command's key lines go to the terminal, so CI's
log shows the image being built and the runs.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STANDIN_SCRIPT = ROOT / "docker" / "standin-base.sh"
IMAGE = "megatron-lowprec:test-standin"
RUNS = "/home/lowprec/runs"
"""The image's run directory (the working directory's runs/)."""
IMAGE_USER = "10001"
BUILD_TIMEOUT = 1200
RUN_TIMEOUT = 600


def unavailable(reason: str) -> None:
    """A missing engine fails in CI and skips elsewhere."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI needs the Docker test: {reason}", pytrace=False)
    pytest.skip(reason)


def docker(*arguments: str, timeout: float = RUN_TIMEOUT) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", *arguments], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def show(pytestconfig):
    """Writes lines to the terminal past pytest's output capture."""
    reporter = pytestconfig.pluginmanager.get_plugin("terminalreporter")
    capture = pytestconfig.pluginmanager.get_plugin("capturemanager")

    def write(title: str, lines: list[str]) -> None:
        with capture.global_and_fixture_disabled():
            reporter.write_line(f"\n[docker] {title}")
            for line in lines:
                reporter.write_line(f"[docker]   {line}")

    return write


@pytest.fixture(scope="module")
def base_image(show) -> str:
    """The stand-in base's tag, built by docker/standin-base.sh unless already there."""
    if shutil.which("docker") is None:
        unavailable("no docker command on PATH")
    if docker("info", timeout=60).returncode != 0:
        unavailable("no Docker engine answers `docker info` (start one: as root, `dockerd &`)")
    completed = subprocess.run([str(STANDIN_SCRIPT)], capture_output=True, text=True, timeout=BUILD_TIMEOUT)
    if completed.returncode != 0:
        unavailable(f"the stand-in base was not built: {completed.stderr.strip().splitlines()[-1:]}")
    tag = completed.stdout.strip()
    progress = [line for line in completed.stderr.splitlines() if line.startswith("standin-base.sh:")]
    show("docker/standin-base.sh", progress)
    return tag


@pytest.fixture(scope="module")
def image(base_image, show) -> str:
    """The project's Dockerfile built on the stand-in base; removed after the module."""
    completed = docker("build", "--force-rm", "--build-arg", f"BASE_IMAGE={base_image}", "-t", IMAGE, str(ROOT),
                       timeout=BUILD_TIMEOUT)
    assert completed.returncode == 0, (completed.stdout + completed.stderr)[-5000:]
    steps = [line for line in completed.stdout.splitlines() if line.startswith(("Step ", "Successfully"))]
    size = docker("image", "inspect", "--format", "{{.Size}}", IMAGE).stdout.strip()
    show(f"docker build --build-arg BASE_IMAGE={base_image} -t {IMAGE} .",
         [*steps, f"image size: {int(size) / 1e9:.2f} GB"])
    yield IMAGE
    docker("rmi", "--force", IMAGE)


def run(image: str, *arguments: str, options: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """``docker run --rm`` of the image under a fresh name, removed even after a timeout."""
    name = f"lowprec-test-{uuid.uuid4().hex[:12]}"
    try:
        return docker("run", "--rm", "--name", name, *options, image, *arguments)
    finally:
        docker("rm", "--force", name)


def app_lines(completed: subprocess.CompletedProcess) -> list[str]:
    """lowprec-train's own lines: its banner, steps, validations and summary."""
    output = completed.stdout + completed.stderr
    return [line for line in output.splitlines() if line.startswith(("lowprec-train", "step ", "summary:"))]


@pytest.fixture
def runs_dir(tmp_path, image):
    """A host directory for the image's run directory. The image's user (uid 10001) writes into it;
    afterwards its files are given back to the host user, so that any user can delete them."""
    directory = tmp_path / "runs"
    directory.mkdir()
    directory.chmod(0o777)
    yield directory
    docker("run", "--rm", "--user", "0", "--entrypoint", "chown", "-v", f"{directory}:{RUNS}", image,
           "-R", f"{os.getuid()}:{os.getgid()}", RUNS)


def test_image_runs_as_its_user_on_the_base_torch(image, base_image):
    probe = "import importlib.metadata as m, torch; print(torch.__version__, sorted(d.metadata['Name'] for d in " \
            "m.distributions() if d.metadata['Name'].lower().startswith('nvidia')))"
    base = run(base_image, "python3", "-c", probe)
    built = run(image, "-c", probe, options=("--entrypoint", "python3"))
    assert base.returncode == 0 and built.returncode == 0, base.stderr + built.stderr
    assert built.stdout.split()[0] == base.stdout.split()[0]
    assert built.stdout.strip().endswith("[]"), f"CUDA packages installed on top of the base: {built.stdout}"
    assert run(image, "-u", options=("--entrypoint", "id")).stdout.strip() == IMAGE_USER


def test_trains_five_steps_into_a_mounted_run_directory(image, runs_dir, show):
    completed = run(image, "trainer.max_steps=5", f"run_dir={RUNS}/five", options=("-v", f"{runs_dir}:{RUNS}"))
    show("docker run -v HOST_DIR:/home/lowprec/runs IMAGE trainer.max_steps=5", app_lines(completed))
    assert completed.returncode == 0, (completed.stdout + completed.stderr)[-5000:]
    run_dir = runs_dir / "five"
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 5
    assert (run_dir / "checkpoints" / "latest").is_file()
    assert any((run_dir / "checkpoints").glob("iter_0000005/*"))
    for path in [run_dir, *run_dir.rglob("*")]:
        status = path.lstat()
        if stat.S_ISLNK(status.st_mode) or status.st_uid == os.getuid():
            continue
        needed = stat.S_IROTH | (stat.S_IXOTH if stat.S_ISDIR(status.st_mode) else 0)
        assert status.st_mode & needed == needed, f"{path} ({oct(status.st_mode)}) is not readable by the host user"


def test_torchrun_trains_and_resumes_on_two_gloo_ranks(image, runs_dir, show):
    options = ("-v", f"{runs_dir}:{RUNS}", "--entrypoint", "torchrun")
    command = ("--nproc-per-node", "2", "-m", "megatron_lowprec.train", f"run_dir={RUNS}/ddp", "logging.wandb=false")
    first = run(image, *command, "trainer.max_steps=4", options=options)
    show("docker run --entrypoint torchrun IMAGE --nproc-per-node 2 -m megatron_lowprec.train trainer.max_steps=4",
         app_lines(first))
    assert first.returncode == 0, (first.stdout + first.stderr)[-5000:]
    assert "world size 2 (TP 1, PP 1), 4 steps from scratch" in first.stdout
    extended = ("trainer.max_steps=8", "resume=true", "optimizer.override_opt_param_scheduler=true")
    resumed = run(image, *command, *extended, options=options)
    show(f"... {' '.join(extended)}", app_lines(resumed))
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-5000:]
    assert "world size 2 (TP 1, PP 1), 8 steps resumed from step 4" in resumed.stdout
    assert json.loads((runs_dir / "ddp" / "summary.json").read_text())["steps"] == 8


def test_slurm_dry_run_names_the_image(image, show):
    variables = {"DRY_RUN": "1", "CONTAINER_IMAGE": image, "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "gpu[07-08]",
                 "GPUS_PER_NODE": "4", "SLURM_JOB_ID": "42"}
    options = tuple(option for key, value in variables.items() for option in ("-e", f"{key}={value}"))
    completed = run(image, "/opt/megatron-lowprec/launch/slurm.sbatch", "trainer.global_batch_size=64",
                    options=(*options, "--entrypoint", "bash"))
    srun = completed.stdout.splitlines()[0] if completed.stdout else ""
    show("docker run -e DRY_RUN=1 -e CONTAINER_IMAGE=IMAGE ... --entrypoint bash IMAGE launch/slurm.sbatch", [srun])
    assert completed.returncode == 0, (completed.stdout + completed.stderr)[-5000:]
    assert srun.startswith(f"srun --nodes 2 --ntasks-per-node 1 --kill-on-bad-exit=1 --container-image {image} ")
    assert "ranks: 8 = TP 1 x PP 1 x DP 8" in completed.stdout


def test_a_bad_option_fails_with_one_config_error_line(image, show):
    completed = run(image, "precision=Z")
    show("docker run IMAGE precision=Z", [*completed.stderr.strip().splitlines(), f"exit {completed.returncode}"])
    assert completed.returncode == 2
    assert completed.stdout == ""
    [line] = completed.stderr.strip().splitlines()
    assert line.startswith("lowprec-train: config error:") and "choose one of: A, B, C" in line
