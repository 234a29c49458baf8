"""``trainer.deterministic``: what it switches on, in a process of its own (it changes global state)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest

from megatron_lowprec.train.determinism import DETERMINISTIC_ENVIRONMENT


def _run_python(code: str, **environment) -> dict:
    env = {key: value for key, value in os.environ.items() if key not in DETERMINISTIC_ENVIRONMENT}
    env.update(environment)
    completed = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env, timeout=600
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    return json.loads(completed.stdout.strip().splitlines()[-1])


REPORT = """
    import json, os, torch
    print(json.dumps({
        "algorithms": torch.are_deterministic_algorithms_enabled(),
        "cudnn": [torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark],
        "environment": {name: os.environ.get(name) for name in %r},
    }))
""" % sorted(DETERMINISTIC_ENVIRONMENT)


def test_enable_determinism_sets_what_the_user_has_not():
    report = _run_python(
        "from megatron_lowprec.train.determinism import enable_determinism\nenable_determinism()\n" + textwrap.dedent(REPORT),
        NCCL_ALGO="Tree",
    )
    assert report["algorithms"] is True and report["cudnn"] == [True, False]
    assert report["environment"] == {**DETERMINISTIC_ENVIRONMENT, "NCCL_ALGO": "Tree"}


@pytest.mark.skipif(importlib.util.find_spec("megatron.core") is None, reason="megatron-core is not installed")
@pytest.mark.parametrize("deterministic", [True, False])
def test_lowprec_train_switches_determinism_on_only_when_asked(deterministic, tmp_path):
    """A short run trains under the switch (no operation of the CPU path lacks a deterministic
    implementation), and leaves the process deterministic only with it."""
    code = f"""
        from megatron_lowprec.train.app import main
        assert main(["trainer.deterministic={str(deterministic).lower()}", "trainer.max_steps=2", "trainer.log_interval=1",
                     "trainer.eval_iters=1", "trainer.save=false", "logging.wandb=false", "run_dir={tmp_path / 'run'}"]) == 0
    """
    report = _run_python(textwrap.dedent(code) + textwrap.dedent(REPORT), WANDB_MODE="disabled")
    assert report["algorithms"] is deterministic
    expected = DETERMINISTIC_ENVIRONMENT if deterministic else dict.fromkeys(DETERMINISTIC_ENVIRONMENT)
    assert report["environment"] == expected


@pytest.mark.skipif(importlib.util.find_spec("megatron.core") is None, reason="megatron-core is not installed")
def test_the_switch_reaches_megatron_s_deterministic_mode():
    from megatron_lowprec.train.app import compose
    from megatron_lowprec.train.model import transformer_config

    assert transformer_config(compose(["trainer.deterministic=true"])).deterministic_mode is True
    assert transformer_config(compose([])).deterministic_mode is False
