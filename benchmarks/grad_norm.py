"""Gradient norm benchmark: the exact norm (``numerics/square_sum.py``: Σ x² as integer digit sums,
what clipping computes every step) against torch's FP32 ``torch.linalg.vector_norm`` on the same tensor.

For each element count and gradient dtype, both run in the same process on the same random tensor,
their calls alternating (so that both see the same machine load); each time is the median of
``--repeats`` calls after ``--warmup``; the ratio compares the two medians (lower is faster).

``--tensors N`` splits the elements into N gradients of near-equal size, as a model's are: separate
tensors, or with ``--buffer`` consecutive views of one buffer, as megatron's DDP holds them (which the
exact norm joins into one run). The FP32 norm is ``torch._foreach_norm`` over them and the norm of
those norms, as megatron's ``get_grad_norm_fp32`` computes it without apex.

    python benchmarks/grad_norm.py --sizes 1M 8M --dtypes float32 bfloat16
    python benchmarks/grad_norm.py --sizes 1G --tensors 300            # CUDA: a GPT-1.3B's gradients
    python benchmarks/grad_norm.py --sizes 1G --tensors 300 --buffer
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from megatron_lowprec.numerics.square_sum import norm_from_bins, square_sum_bins

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parse_size(text: str) -> int:
    units = {"K": 10**3, "M": 2**20, "G": 2**30}
    suffix = text[-1].upper()
    return int(float(text[:-1]) * units[suffix]) if suffix in units else int(text)


def paired_medians(functions, warmup: int, repeats: int, sync) -> list[float]:
    """Median seconds of each of ``functions``, their calls alternating."""
    for _ in range(warmup):
        for function in functions:
            function()
    sync()
    times = [[] for _ in functions]
    for _ in range(repeats):
        for function, function_times in zip(functions, times):
            start = time.perf_counter()
            function()
            sync()
            function_times.append(time.perf_counter() - start)
    return [statistics.median(function_times) for function_times in times]


def gradients(numel: int, dtype: torch.dtype, tensors: int, buffer: bool, device: torch.device) -> list[torch.Tensor]:
    """``numel`` random values of ``dtype`` as ``tensors`` near-equal gradients: views of one buffer,
    or separate tensors."""
    values = torch.randn(numel, generator=torch.Generator().manual_seed(0)).to(device, dtype)
    pieces = values.tensor_split(tensors)
    return list(pieces) if buffer else [piece.clone() for piece in pieces]


def run(sizes: list[int], dtypes: list[str], warmup: int, repeats: int, device: torch.device, tensors: int = 1,
        buffer: bool = False) -> list[tuple[int, str, float, float]]:
    """Print a row per size and dtype; return them as (elements, dtype, FP32 seconds, exact seconds)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    print(f"{'elements':>10} {'dtype':>9} {'tensors':>7} {'fp32 ms':>9} {'exact ms':>9} {'ratio':>7}")
    results = []
    for numel in sizes:
        for name in dtypes:
            grads = gradients(numel, DTYPES[name], tensors, buffer, device)

            def fp32_norm():
                norms = torch._foreach_norm(grads, 2.0, dtype=torch.float32)
                return torch.linalg.vector_norm(torch.stack(norms)).item()

            def exact_norm():
                return norm_from_bins(square_sum_bins(grads, device))

            fp32_seconds, exact_seconds = paired_medians((fp32_norm, exact_norm), warmup, repeats, sync)
            print(f"{numel:>10.3g} {name:>9} {tensors:>7} {fp32_seconds * 1e3:>9.3f} {exact_seconds * 1e3:>9.3f} "
                  f"{exact_seconds / fp32_seconds:>7.1f}")
            results.append((numel, name, fp32_seconds, exact_seconds))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["8M"], help="element counts, e.g. 1M 8M")
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tensors", type=int, default=1, help="gradients the elements are split into")
    parser.add_argument("--buffer", action="store_true", help="the gradients are consecutive views of one buffer")
    parser.add_argument("--markdown", type=Path, default=None, metavar="PATH", help="also write the table as a stamped Markdown file")
    parser.add_argument("--note", action="append", default=[], help="a paragraph for the Markdown file's notes")
    arguments = parser.parse_args()
    device = torch.device(arguments.device)
    results = run([parse_size(size) for size in arguments.sizes], arguments.dtypes, arguments.warmup, arguments.repeats,
                  device, arguments.tensors, arguments.buffer)
    if arguments.markdown is not None:
        import report

        layout = f"{arguments.tensors} gradients" + (", views of one buffer" if arguments.buffer else "")
        command = (f"`python benchmarks/grad_norm.py --sizes {' '.join(arguments.sizes)} --dtypes {' '.join(arguments.dtypes)} "
                   f"--tensors {arguments.tensors}{' --buffer' if arguments.buffer else ''} --warmup {arguments.warmup} "
                   f"--repeats {arguments.repeats}`")
        report.write_result(
            arguments.markdown, "Exact gradient norm against megatron's FP32 norm",
            ["elements", "gradients", "layout", "FP32 norm ms", "exact norm ms", "exact / FP32"],
            [[f"{numel:.3g}", name, layout, f"{fp32 * 1e3:.3f}", f"{exact * 1e3:.3f}", f"{exact / fp32:.1f}"]
             for numel, name, fp32, exact in results],
            [f"{command}, {report.threads()}. The exact norm (`numerics/square_sum.py`: Σ x² as integer "
             "digit sums, the same bits at every DP/TP/PP layout) against `torch._foreach_norm` and the norm of the "
             "norms, as megatron's `get_grad_norm_fp32` computes it; calls alternating, medians.", *arguments.note],
            device=device,
        )


if __name__ == "__main__":
    main()
