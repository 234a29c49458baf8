"""Activation memory of one transformer layer: BF16 against COAT's FP8 flow (COAT Table 2, Table 6).

Bytes saved for backward are counted with ``torch.autograd.graph.saved_tensors_hooks`` during one
forward pass: every saved tensor's storage is counted once at its full size (a view keeps its whole
storage alive), and storages of the layer's parameters are left out. Each byte is attributed to the
innermost module whose forward saved it. Figures are multiples of COAT's unit
U = batch x seq x hidden x 2 bytes.

Layers, from plain torch modules, [batch, seq, hidden] in BF16 on CPU:

- Llama-style: RMSNorm, fused QKV linear, RoPE, causal SDPA, output projection, RMSNorm, fused
  gate/up linear (megatron's linear_fc1), SwiGLU (megatron's chunk order), down projection;
  ffn = 256 * ceil(8 hidden / 3 / 256) (Llama: 4096 -> 11008). Head dim 128.
- GPT-style: LayerNorm, fused QKV linear, causal SDPA, output projection, LayerNorm, linear,
  GELU, linear with biases; ffn = 4 hidden.

Flows: "bf16" (torch.nn.RMSNorm / LayerNorm / Linear, F.silu / F.gelu) and "coat" (FP8Linear,
FP8RMSNorm / FP8LayerNorm, FP8SwiGLU / FP8GELU). Attention (RoPE, SDPA) is the same in both: COAT
handles it separately (section 5.1, footnote 2).

Where this differs from COAT's Table 2 (Llama-style; measured at hidden 4096, ffn 11008: BF16
26.8U, COAT 13.5U, against 22.66U and 13.33U): torch.nn.RMSNorm saves two FP32 copies of its input
on CPU (4U per norm; Table 2 counts 2U); "attention" holds the fused QKV output that SDPA's saved V
view keeps alive, the RoPE'd Q and K and SDPA's output, which is also the output projection's input
(Table 2: RoPE 2U + FlashAttention 3U, and that input as 1U of Linear, Appendix D); the FP8 output
projection saves its own FP8 copy of that input (0.5U, which COAT's Appendix D avoids); FP8SwiGLU
saves only its FP8 input, with its 1 x 16 scales (Table 2 counts 4U). The per-group FP8 tensors cost
1.25 bytes per element (payload and float32 scale).

    python benchmarks/activation_memory.py --batch 4 --seq 2048 --hidden 2048
"""

from __future__ import annotations

import argparse
import math
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from megatron_lowprec.layers import FP8GELU, FP8LayerNorm, FP8Linear, FP8RMSNorm, FP8SwiGLU

ARCHITECTURES = ("llama", "gpt")
FLOWS = ("bf16", "coat")
HEAD_DIM = 128
PAPER_LLAMA_UNITS = {"bf16": 22.66, "coat": 13.33}
"""COAT Table 2, Llama-style layer, in U."""


class SwiGLU(torch.nn.Module):
    """SiLU(a) * b on the halves [a, b] of the last dim (megatron's gated linear unit)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, value = torch.chunk(x, 2, dim=-1)
        return F.silu(gate) * value


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = torch.chunk(x, 2, dim=-1)
    return torch.cat([-second, first], dim=-1)


class Attention(torch.nn.Module):
    """Fused QKV projection, optional rotary embedding, causal SDPA, output projection."""

    def __init__(self, hidden: int, linear: type[torch.nn.Linear], rotary: bool, bias: bool):
        super().__init__()
        self.heads = max(hidden // HEAD_DIM, 1)
        self.qkv = linear(hidden, 3 * hidden, bias=bias)
        self.proj = linear(hidden, hidden, bias=bias)
        self.rotary = rotary

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        query, key, value = self.qkv(x).unflatten(-1, (3, self.heads, -1)).permute(2, 0, 3, 1, 4).unbind(0)
        if self.rotary:
            head_dim = query.shape[-1]
            frequencies = 10000.0 ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
            angles = torch.outer(torch.arange(seq, dtype=torch.float32), frequencies).repeat(1, 2)
            cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
            query = query * cos + rotate_half(query) * sin
            key = key * cos + rotate_half(key) * sin
        attended = F.scaled_dot_product_attention(query, key, value, is_causal=True)
        return self.proj(attended.transpose(1, 2).reshape(batch, seq, hidden))


class MLP(torch.nn.Module):
    def __init__(self, hidden: int, ffn: int, linear: type[torch.nn.Linear], activation: torch.nn.Module,
                 gated: bool, bias: bool):
        super().__init__()
        self.fc1 = linear(hidden, 2 * ffn if gated else ffn, bias=bias)
        self.act = activation
        self.fc2 = linear(ffn, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class TransformerLayer(torch.nn.Module):
    """Pre-norm layer: x + attention(norm1(x)), then + mlp(norm2(.))."""

    def __init__(self, norm: Callable[[], torch.nn.Module], attention: Attention, mlp: MLP):
        super().__init__()
        self.norm1, self.attention, self.norm2, self.mlp = norm(), attention, norm(), mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


def llama_ffn_hidden(hidden: int) -> int:
    """Llama's MLP width: 8/3 hidden rounded up to a multiple of 256."""
    return 256 * math.ceil(8 * hidden / 3 / 256)


def build_layer(architecture: str, flow: str, hidden: int) -> TransformerLayer:
    """A BF16 transformer layer of ``architecture`` ("llama" | "gpt") in ``flow`` ("bf16" | "coat")."""
    if architecture not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {architecture!r}; valid: {', '.join(ARCHITECTURES)}")
    if flow not in FLOWS:
        raise ValueError(f"unknown flow {flow!r}; valid: {', '.join(FLOWS)}")
    coat = flow == "coat"
    linear = FP8Linear if coat else torch.nn.Linear
    if architecture == "llama":
        norm_class = FP8RMSNorm if coat else torch.nn.RMSNorm
        layer = TransformerLayer(
            lambda: norm_class(hidden, eps=1e-5),
            Attention(hidden, linear, rotary=True, bias=False),
            MLP(hidden, llama_ffn_hidden(hidden), linear, FP8SwiGLU() if coat else SwiGLU(), gated=True, bias=False),
        )
    else:
        norm_class = FP8LayerNorm if coat else torch.nn.LayerNorm
        layer = TransformerLayer(
            lambda: norm_class(hidden),
            Attention(hidden, linear, rotary=False, bias=True),
            MLP(hidden, 4 * hidden, linear, FP8GELU() if coat else torch.nn.GELU(), gated=False, bias=True),
        )
    return layer.to(torch.bfloat16)


def saved_bytes_by_module(layer: torch.nn.Module, hidden_states: torch.Tensor) -> dict[str, int]:
    """Bytes of the storages saved for backward by one forward of ``layer``, per innermost module.

    Each storage counts once, in full, under the module that first saved it; parameters are left out.
    The graph is freed on return.
    """
    parameter_storages = {parameter.untyped_storage().data_ptr() for parameter in layer.parameters()}
    active_modules: list[str] = []
    owners: dict[int, tuple[str, int]] = {}

    def enter(name: str) -> Callable:
        return lambda module, args: active_modules.append(name)

    def leave(module, args, output) -> None:
        active_modules.pop()

    handles = []
    for name, module in layer.named_modules():
        handles.append(module.register_forward_pre_hook(enter(name or "layer")))
        handles.append(module.register_forward_hook(leave))

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
        if pointer not in parameter_storages and pointer not in owners:
            owners[pointer] = (active_modules[-1], storage.nbytes())
        return tensor

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            layer(hidden_states)
    finally:
        for handle in handles:
            handle.remove()
    totals: dict[str, int] = defaultdict(int)
    for module_name, nbytes in owners.values():
        totals[module_name] += nbytes
    return dict(totals)


def measure(architecture: str, flow: str, batch: int, seq: int, hidden: int, seed: int = 0) -> dict[str, float]:
    """Saved activation memory of one layer in U, per module and under "total"."""
    torch.manual_seed(seed)
    layer = build_layer(architecture, flow, hidden)
    hidden_states = torch.randn(batch, seq, hidden, dtype=torch.bfloat16, requires_grad=True)
    unit = batch * seq * hidden * 2
    units = {name: nbytes / unit for name, nbytes in saved_bytes_by_module(layer, hidden_states).items()}
    units["total"] = sum(units.values())
    return units


def table_rows(results: dict[tuple[str, str], dict[str, float]]) -> tuple[list[str], list[list[str]]]:
    """The header and one row per (architecture, flow): U per module, total, and the ratio to that
    architecture's BF16."""
    modules = sorted({name for units in results.values() for name in units if name != "total"})
    header = ["layer", "flow", *modules, "total U", "vs bf16"]
    rows = []
    for (architecture, flow), units in results.items():
        baseline = results[(architecture, "bf16")]["total"]
        rows.append([
            architecture,
            flow,
            *(f"{units.get(name, 0.0):.2f}" for name in modules),
            f"{units['total']:.2f}",
            f"{units['total'] / baseline:.3f} ({baseline / units['total']:.2f}x less)",
        ])
    return header, rows


def format_table(results: dict[tuple[str, str], dict[str, float]]) -> str:
    """:func:`table_rows` as aligned text."""
    header, rows = table_rows(results)
    rows = [header, *rows]
    widths = [max(len(row[column]) for row in rows) for column in range(len(header))]
    return "\n".join("  ".join(cell.rjust(width) for cell, width in zip(row, widths)) for row in rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--markdown", type=Path, default=None, metavar="PATH", help="also write the table as a stamped Markdown file")
    parser.add_argument("--note", action="append", default=[], help="a paragraph for the Markdown file's notes")
    args = parser.parse_args(argv)
    results = {
        (architecture, flow): measure(architecture, flow, args.batch, args.seq, args.hidden)
        for architecture in ARCHITECTURES
        for flow in FLOWS
    }
    print(f"Saved activations per layer, batch {args.batch} x seq {args.seq} x hidden {args.hidden}, "
          f"U = {args.batch * args.seq * args.hidden * 2} bytes "
          f"(llama ffn {llama_ffn_hidden(args.hidden)}, gpt ffn {4 * args.hidden}):")
    print(format_table(results))
    print(f"COAT Table 2, Llama-style: bf16 {PAPER_LLAMA_UNITS['bf16']}U, coat {PAPER_LLAMA_UNITS['coat']}U "
          f"({PAPER_LLAMA_UNITS['bf16'] / PAPER_LLAMA_UNITS['coat']:.2f}x less)")
    if args.markdown is not None:
        import report

        header, rows = table_rows(results)
        report.write_result(args.markdown, "Activation memory of one transformer layer: BF16 against COAT's FP8 flow",
                            header, rows, [
            f"`python benchmarks/activation_memory.py --batch {args.batch} --seq {args.seq} --hidden {args.hidden}`: "
            "bytes each module saves for backward in one forward pass (saved-tensor hooks, each storage counted once, "
            f"parameters left out), in COAT's unit U = batch x seq x hidden x 2 bytes = {args.batch * args.seq * args.hidden * 2:,} "
            f"bytes (llama ffn {llama_ffn_hidden(args.hidden)}, gpt ffn {4 * args.hidden}). The bytes do not depend on "
            f"the machine. COAT's Table 2, Llama-style: bf16 {PAPER_LLAMA_UNITS['bf16']}U, coat {PAPER_LLAMA_UNITS['coat']}U; "
            "the benchmark's docstring lists where its accounting differs.", *args.note,
        ])


if __name__ == "__main__":
    main()
