"""Distributed-optimizer shard step benchmark: a shard laid out in place against plain buckets.

For each option, the second half of a megatron-like DDP bucket (rank 1 of DP=2: parameters of two
alternating parameter groups, each start padded to 64 elements as megatron pads them) is stepped as
the distributed optimizer steps it (``megatron/layout.py: build_shard_bucket``, one compiled call over
megatron's buffers in place), and the same elements as the plain optimizer steps them (a bucket per
parameter group that owns its parameters and gradients). Their steps alternate, each time is the
median of ``--repeats`` steps after ``--warmup``, and the ratio compares the two medians (lower is
faster). ``--sizes`` are the shard's elements.

    python benchmarks/shard_step.py --sizes 16M --options A sr coat
    python benchmarks/shard_step.py --sizes 256M            # on a GPU, every option
"""

from __future__ import annotations

import argparse
import importlib.util
from collections.abc import Callable
from pathlib import Path

import torch

from megatron_lowprec.optim import available_strategies, get_strategy
from megatron_lowprec.megatron.layout import build_shard_bucket
from megatron_lowprec.optim.buckets import build_bucket
from megatron_lowprec.optim.fused import fused_bucket_step_

HYPER = {
    0: dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1),
    1: dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0),
}
"""A weight group and a group without weight decay (biases, norms), as megatron makes them."""


def parse_size(text: str) -> int:
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    return int(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units else int(text)


def megatron_layout(shard_numel: int, tensors: int) -> tuple[list[int], list[int], int]:
    """Sizes and starts of ``tensors`` parameters (multiples of 128, as a transformer's) in a DDP
    bucket whose second half holds about ``shard_numel`` elements, each start padded to 64; the
    bucket's length (padded to 128)."""
    sizes = [max(128, 2 * shard_numel // tensors // 128 * 128 - 128 * (index % 3)) for index in range(tensors)]
    starts, position = [], 0
    for size in sizes:
        position = -(-position // 64) * 64
        starts.append(position)
        position += size
    return sizes, starts, -(-position // 128) * 128


class ShardStep:
    """One rank's shard of a DDP bucket, stepped as the distributed optimizer steps it."""

    def __init__(self, strategy, shard_numel: int, tensors: int, device: torch.device) -> None:
        sizes, starts, total = megatron_layout(shard_numel, tensors)
        self.strategy = strategy
        self.param_data = torch.randn(total, device=device).bfloat16()
        self.grad_data = (torch.randn(total, device=device) * 1e-3).bfloat16()
        start = total // 2
        params, runs, run_starts, groups = [], [], [], []
        for index, (first, size) in enumerate(zip(starts, sizes)):
            begin = max(first, start)
            if begin < first + size:
                params.append(torch.nn.Parameter(self.param_data[first : first + size]))
                runs.append((begin - first, first + size - begin))
                run_starts.append(begin)
                groups.append(index % 2)
        self.bucket, self.grad = build_shard_bucket(
            strategy, params, runs, run_starts, groups, None, self.param_data, self.grad_data, start, total,
        )
        self.entry_grads = [self.grad_data[first : first + numel] for first, (_, numel) in zip(run_starts, runs)]
        self.run_sizes, self.groups, self.steps = [numel for _, numel in runs], groups, 0

    def step(self) -> None:
        self.steps += 1
        fused_bucket_step_(
            self.bucket, self.strategy, self.grad, self.entry_grads, HYPER, step=self.steps,
            sr_seed=0 if self.strategy.param_update == "stochastic" else None, track_update_quality=False,
        )


class PlainStep:
    """The same elements in a bucket per parameter group that owns its parameters and gradients."""

    def __init__(self, shard: ShardStep, device: torch.device) -> None:
        self.strategy, self.buckets, self.steps = shard.strategy, [], 0
        for group in sorted(set(shard.groups)):
            sizes = [size for size, owner in zip(shard.run_sizes, shard.groups) if owner == group]
            params = [torch.nn.Parameter(torch.randn(size, device=device).bfloat16()) for size in sizes]
            bucket, _ = build_bucket(shard.strategy, group, params, own_params=True)
            grad = (torch.randn(bucket.numel, device=device) * 1e-3).bfloat16()
            self.buckets.append((bucket, grad, [bucket.view(grad, index) for index in range(len(params))]))

    def step(self) -> None:
        self.steps += 1
        for bucket, grad, entry_grads in self.buckets:
            fused_bucket_step_(
                bucket, self.strategy, grad, entry_grads, {bucket.group_index: HYPER[bucket.group_index]}, step=self.steps,
                sr_seed=0 if self.strategy.param_update == "stochastic" else None, track_update_quality=False,
            )


def paired_median_seconds() -> Callable:
    """``benchmarks/optimizer_step.py``'s alternating timer (median step times of two steppers)."""
    spec = importlib.util.spec_from_file_location("optimizer_step", Path(__file__).with_name("optimizer_step.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.paired_median_seconds


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["16M"], help="shard elements (K, M, G suffixes)")
    parser.add_argument("--options", nargs="+", default=[strategy.name for strategy in available_strategies()])
    parser.add_argument("--tensors", type=int, default=24, help="parameters in the DDP bucket")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--markdown", type=Path, default=None, metavar="PATH", help="also write the table as a stamped Markdown file")
    parser.add_argument("--note", action="append", default=[], help="a paragraph for the Markdown file's notes")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    print(f"device: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}")
    header = ["option", "shard elements", "layout", "plain buckets ms", "shard ms", "shard / plain"]
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    rows = []
    for size in args.sizes:
        for option in args.options:
            strategy = get_strategy(option)
            shard = ShardStep(strategy, parse_size(size), args.tensors, device)
            plain = PlainStep(shard, device)
            plain_seconds, shard_seconds = paired_median_seconds()(plain, shard, args.warmup, args.repeats, sync)
            layout = "in place" if shard.bucket.in_place else "packed"
            rows.append([strategy.name, shard.bucket.numel, layout, f"{plain_seconds * 1e3:.2f}", f"{shard_seconds * 1e3:.2f}",
                         f"{shard_seconds / plain_seconds:.2f}"])
            print("| " + " | ".join(str(cell) for cell in rows[-1]) + " |", flush=True)
    if args.markdown is not None:
        import report

        command = (f"`python benchmarks/shard_step.py --sizes {' '.join(args.sizes)} --tensors {args.tensors} "
                   f"--warmup {args.warmup} --repeats {args.repeats} --options {' '.join(args.options)}`")
        report.write_result(args.markdown, "Distributed optimizer: a shard in place against plain buckets", header, rows, [
            f"{command}, {report.threads()}. The shard: the second half of a megatron-like DDP bucket "
            f"(rank 1 of DP=2, {args.tensors} parameters of two parameter groups, starts padded to 64 elements), stepped "
            "in place over megatron's buffers as the distributed optimizer steps it; plain buckets: the same elements "
            "in a bucket per parameter group that owns its parameters and gradients. Their steps alternate; medians; "
            "lower ratio is faster.", *args.note,
        ], device=device)


if __name__ == "__main__":
    main()
