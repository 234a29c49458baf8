"""Gradient norm benchmark: the exact norm (``numerics/square_sum.py``: Σ x² as integer digit sums,
what clipping computes every step) against torch's FP32 ``torch.linalg.vector_norm`` on the same tensor.

For each element count and gradient dtype, both run in the same process on the same random tensor,
their calls alternating (so that both see the same machine load); each time is the median of
``--repeats`` calls after ``--warmup``; the ratio compares the two medians (lower is faster).

    python benchmarks/grad_norm.py --sizes 1M 8M --dtypes float32 bfloat16
"""

from __future__ import annotations

import argparse
import statistics
import time

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


def run(sizes: list[int], dtypes: list[str], warmup: int, repeats: int, device: torch.device) -> None:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    print(f"{'elements':>10} {'dtype':>9} {'fp32 ms':>9} {'exact ms':>9} {'ratio':>7}")
    generator = torch.Generator().manual_seed(0)
    for numel in sizes:
        for name in dtypes:
            grad = torch.randn(numel, generator=generator).to(device, DTYPES[name])

            def fp32_norm():
                return torch.linalg.vector_norm(grad, dtype=torch.float32).item()

            def exact_norm():
                return norm_from_bins(square_sum_bins([grad], device))

            fp32_seconds, exact_seconds = paired_medians((fp32_norm, exact_norm), warmup, repeats, sync)
            print(f"{numel:>10.3g} {name:>9} {fp32_seconds * 1e3:>9.3f} {exact_seconds * 1e3:>9.3f} "
                  f"{exact_seconds / fp32_seconds:>7.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["8M"], help="element counts, e.g. 1M 8M")
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    arguments = parser.parse_args()
    run([parse_size(size) for size in arguments.sizes], arguments.dtypes, arguments.warmup, arguments.repeats,
        torch.device(arguments.device))


if __name__ == "__main__":
    main()
