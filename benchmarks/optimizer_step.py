"""Optimizer step benchmark: every precision option against ``torch.optim.AdamW(fused=True)`` in FP32.

For each parameter count, the baseline and every option run in the same process on the same
parameter layout. Steps of the baseline and of the option alternate, so that both see the same
machine load (shared machines drift by 2x within a minute), and each time is the median of
``--repeats`` steps after ``--warmup`` steps; the ratio compares the two medians. Reported per
option: bytes/param measured from the optimizer's real tensors (params, BF16 grads, states), median
step time, Gparam/s, effective GB/s (bytes the option must read and write per parameter / time),
the time ratio to the baseline (lower is faster), the effective bandwidth as a share of a plain FP32
copy measured in the same run ("copy %"), and the peak memory a step allocates beyond what was live
before it, next to the size of the largest bucket.

Peak memory: on CUDA from the caching allocator's statistics; on CPU from the process's peak
resident set (``VmHWM``, reset through ``/proc/self/clear_refs``), with glibc told (``mallopt``) to
serve every allocation above 64 KiB by mmap during that one step, so that freed temporaries leave the
resident set at once (and to return its free heap first, ``malloc_trim``). Timed steps run with a 32 MiB threshold (glibc's own dynamic maximum), so that
they do not pay a page fault per temporary page.

``--uncompiled``: the fused step while its compile is pending (background compilation, the default
of ``lowprec-train``: the first steps, before the compile child is done; here a child that never
starts), whose calls run the step's kernel uncompiled in pieces of ``fused.EAGER_WINDOW_ELEMENTS``
elements; each option also runs with the whole bucket in one uncompiled call (``A(whole)``), the
baseline of its peak memory, in the same run.

``--markdown PATH`` writes the table stamped (``report.py``); for the compiled step also the bytes per
parameter by component, plotted stacked beside it, and the step time beside a copy of its bytes.

An option may name its master's storage (``D:remainder``, ``D-BF16:fp32``); by default every option
runs, and each option with an FP32 master also in its other storage, next to it.

    python benchmarks/optimizer_step.py --sizes 1M 16M 64M
    python benchmarks/optimizer_step.py --sizes 16M --options D D:remainder coat coat:remainder D-BF16 D-BF16:fp32
    python benchmarks/optimizer_step.py --sizes 256M --kernels    # CUDA: also each step's kernels and their times
    python benchmarks/optimizer_step.py --sizes 64M --uncompiled --options A coat
    python benchmarks/optimizer_step.py --sizes 8M --uncompiled --pieces 1M    # pieces smaller than the bucket on a CPU
    python benchmarks/optimizer_step.py --sizes 1G --tensors 300 --options A C   # CUDA: a GPT-1.3B's weights
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import statistics
import time
from pathlib import Path

import torch

from megatron_lowprec.optim import AdamW, PrecisionStrategy, available_strategies, fused, get_strategy
from megatron_lowprec.optim.background_compile import BackgroundCompiles
from megatron_lowprec.optim.strategies import MASTER_STORAGES

M_MMAP_THRESHOLD = -3
"""glibc's ``mallopt`` parameter for the size above which an allocation is its own mmap."""
PEAK_MMAP_THRESHOLD = 64 * 2**10
TIMING_MMAP_THRESHOLD = 32 * 2**20
FP32_ADAMW_TRAFFIC_BYTES = 16 + 12
"""torch fused AdamW in FP32 reads param, grad, m, v (16 B) and writes param, m, v (12 B)."""


def parse_size(text: str) -> int:
    units = {"K": 10**3, "M": 10**6, "G": 10**9}
    suffix = text[-1].upper()
    return int(float(text[:-1]) * units[suffix]) if suffix in units else int(text)


def parse_option(text: str) -> PrecisionStrategy:
    """``NAME`` or ``NAME:MASTER_STORAGE`` (``D:remainder``) as a strategy."""
    name, _, storage = text.partition(":")
    strategy = get_strategy(name)
    return strategy.with_master_storage(storage) if storage else strategy


def default_options() -> list[str]:
    """Every option; each one with an FP32 master also in its other storage, right after it."""
    options = []
    for strategy in available_strategies():
        options.append(strategy.name)
        if strategy.master_weights:
            options += [f"{strategy.name}:{storage}" for storage in MASTER_STORAGES if storage != strategy.master_storage]
    return options


def layout(numel: int, tensors: int = 4) -> list[int]:
    """Tensor sizes adding up to ``numel``: for 4, a transformer-like mix (a half, a quarter, an eighth
    and the rest; none a multiple of 128); otherwise near-equal sizes, as a model's weights (equal
    shares, pairs of them moved 0 to 2 elements apart)."""
    if tensors == 4:
        sizes = [numel // 2 + 1, numel // 4 - 3, numel // 8 + 5]
        sizes.append(numel - sum(sizes))
    else:
        sizes = [numel * (index + 1) // tensors - numel * index // tensors for index in range(tensors)]
        for index in range(0, tensors - 1, 2):
            sizes[index] += index // 2 % 3
            sizes[index + 1] -= index // 2 % 3
    if min(sizes) < 1:
        raise ValueError(f"{numel} elements cannot be {tensors} tensors")
    return sizes


def paired_median_seconds(
    baseline: torch.optim.Optimizer, optimizer: torch.optim.Optimizer, warmup: int, repeats: int, sync
) -> tuple[float, float]:
    """Median step times of ``baseline`` and ``optimizer``, their steps alternating."""
    for _ in range(warmup):
        baseline.step()
        optimizer.step()
    sync()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for subject, subject_times in zip((baseline, optimizer), times):
            start = time.perf_counter()
            subject.step()
            sync()
            subject_times.append(time.perf_counter() - start)
    return statistics.median(times[0]), statistics.median(times[1])


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def peak_extra_bytes(step, device: torch.device) -> int:
    """Bytes allocated by ``step()`` at its peak beyond what was live before it."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.mallopt(M_MMAP_THRESHOLD, PEAK_MMAP_THRESHOLD)
    libc.malloc_trim(0)
    try:
        Path("/proc/self/clear_refs").write_text("5")
        before = _status_kib("VmRSS")
        step()
        return max(0, _status_kib("VmHWM") - before) * 1024
    finally:
        libc.mallopt(M_MMAP_THRESHOLD, TIMING_MMAP_THRESHOLD)


def copy_bandwidth(numel: int, device: torch.device, repeats: int, sync) -> float:
    """Bytes per second of a plain FP32 copy (read + write) of ``numel`` elements on ``device``."""
    source = torch.randn(numel, device=device)
    target = torch.empty_like(source)
    times = []
    for _ in range(repeats + 1):
        sync()
        start = time.perf_counter()
        target.copy_(source)
        sync()
        times.append(time.perf_counter() - start)
    return 8 * numel / statistics.median(times[1:])


def make_params(
    numel: int, dtype: torch.dtype, device: torch.device, grad_dtype: torch.dtype, tensors: int = 4
) -> list[torch.Tensor]:
    generator = torch.Generator(device="cpu").manual_seed(0)
    params = []
    for size in layout(numel, tensors):
        param = torch.nn.Parameter(torch.randn(size, generator=generator).to(device=device, dtype=dtype))
        param.grad = (torch.randn(size, generator=generator) * 1e-3).to(device=device, dtype=grad_dtype)
        params.append(param)
    return params


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t))


@contextlib.contextmanager
def compile_pending(window: int | None):
    """The fused step's calls run uncompiled, as while their background compile is pending (a child
    that never starts), in pieces of ``window`` elements (``None``: the package's default)."""
    compiles = BackgroundCompiles()
    compiles.start = lambda: None
    saved = fused.BACKGROUND_COMPILES, fused.EAGER_WINDOW_ELEMENTS
    fused.BACKGROUND_COMPILES = compiles
    fused.EAGER_WINDOW_ELEMENTS = saved[1] if window is None else window
    try:
        yield
    finally:
        fused.BACKGROUND_COMPILES, fused.EAGER_WINDOW_ELEMENTS = saved


PATHS = {"fused": dict(fused=True), "eager": dict(fused=False), "uncompiled": dict(fused=True, background_compile=True)}
"""The step each ``--path`` (flag) times: the compiled fused step, the eager reference, the fused step uncompiled."""


def run(
    sizes: list[int], options: list[str], warmup: int, repeats: int, device: torch.device, path: str = "fused",
    kernels: bool = False, pieces: int | None = None, tensors: int = 4,
) -> list[dict]:
    """Print a row per option beside its paired baseline; return each option's figures (see the keys
    below), the bytes split into parameter, gradient, moments and other states, and master."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    print(
        f"device={device} threads={torch.get_num_threads()} torch={torch.__version__} "
        f"warmup={warmup} repeats={repeats} path={path}"
        + (f" pieces={pieces or fused.EAGER_WINDOW_ELEMENTS}" if path == "uncompiled" else "") + f" tensors={tensors}"
    )
    header = (
        f"{'params':>8} {'option':>12} {'B/param':>8} {'step ms':>9} {'Gparam/s':>9} {'eff GB/s':>9} {'ratio':>7} "
        f"{'copy %':>7} {'peak MB':>8} {'bucket MB':>9}"
    )
    windows = {"": pieces, "(whole)": 1 << 62} if path == "uncompiled" else {"": None}
    results = []
    for numel in sizes:
        bandwidth = copy_bandwidth(numel, device, repeats, sync)
        print(f"fp32 copy of {numel:.2g} elements: {bandwidth / 1e9:.1f} GB/s (the 'copy %' reference)")
        print(header)
        baseline = torch.optim.AdamW(
            make_params(numel, torch.float32, device, torch.float32, tensors), lr=1e-4, weight_decay=0.1, fused=True
        )
        baseline.step()
        baseline_peak = peak_extra_bytes(baseline.step, device)
        for option in options:
            strategy = parse_option(option)
            for suffix, window in windows.items():
                with compile_pending(window) if path == "uncompiled" else contextlib.nullcontext():
                    params = make_params(numel, torch.bfloat16, device, torch.bfloat16, tensors)
                    optimizer = AdamW(params, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, option=strategy, **PATHS[path])
                    state_bytes = tensor_bytes(v for s in optimizer.state.values() for v in s.values())
                    master_bytes = tensor_bytes(
                        v for s in optimizer.state.values() for k, v in s.items() if k.startswith("master")
                    )
                    bytes_per_param = (state_bytes + tensor_bytes(params) + tensor_bytes(p.grad for p in params)) / numel
                    traffic = 2 * 2 + 2 + 2 * state_bytes / numel
                    baseline_time, seconds = paired_median_seconds(baseline, optimizer, warmup, repeats, sync)
                    peak = peak_extra_bytes(optimizer.step, device)
                    largest_bucket = max(b.numel * params[0].element_size() for b in optimizer.buckets)
                    print(_row(numel, "torch32", 16, baseline_time, FP32_ADAMW_TRAFFIC_BYTES, 1.0, bandwidth, baseline_peak, 4 * numel))
                    print(_row(
                        numel, option + suffix, bytes_per_param, seconds, traffic, seconds / baseline_time, bandwidth, peak,
                        largest_bucket,
                    ))
                    if kernels:
                        print(f"{'':>8} {option:>12} {kernel_summary(optimizer.step)}")
                    results.append({
                        "params": numel, "option": option + suffix, "bytes_per_param": bytes_per_param,
                        "param_bytes": tensor_bytes(params) / numel,
                        "grad_bytes": tensor_bytes(p.grad for p in params) / numel,
                        "megatron_grad_bytes": strategy.grad_bytes(),
                        "state_bytes": (state_bytes - master_bytes) / numel, "master_bytes": master_bytes / numel,
                        "seconds": seconds, "baseline_seconds": baseline_time, "traffic": traffic,
                        "copy_bandwidth": bandwidth, "peak_bytes": peak, "baseline_peak_bytes": baseline_peak,
                        "bucket_bytes": largest_bucket,
                    })
                    del optimizer, params
    return results


def kernel_summary(step) -> str:
    """The GPU kernels one ``step()`` launches (torch.profiler): count, their summed GPU time, and each
    kernel's name and time, longest first."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as profiler:
        step()
        torch.cuda.synchronize()
    kernels = [event for event in profiler.events() if event.device_type == torch.autograd.DeviceType.CUDA]
    kernels.sort(key=lambda event: -event.device_time)
    listed = ", ".join(f"{event.name[:60]} {event.device_time / 1e3:.2f} ms" for event in kernels)
    return f"{len(kernels)} kernels, {sum(event.device_time for event in kernels) / 1e3:.2f} ms: {listed}"


def _row(numel, name, bytes_per_param, seconds, traffic, ratio, bandwidth, peak, bucket_bytes) -> str:
    return (
        f"{numel:>8.2g} {name:>12} {bytes_per_param:>8.3f} {seconds * 1e3:>9.2f} {numel / seconds / 1e9:>9.3f} "
        f"{traffic * numel / seconds / 1e9:>9.2f} {ratio:>7.2f} {100 * traffic * numel / seconds / bandwidth:>7.1f} "
        f"{peak / 2**20:>8.1f} {bucket_bytes / 2**20:>9.1f}"
    )


STEP_TITLES = {
    "fused": "Optimizer step: every option against torch's FP32 fused AdamW",
    "eager": "Optimizer step, the eager reference: every option against torch's FP32 fused AdamW",
    "uncompiled": "Optimizer step before its compile: uncompiled in pieces and whole, against torch's FP32 fused AdamW",
}


def write_markdown(
    path: Path, results: list[dict], device: torch.device, step_path: str, settings: str, notes: list[str]
) -> None:
    """The step-time table as a stamped result file (``report.py``); for the compiled fused step also
    the bytes table and two plots beside it: step time against a copy of the option's bytes
    (``NAME.png``) and the bytes per parameter stacked by component (``NAME-memory.png``)."""
    import report

    header = ["params", "option", "step ms", "torch FP32 ms", "ratio", "Gparam/s", "eff GB/s", "copy %", "peak MB",
              "bucket MB"]
    rows = [[
        f"{r['params']:.3g}", r["option"], f"{r['seconds'] * 1e3:.2f}", f"{r['baseline_seconds'] * 1e3:.2f}",
        f"{r['seconds'] / r['baseline_seconds']:.2f}", f"{r['params'] / r['seconds'] / 1e9:.3f}",
        f"{r['traffic'] * r['params'] / r['seconds'] / 1e9:.2f}",
        f"{100 * r['traffic'] * r['params'] / r['seconds'] / r['copy_bandwidth']:.1f}",
        f"{r['peak_bytes'] / 2**20:.1f}", f"{r['bucket_bytes'] / 2**20:.1f}",
    ] for r in results]
    first_size = [r for r in results if r["params"] == results[0]["params"]]
    memory = report.markdown_table(
        ["option", "parameter", "gradient (here)", "gradient buffer (Megatron path)", "moments and other state",
         "master", "B/param (here)", "B/param (Megatron path)"],
        [[r["option"], f"{r['param_bytes']:g}", f"{r['grad_bytes']:g}", f"{r['megatron_grad_bytes']:g}",
          f"{r['state_bytes']:.5g}", f"{r['master_bytes']:g}", f"{r['bytes_per_param']:.5g}",
          f"{r['bytes_per_param'] - r['grad_bytes'] + r['megatron_grad_bytes']:.5g}"] for r in first_size],
    )
    copies = ", ".join(sorted({f"{r['params']:.3g} elements: {r['copy_bandwidth'] / 1e9:.1f} GB/s" for r in results}))
    notes = [
        f"{settings}. Ratio: the option's median step time over torch's FP32 fused AdamW's, their steps alternating "
        f"in the same process. Copy %: the option's effective bandwidth (bytes it must read and write per parameter "
        f"x parameters / step time) as a share of a plain FP32 copy in the same run ({copies}). Peak MB: memory a "
        "step allocates beyond what was live before it; bucket MB: the largest bucket's 16-bit parameters.",
        *notes,
    ]
    if step_path != "fused":
        report.write_result(path, STEP_TITLES[step_path], header, rows, notes, device=device)
        return
    notes += [
        "Bytes per parameter, measured from the tensors the optimizer holds (parameter, gradient, state):",
        memory,
        "The gradient here is the BF16 gradient this benchmark allocates. `lowprec-train` reduces gradients in FP32 "
        "(`precision.grad_reduce_in_fp32`) by default where the option keeps an FP32 master (not one stored as an "
        "8-bit residual), so megatron-core's gradient buffer there holds 4 B per parameter; the Megatron-path columns "
        "count it so (from that rule, `PrecisionStrategy.default_grad_reduce_in_fp32`, not measured here).",
    ]

    def step_against_copy(figure) -> None:
        axes = figure.add_subplot()
        labels = [f"{r['option']}\n{r['params']:.2g}" if len(results) > len(first_size) else r["option"] for r in results]
        positions = range(len(results))
        bars = (("step", lambda r: r["seconds"]), ("torch FP32 fused AdamW, paired", lambda r: r["baseline_seconds"]),
                ("a copy of its bytes", lambda r: r["traffic"] * r["params"] / r["copy_bandwidth"]))
        for index, (label, seconds) in enumerate(bars):
            axes.bar([x + 0.27 * (index - 1) for x in positions], [seconds(r) * 1e3 for r in results], 0.27, label=label)
        axes.set_xticks(list(positions), labels, rotation=45, ha="right")
        axes.set_yscale("log")
        axes.set_ylabel("ms")
        axes.set_title(f"Optimizer step against copy bandwidth ({report.device_name(device)})", fontsize=9)
        axes.legend(fontsize=8)

    def stacked_bytes(figure) -> None:
        axes = figure.add_subplot()
        bottom = [0.0] * len(first_size)
        for key, label in (("param_bytes", "parameter"), ("megatron_grad_bytes", "gradient buffer (Megatron path)"),
                           ("state_bytes", "moments and other state"), ("master_bytes", "master")):
            heights = [r[key] for r in first_size]
            axes.bar([r["option"] for r in first_size], heights, bottom=bottom, label=label)
            bottom = [b + h for b, h in zip(bottom, heights)]
        axes.set_ylabel("bytes per parameter")
        axes.set_title("Bytes per parameter by component", fontsize=9)
        axes.tick_params(axis="x", rotation=45)
        axes.legend(fontsize=8)

    report.write_result(path, STEP_TITLES[step_path], header, rows, notes,
                        device=device, plot=step_against_copy)
    report.save_plot(stacked_bytes, path.with_name(path.stem + "-memory.png"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["1M"], help="parameter counts, e.g. 1M 16M 64M")
    parser.add_argument("--options", nargs="+", default=default_options(), help="NAME or NAME:MASTER_STORAGE")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    paths = parser.add_mutually_exclusive_group()
    paths.add_argument("--eager", action="store_true", help="time the eager reference instead of the fused step")
    paths.add_argument(
        "--uncompiled", action="store_true",
        help="time the fused step while its compile is pending (uncompiled, in pieces; and whole, as the baseline)",
    )
    parser.add_argument(
        "--pieces", type=parse_size, default=None,
        help=f"with --uncompiled: elements per piece (default fused.EAGER_WINDOW_ELEMENTS, {fused.EAGER_WINDOW_ELEMENTS})",
    )
    parser.add_argument("--kernels", action="store_true", help="also list the GPU kernels of one step per option (CUDA)")
    parser.add_argument(
        "--tensors", type=int, default=4, help="parameters the elements are split into (4: a transformer-like mix; "
        "more: near-equal, as a model's weights, where the step's host work shows)",
    )
    parser.add_argument("--markdown", type=Path, default=None, metavar="PATH",
                        help="also write the table as a stamped Markdown file, with plots beside it as PNG")
    parser.add_argument("--note", action="append", default=[], help="a paragraph for the Markdown file's notes")
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.pieces is not None and not args.uncompiled:
        parser.error("--pieces sets the uncompiled step's pieces and needs --uncompiled")
    if args.kernels and device.type != "cuda":
        parser.error(f"--kernels lists GPU kernels and needs --device cuda; got --device {args.device}")
    sizes = [parse_size(s) for s in args.sizes]
    path = "eager" if args.eager else "uncompiled" if args.uncompiled else "fused"
    results = run(sizes, args.options, args.warmup, args.repeats, device, path, kernels=args.kernels, pieces=args.pieces,
                  tensors=args.tensors)
    if args.markdown is not None:
        import report

        settings = (f"`python benchmarks/optimizer_step.py --sizes {' '.join(args.sizes)} --tensors {args.tensors} "
                    f"--warmup {args.warmup} --repeats {args.repeats}"
                    + {"fused": "", "eager": " --eager", "uncompiled": " --uncompiled"}[path]
                    + (f" --pieces {args.pieces}" if args.pieces is not None else "")
                    + (f" --options {' '.join(args.options)}" if args.options != default_options() else "")
                    + f"`, {report.threads()}"
                    + (f", pieces of {args.pieces or fused.EAGER_WINDOW_ELEMENTS} elements; `(whole)`: the same call "
                       "over the whole bucket" if path == "uncompiled" else ""))
        write_markdown(args.markdown, results, device, path, settings, args.note)


if __name__ == "__main__":
    main()
