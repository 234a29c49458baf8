# megatron-lowprec on a GPU cluster: NGC's PyTorch image (CUDA, cuDNN, NCCL, Transformer Engine and
# apex, built for its own torch) with this package, megatron-core and the training app installed.
#
#   docker build -t megatron-lowprec .
#   docker run --gpus all --ipc=host -v lowprec-runs:/home/lowprec/runs megatron-lowprec precision=C
#   docker run --gpus all --ipc=host --entrypoint torchrun megatron-lowprec \
#       --nproc-per-node 8 -m megatron_lowprec.train +experiment=collage_table5_gpt_1.3b precision=C
#
# The default base, NGC PyTorch 25.12, carries torch 2.10.0a0+b4e4ee81d3 on Python 3.12 and CUDA
# 13.1.0 (NVIDIA's release notes: docs.nvidia.com/deeplearning/frameworks/pytorch-release-notes/
# rel-25-12.html). The plugin needs torch >= 2.10 (setup.py), so 25.12 is the first NGC release it
# runs on; a later one can be chosen with --build-arg BASE_IMAGE=nvcr.io/nvidia/pytorch:YY.MM-py3.
# CI builds this file unchanged on a stand-in base without CUDA (docker/standin-base.sh).
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:25.12-py3
FROM ${BASE_IMAGE}

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    LOWPREC_CONFIG_DIR=/opt/megatron-lowprec/configs

WORKDIR /opt/megatron-lowprec
COPY . .
# The source tree, configs/ included, stays in /opt/megatron-lowprec: LOWPREC_CONFIG_DIR points there.
# The install is constrained to the base's own torch build, so that no dependency replaces it with
# a build from the package index (NGC images also constrain pip to all their packages through
# PIP_CONSTRAINT=/etc/pip/constraint.txt; the two constraints add up).
# Runs go to /home/lowprec/runs (the default run_dir is runs/<time>-<model>-<option> in the working
# directory): mount a volume there to keep them.
RUN python3 -c 'from importlib.metadata import version; print("torch==" + version("torch"))' > /tmp/base-torch.txt \
    && pip install --no-cache-dir -c /tmp/base-torch.txt "/opt/megatron-lowprec[megatron,data,train]" \
    && rm /tmp/base-torch.txt \
    && useradd --no-log-init --create-home --uid 10001 --shell /bin/bash lowprec \
    && install -d -o lowprec -g lowprec /home/lowprec/runs

USER 10001
WORKDIR /home/lowprec

ENTRYPOINT ["lowprec-train"]
