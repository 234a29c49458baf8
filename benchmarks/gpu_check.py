"""The GPU check: every precision option, fused against eager bit for bit, then a short training run.

Run it on a CUDA machine after installing the project (it also runs on CPU, on the tiny model):

    python benchmarks/gpu_check.py                      # CUDA: GPT-125M, seq 2048, micro-batch 8, 30 steps
    python benchmarks/gpu_check.py --options A sr --steps 5

For each option it

1. steps two ``AdamW`` optimizers on the current device, the fused (compiled) one and the eager
   reference, on the same random gradients (``--check-steps`` steps over mixed shapes, beta2 0.999),
   and counts the elements of parameters and optimizer state whose bits differ;
2. trains ``lowprec-train`` (``--model``, ``--seq-length``, ``--micro-batch``, ``--steps``; the
   embedded corpus, ``logging.wandb=false``, no checkpoint) and reads the run's ``metrics.jsonl``.

Each option runs in a process of its own, so that its peak memory is its own (no earlier option's
model or compiled kernels alive) and a crash (out of memory, a compiler fault) fails that row only.

It prints one table: option, bytes/param, tokens/s over the last ``--window`` steps, peak memory in
GiB from the run's summary (CUDA: ``torch.cuda.max_memory_allocated`` of that run; CPU: the
process's peak resident set),
final training loss, and the fused-vs-eager mismatches. An option that raises is listed with its
error, and the exit status is 1 if any option failed or mismatched.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_lowprec.optim import AdamW, available_strategies, get_strategy
from megatron_lowprec.optim.fused import fused_available

CHECK_SHAPES = [(1000,), (129,), (4097,), (7, 13), (4096, 65)]
"""Mixed sizes, most of them not multiples of the bucket alignment or of COAT's group of 128."""


@dataclass
class OptionResult:
    option: str
    bytes_per_param: float
    mismatches: int | None = None
    tokens_per_second: float | None = None
    peak_gib: float | None = None
    final_loss: float | None = None
    error: str | None = None

    @property
    def passed(self) -> bool:
        return self.error is None and self.mismatches == 0


def fused_vs_eager_mismatches(option: str, device: torch.device, steps: int, seed: int = 0) -> int:
    """Elements of parameters and state whose bits differ between the fused and the eager step."""
    generator = torch.Generator().manual_seed(seed)
    start = [torch.randn(shape, generator=generator).bfloat16().to(device) for shape in CHECK_SHAPES]
    twins = []
    for fused in (False, True):
        params = [torch.nn.Parameter(tensor.clone()) for tensor in start]
        optimizer = AdamW(params, lr=1e-2, betas=(0.9, 0.999), weight_decay=0.1, option=option, seed=3, fused=fused)
        twins.append((params, optimizer))
    for _ in range(steps):
        grads = [(torch.randn(shape, generator=generator) * 0.1).bfloat16().to(device) for shape in CHECK_SHAPES]
        for params, optimizer in twins:
            for param, grad in zip(params, grads):
                param.grad = grad.clone()
            optimizer.step()
    (eager_params, eager), (fused_params, fused) = twins
    mismatches = 0
    for p, q in zip(eager_params, fused_params):
        pairs = [(p.detach(), q.detach())]
        pairs += [(value, fused.state[q][key]) for key, value in eager.state[p].items() if torch.is_tensor(value)]
        for a, b in pairs:
            a_bits, b_bits = _bits(a), _bits(b)
            mismatches += int((a_bits != b_bits).sum())
    return mismatches


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns, one integer per element."""
    integer = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()]
    return tensor.contiguous().view(integer)


def train_overrides(args: argparse.Namespace, option: str, run_dir: Path) -> list[str]:
    return [
        f"model={args.model}",
        f"precision={option}",
        f"model.seq_length={args.seq_length}",
        f"trainer.micro_batch_size={args.micro_batch}",
        f"trainer.global_batch_size={args.micro_batch}",
        f"trainer.max_steps={args.steps}",
        "trainer.log_interval=1",
        f"trainer.eval_interval={args.steps + 1}",
        "trainer.eval_iters=1",
        "trainer.save=false",
        "logging.wandb=false",
        f"run_dir={run_dir}",
    ]


def tokens_per_second_over(rows: list[dict], window: int, tokens_per_step: int) -> float:
    """Tokens/s over the last ``window`` steps of one-step training rows (total tokens / total time)."""
    last = [row for row in rows if row["split"] == "train"][-window:]
    return tokens_per_step * len(last) / sum(tokens_per_step / row["tokens_per_second"] for row in last)


def check_option(args: argparse.Namespace, option: str, device: torch.device, work_dir: Path) -> OptionResult:
    from megatron_lowprec.train.app import compose
    from megatron_lowprec.train.loop import train

    strategy = get_strategy(option)
    result = OptionResult(strategy.name, strategy.bytes_per_param())
    try:
        result.mismatches = fused_vs_eager_mismatches(strategy.name, device, args.check_steps)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        run_dir = work_dir / strategy.name
        summary = train(compose(train_overrides(args, strategy.name, run_dir)))
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        result.tokens_per_second = tokens_per_second_over(rows, args.window, args.micro_batch * args.seq_length)
        result.peak_gib = summary["peak_allocated_gib" if device.type == "cuda" else "peak_rss_gib"]
        result.final_loss = summary["final_train_loss"]
    except Exception as error:
        result.error = f"{type(error).__name__}: {error}".splitlines()[0]
        traceback.print_exc()
    return result


def check_option_in_subprocess(args: argparse.Namespace, option: str, work_dir: Path) -> OptionResult:
    """:func:`check_option` in a fresh Python process (``--child``), its result read back as JSON."""
    result_file = work_dir / f"{option}.result.json"
    command = [sys.executable, __file__, "--child", str(result_file), "--options", option, "--work-dir", str(work_dir)]
    for flag in ("model", "seq_length", "micro_batch", "steps", "window", "check_steps"):
        command += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    completed = subprocess.run(command)
    if completed.returncode != 0 or not result_file.is_file():
        strategy = get_strategy(option)
        return OptionResult(strategy.name, strategy.bytes_per_param(), error=f"process exited with {completed.returncode}")
    return OptionResult(**json.loads(result_file.read_text()))


def format_table(results: list[OptionResult], device: torch.device) -> str:
    memory = "peak alloc GiB" if device.type == "cuda" else "peak RSS GiB"
    header = f"{'option':<8} {'B/param':>8} {'tokens/s':>10} {memory:>15} {'final loss':>10} {'mismatches':>10}  result"
    lines = [header, "-" * len(header)]
    for result in results:
        def number(value, spec):
            return format(value, spec) if value is not None else "-"

        lines.append(
            f"{result.option:<8} {result.bytes_per_param:>8g} {number(result.tokens_per_second, ',.0f'):>10} "
            f"{number(result.peak_gib, '.2f'):>15} {number(result.final_loss, '.4f'):>10} "
            f"{number(result.mismatches, 'd'):>10}  {'ok' if result.passed else result.error or 'MISMATCH'}"
        )
    return "\n".join(lines)


def write_markdown(path: Path, args: argparse.Namespace, results: list[OptionResult], device: torch.device) -> None:
    """The check's table as a stamped result file (``report.py``)."""
    import report

    def number(value, spec):
        return format(value, spec) if value is not None else "-"

    memory = "peak allocated GiB" if device.type == "cuda" else "peak RSS GiB"
    report.write_result(
        path, "GPU check: every option fused against eager, then a short training run",
        ["option", "B/param", "tokens/s", memory, "final loss", "fused-vs-eager mismatches", "result"],
        [[r.option, f"{r.bytes_per_param:g}", number(r.tokens_per_second, ",.0f"), number(r.peak_gib, ".2f"),
          number(r.final_loss, ".4f"), number(r.mismatches, "d"), "ok" if r.passed else r.error or "MISMATCH"]
         for r in results],
        [f"`python benchmarks/gpu_check.py --model {args.model} --seq-length {args.seq_length} --micro-batch "
         f"{args.micro_batch} --steps {args.steps} --check-steps {args.check_steps}`: per option, in a process of its "
         f"own, the elements of parameters and state whose bits differ between the fused and the eager step after "
         f"{args.check_steps} steps over mixed shapes, then `lowprec-train` for {args.steps} steps; tokens/s over the "
         f"last {args.window} steps. B/param: the option's 16-bit parameter, 16-bit gradient and state.", *args.note],
        device=device,
    )


def main(argv: list[str] | None = None) -> int:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--options", nargs="+", default=[s.name for s in available_strategies()])
    parser.add_argument("--model", default="gpt_125m" if cuda else "tiny")
    parser.add_argument("--seq-length", type=int, default=2048 if cuda else 64)
    parser.add_argument("--micro-batch", type=int, default=8 if cuda else 4)
    parser.add_argument("--steps", type=int, default=30 if cuda else 12)
    parser.add_argument("--window", type=int, default=10, help="tokens/s over this many last steps")
    parser.add_argument("--check-steps", type=int, default=30, help="fused-vs-eager optimizer steps")
    parser.add_argument("--work-dir", type=Path, default=None, help="run directories (default: a temporary one)")
    parser.add_argument("--child", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--markdown", type=Path, default=None, metavar="PATH", help="also write the table as a stamped Markdown file")
    parser.add_argument("--note", action="append", default=[], help="a paragraph for the Markdown file's notes")
    args = parser.parse_args(argv)
    for option in args.options:
        get_strategy(option)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if args.child is not None:
        result = check_option(args, args.options[0], device, args.work_dir)
        args.child.write_text(json.dumps(dataclasses.asdict(result)))
        return 0
    if not fused_available(device):
        print(f"gpu_check: no fused step on {device} (Triton on CUDA, a C++ compiler on CPU)", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name(device) if cuda else "CPU"
    print(f"gpu_check on {name}: torch {torch.__version__}, model {args.model}, seq {args.seq_length}, "
          f"micro-batch {args.micro_batch}, {args.steps} steps", flush=True)
    with tempfile.TemporaryDirectory() as temporary:
        work_dir = args.work_dir or Path(temporary)
        results = [check_option_in_subprocess(args, option, work_dir) for option in args.options]
    print(format_table(results, device), flush=True)
    if args.markdown is not None:
        write_markdown(args.markdown, args, results, device)
    return 0 if all(result.passed for result in results) else 1


if __name__ == "__main__":
    sys.exit(main())
