# megatron-lowprec on a GPU cluster: NGC's PyTorch image (CUDA, cuDNN, NCCL, Transformer Engine and
# apex, built for its own torch) with this package, megatron-core and the training app installed.
# It cannot be built in this project's CI (no Docker engine there); CI lints it with hadolint.
#
#   docker build -t megatron-lowprec .
#   docker run --gpus all --ipc=host -v lowprec-runs:/home/lowprec/runs megatron-lowprec precision=C
#   docker run --gpus all --ipc=host --entrypoint torchrun megatron-lowprec \
#       --nproc-per-node 8 -m megatron_lowprec.train +experiment=collage_table5_gpt_1.3b precision=C
#
# NGC images from 25.03 on constrain pip (PIP_CONSTRAINT=/etc/pip/constraint.txt) to the versions
# they were built with, so installing the extras never replaces the image's torch.
FROM nvcr.io/nvidia/pytorch:25.06-py3

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    LOWPREC_CONFIG_DIR=/opt/megatron-lowprec/configs

WORKDIR /opt/megatron-lowprec
COPY . .
# The source tree, configs/ included, stays in /opt/megatron-lowprec: LOWPREC_CONFIG_DIR points there.
# Runs go to /home/lowprec/runs (the default run_dir is runs/<time>-<model>-<option> in the working
# directory): mount a volume there to keep them.
RUN pip install --no-cache-dir "/opt/megatron-lowprec[megatron,data,train]" \
    && useradd --no-log-init --create-home --uid 10001 --shell /bin/bash lowprec \
    && install -d -o lowprec -g lowprec /home/lowprec/runs

USER 10001
WORKDIR /home/lowprec

ENTRYPOINT ["lowprec-train"]
