#!/usr/bin/env bash
# Launch lowprec-train under torchrun, on one node or on each node of a multi-node job.
#
#   launch/torchrun.sh [OPTIONS] [--] [HYDRA_OVERRIDE ...]
#
# Options (each also read from the environment variable in parentheses):
#   --nnodes N          nodes in the job (NNODES; default 1)
#   --node-rank R       this node's rank, 0 .. N-1 (NODE_RANK; default 0)
#   --master-addr HOST  address of the node of rank 0 (MASTER_ADDR; default 127.0.0.1)
#   --master-port PORT  free TCP port on that node (MASTER_PORT; default 29500)
#   --nproc-per-node G  processes (GPUs) per node (NPROC_PER_NODE; default: the GPUs in
#                       CUDA_VISIBLE_DEVICES, else those nvidia-smi lists, else 1)
#   --dry-run           print the torchrun command, then the resolved config and plan for the
#                       job's N x G ranks (run by $PYTHON, default python3), and exit without launching
# Underscore spellings (--node_rank, --master_addr, ...) are accepted too. Every other argument is a
# Hydra override for `python -m megatron_lowprec.train`.
#
# One node, all its GPUs:
#   launch/torchrun.sh +experiment=collage_table5_gpt_1.3b precision=C
# Two nodes of 8 GPUs (run on each node, with its rank):
#   launch/torchrun.sh --nnodes 2 --node-rank 0 --master-addr node01 +experiment=sr_table1_gptneo_1.3b
#   launch/torchrun.sh --nnodes 2 --node-rank 1 --master-addr node01 +experiment=sr_table1_gptneo_1.3b
set -euo pipefail

usage() {
    sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"
}

# GPUs this node can use: CUDA_VISIBLE_DEVICES when set, else what nvidia-smi lists, else 1.
visible_gpus() {
    local count=0
    if [[ -n "${CUDA_VISIBLE_DEVICES:-}" ]]; then
        local -a devices
        IFS=, read -r -a devices <<< "$CUDA_VISIBLE_DEVICES"
        count=${#devices[@]}
    elif command -v nvidia-smi > /dev/null 2>&1; then
        local line
        while IFS= read -r line; do
            if [[ $line == GPU* ]]; then count=$(( count + 1 )); fi
        done < <(nvidia-smi --list-gpus 2> /dev/null || true)
    fi
    if (( count > 0 )); then echo "$count"; else echo 1; fi
}

nnodes=${NNODES:-1}
node_rank=${NODE_RANK:-0}
master_addr=${MASTER_ADDR:-127.0.0.1}
master_port=${MASTER_PORT:-29500}
nproc_per_node=${NPROC_PER_NODE:-}
dry_run=false
overrides=()

while (( $# > 0 )); do
    option=$1
    value=
    if [[ $option == --*=* ]]; then
        value=${option#*=}
        option=${option%%=*}
    fi
    case $option in
        --nnodes | --node-rank | --node_rank | --master-addr | --master_addr | --master-port | --master_port | \
            --nproc-per-node | --nproc_per_node)
            if [[ -z $value ]]; then
                if (( $# < 2 )); then
                    echo "torchrun.sh: $option needs a value" >&2
                    exit 2
                fi
                value=$2
                shift
            fi
            case $option in
                --nnodes) nnodes=$value ;;
                --node-rank | --node_rank) node_rank=$value ;;
                --master-addr | --master_addr) master_addr=$value ;;
                --master-port | --master_port) master_port=$value ;;
                *) nproc_per_node=$value ;;
            esac
            ;;
        --dry-run | --dry_run) dry_run=true ;;
        -h | --help)
            usage
            exit 0
            ;;
        --)
            shift
            overrides+=("$@")
            break
            ;;
        -*)
            echo "torchrun.sh: unknown option $option (Hydra overrides have no leading dash; see --help)" >&2
            exit 2
            ;;
        *) overrides+=("$option") ;;
    esac
    shift
done

nproc_per_node=${nproc_per_node:-$(visible_gpus)}
for name in nnodes node_rank master_port nproc_per_node; do
    if ! [[ ${!name} =~ ^[0-9]+$ ]]; then
        echo "torchrun.sh: ${name//_/-} must be a non-negative integer, got '${!name}'" >&2
        exit 2
    fi
done
if (( node_rank >= nnodes )); then
    echo "torchrun.sh: node-rank $node_rank is not below nnodes $nnodes" >&2
    exit 2
fi

command=(
    torchrun
    --nnodes "$nnodes"
    --node-rank "$node_rank"
    --nproc-per-node "$nproc_per_node"
    --master-addr "$master_addr"
    --master-port "$master_port"
    -m megatron_lowprec.train
    ${overrides[@]+"${overrides[@]}"}
)

if [[ $dry_run == true ]]; then
    printf -v quoted ' %q' "${command[@]}"
    printf '%s\n\n' "${quoted:1}"
    WORLD_SIZE=$(( nnodes * nproc_per_node )) "${PYTHON:-python3}" -m megatron_lowprec.train \
        ${overrides[@]+"${overrides[@]}"} trainer.dry_run=true
    exit
fi
exec "${command[@]}"
