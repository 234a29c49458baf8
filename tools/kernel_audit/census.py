"""A traffic census of one transformer layer, forward and backward, with COAT's FP8 layers and with stock BF16.

The layer is a GPT decoder layer as megatron-core's local spec builds it (pre-LayerNorm, fused QKV
linear with bias, rotary embedding, causal attention on ``scaled_dot_product_attention``, output
projection, residual add, LayerNorm, GELU MLP of two linears, residual add; no dropout), in BF16.
``stock`` runs torch's own layers; ``coat`` runs the functions that
:func:`~megatron_lowprec.megatron.layers.apply_layer_precision` puts into the model
(:func:`~megatron_lowprec.layers.fp8_linear`, :class:`~megatron_lowprec.layers.FP8LayerNorm`,
:func:`~megatron_lowprec.layers.fp8_gelu`; COAT, Xi et al., 2024, section 5.2) inside
:func:`~megatron_lowprec.layers.fp8_weight_cache`, as the training loop runs them.

Forward and backward run on fake tensors (``FakeTensorMode``: shapes and dtypes, no data) under a
``TorchDispatchMode`` that records every aten operation with the bytes of its tensor inputs and
outputs at their storage dtype and, for matmuls, 2·M·N·K FLOPs by input dtype. The FP8 matmuls take
the path of a GPU that has ``torch._scaled_mm`` (sm_89 and later): ``_scaled_mm`` on FP8 operands,
and a row-major copy of each transposed FP8 operand (``fp8_linear.row_major``) recorded before it,
unless the quantization wrote that operand (where it is compiled: ``fp8_linear.transposes_in_quantization``).
Attention is counted as one flash-attention kernel each way with its causal matmul FLOPs.

The ``eager`` count takes every operation that is not a view as one kernel at its own traffic: COAT's
path where nothing is compiled. On GPUs that convert FP8 in Triton, COAT's quantizations, operand
copies and norm and activation backward passes each run as one compiled call
(``numerics/compiled.py: compiled_where_fp8_converts``), the linear layers' quantizations then also
writing the transposed payloads their backward GEMMs take; the ``compiled`` count, a run of that path
(:func:`compiled_kernels`), replaces each such call by the Triton kernels Inductor generates for it on
fake CUDA tensors of an sm_90 GPU (``tools/kernel_audit/codegen.py: cuda_codegen``), through the
package's own compile, each kernel at the bytes Inductor's own estimate gives its buffer arguments
(``estimate_kernel_num_bytes``, split into read and written, evaluated at the call's sizes).

A kernel that is not a GEMM or attention is at its minimum traffic when every byte it moves is one
the layer must move at its storage dtype. It is not (``Census.reasons``) when it is a
standalone copy or cast (a transposed FP8 payload, an FP32 copy of a BF16 tensor), when it reads or
writes an FP32 tensor as large as the layer's input (an FP32 copy of a BF16 activation), or when it
reads a tensor that another non-GEMM kernel wrote in the same pass (an amax or a division re-reading
what the previous operation just wrote: a fusion would keep it in registers). A generated kernel is
not when it copies one tensor to another of the same dtype, moves an FP32 tensor of activation size,
reads its compiled call's input after an earlier kernel of the call read it (a per-tensor amax and
then the cast), or reads a large buffer another kernel of the call wrote.

The roofline prices each kernel at max(bytes / HBM bandwidth, FLOPs / tensor-core peak of its input
dtype) on an H200, and a step at its layer count times the layer. Calibration scales both estimates
by the ratio of the measured stock step to stock's estimate.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_lowprec.layers import FP8LayerNorm, fp8_gelu, fp8_linear, fp8_weight_cache
from megatron_lowprec.layers.fp8_linear import _copied

FLAVOURS = ("stock", "coat")


@dataclasses.dataclass(frozen=True)
class LayerShape:
    """A GPT decoder layer's sizes, the micro-batch it runs and the model's layer count."""

    hidden: int
    heads: int
    ffn: int
    seq: int
    micro_batch: int
    layers: int

    @property
    def tokens(self) -> int:
        return self.seq * self.micro_batch


SHAPES = {
    "gpt_1.3b": LayerShape(hidden=2048, heads=16, ffn=8192, seq=2048, micro_batch=4, layers=24),
    "tiny": LayerShape(hidden=64, heads=4, ffn=256, seq=64, micro_batch=4, layers=4),
}
"""configs/model/gpt_1.3b.yaml at the measured micro-batch 4, and the embedded default
(configs/model/tiny.yaml, ``trainer.micro_batch_size`` 4)."""

H200_HBM_BYTES_PER_S = 4.8e12
H200_PEAK_FLOPS = {"bf16": 989e12, "fp8": 1979e12}
"""Dense tensor-core peaks by GEMM input dtype."""

MEASURED_STEP_MS = {"stock": 175.0, "coat": 532.0}
"""Forward and backward of one GPT-1.3B step at micro-batch 4 measured on an H200 (coat with its
quantization as eager operations)."""

GEMMS = {"mm", "addmm", "bmm", "baddbmm", "_scaled_mm"}
COPIES = {"_to_copy", "copy_", "clone", "cat", "constant_pad_nd", "contiguous", "slice_scatter", "_copy_from"}
REDUCTIONS = {"sum", "mean", "amax", "max", "min", "var_mean", "native_layer_norm", "native_layer_norm_backward",
              "_softmax", "_softmax_backward_data", "norm", "linalg_vector_norm"}
NO_KERNEL = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "_local_scalar_dense",
             "lift_fresh", "detach", "lift_fresh_copy", "sym_size", "sym_stride", "sym_numel", "is_same_size"}
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
KINDS = ("gemm", "attention", "elementwise", "reduction", "copy", "compiled")
"""``compiled``: a Triton kernel Inductor generates for a compiled call (:func:`compiled_kernels`)."""


@dataclasses.dataclass
class RegionCall:
    """One call of a compiled function (``compiled_where_fp8_converts``) during the census."""

    function: Callable
    args: tuple
    """Its arguments: fake tensors and constants."""
    phase: str
    reasons: list[str]
    """Why its inputs are read again (:meth:`Census._rereads`): a producer that did not fuse it."""


@dataclasses.dataclass
class Kernel:
    """One recorded kernel launch."""

    op: str
    kind: str
    """One of :data:`KINDS`."""
    phase: str
    """"forward" or "backward"."""
    read: int
    written: int
    flops: float = 0.0
    gemm_dtype: str | None = None
    """"fp8" or "bf16" (any 16-bit or FP32 input) for GEMMs and attention."""
    region: str | None = None
    """The compiled function (``compiled_where_fp8_converts``) it runs inside, if any."""
    region_call: int | None = None
    signature: str = ""
    """Its tensors' shapes and dtypes, inputs -> outputs."""
    reasons: list[str] = dataclasses.field(default_factory=list)
    """Why it is not at its minimum traffic (empty: it is, or it is a GEMM)."""

    @property
    def bytes(self) -> int:
        return self.read + self.written

    def seconds(self) -> float:
        """Roofline time on an H200."""
        compute = self.flops / H200_PEAK_FLOPS[self.gemm_dtype] if self.flops else 0.0
        return max(self.bytes / H200_HBM_BYTES_PER_S, compute)


def _tensors(tree) -> list[torch.Tensor]:
    return [value for value in torch.utils._pytree.tree_leaves(tree) if isinstance(value, torch.Tensor)]


def _tensor_bytes(tensor: torch.Tensor) -> int:
    """Bytes a kernel moves for ``tensor``: its elements at its dtype, at most its storage (broadcast views)."""
    return min(tensor.numel(), tensor.untyped_storage().nbytes() // tensor.element_size()) * tensor.element_size()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _describe(tensor: torch.Tensor) -> str:
    return f"{_dtype_name(tensor.dtype)}{list(tensor.shape)}"


def _signature(inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> str:
    return ", ".join(map(_describe, inputs)) + " -> " + ", ".join(map(_describe, outputs))


def _gemm_dtype(dtype: torch.dtype) -> str:
    return "fp8" if dtype in FP8_DTYPES else "bf16"


def _matmul_flops(name: str, inputs: list[torch.Tensor]) -> float:
    """2·M·N·K of a matmul op (batched: times the batch) from its operands."""
    a, b = (inputs[1], inputs[2]) if name in ("addmm", "baddbmm") else (inputs[0], inputs[1])
    return 2.0 * math.prod(a.shape) * b.shape[-1]


def _argument(func, args: tuple, kwargs: dict, name: str):
    """The value of argument ``name`` of an aten call, positional or keyword (its schema's default if absent)."""
    for index, argument in enumerate(func._schema.arguments):
        if argument.name == name:
            return args[index] if index < len(args) else kwargs.get(name, argument.default_value)
    raise ValueError(f"{func} has no argument {name!r}")


def _attention_flops(func, args: tuple, kwargs: dict) -> float:
    """Flash attention's matmul FLOPs: 2 matmuls forward (QK^T, PV), 5 backward (with QK^T recomputed),
    each 2·batch·heads·s_q·s_k·d, halved when causal."""
    query, key = _argument(func, args, kwargs, "query"), _argument(func, args, kwargs, "key")
    causal = bool(_argument(func, args, kwargs, "is_causal"))
    batch_heads = math.prod(query.shape[:-2])
    per_matmul = 2.0 * batch_heads * query.shape[-2] * key.shape[-2] * query.shape[-1] * (0.5 if causal else 1.0)
    return per_matmul * (5 if "backward" in func.overloadpacket.__name__ else 2)


class Census(TorchDispatchMode):
    """Records every kernel an operation launches (see the module docstring)."""

    def __init__(self, activation_elements: int) -> None:
        super().__init__()
        self.activation_elements = activation_elements
        """Elements of the layer's input (tokens × hidden): an FP32 tensor this large is an FP32 activation."""
        self.kernels: list[Kernel] = []
        self.phase = "forward"
        self.region: str | None = None
        self.region_calls = 0
        self.regions: dict[int, RegionCall] = {}
        """Each compiled call by its number: what it compiles and its arguments."""
        self.compiled_graphs = 0
        """Graphs Inductor compiled for the compiled calls (set by :func:`compiled_kernels`)."""
        self.saved: dict[StorageWeakRef, int] = {}
        """Bytes of each storage autograd saved for backward (:meth:`save`), weights and their FP8
        copies of :func:`~megatron_lowprec.layers.fp8_weight_cache` excluded."""
        self.weights: set[StorageWeakRef] = set()
        self._producers: dict[StorageWeakRef, int] = {}
        """The last kernel that wrote each storage (a weak reference keeps a freed storage's address from reuse)."""

    def compiled_where_fp8_converts(self, function: Callable, device: torch.device) -> Callable:
        """Stand-in for ``numerics/compiled.py``'s: ``function`` itself, its operations marked as one region."""

        def region(*args, **kwargs):
            if kwargs:
                raise ValueError(f"compiled call {function.__name__} takes positional arguments only")
            self.region, self.region_calls = function.__name__, self.region_calls + 1
            self.regions[self.region_calls] = RegionCall(function, args, self.phase, self._rereads(_tensors(args)))
            try:
                return function(*args)
            finally:
                self.region = None

        return region

    def save(self, tensor: torch.Tensor) -> torch.Tensor:
        """Autograd's pack hook: count a saved activation's storage once."""
        storage = StorageWeakRef(tensor.untyped_storage())
        if storage not in self.weights:
            self.saved[storage] = tensor.untyped_storage().nbytes()
        return tensor

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name == "_scaled_mm":
            args = (self._row_major(args[0]), self._row_major(args[1].t()).t(), *args[2:])
        out = func(*args, **kwargs)
        if func.namespace == "aten" and not func.is_view and name not in NO_KERNEL:
            self._record(name, _tensors((args, kwargs)), _tensors(out), func, args, kwargs)
        return out

    def _row_major(self, payload: torch.Tensor) -> torch.Tensor:
        """``fp8_linear.row_major`` as a GPU runs it: a transposed FP8 operand copied by one kernel."""
        if payload.is_contiguous():
            return payload
        copy = payload.contiguous()
        self._record("row_major", [payload], [copy], region="_copied")
        return copy

    def _record(self, name: str, inputs: list[torch.Tensor], outputs: list[torch.Tensor], func=None, args=(),
                kwargs=None, region: str | None = None) -> None:
        """Append the kernel of one operation (``row_major``: the census's own operand copy, its own region)."""
        if name in GEMMS:
            kind, flops, dtype = "gemm", _matmul_flops(name, inputs), _gemm_dtype(inputs[0].dtype if name != "addmm" else inputs[1].dtype)
        elif "scaled_dot_product" in name:
            kind, flops, dtype = "attention", _attention_flops(func, args, kwargs), _gemm_dtype(inputs[0].dtype)
        else:
            largest = max((tensor.numel() for tensor in inputs), default=0)
            smaller = outputs and all(tensor.numel() < largest for tensor in outputs)
            kind = "copy" if name in COPIES or name == "row_major" else "reduction" if name in REDUCTIONS or smaller else "elementwise"
            flops, dtype = 0.0, None
        region = region or self.region
        if name == "row_major":
            self.region_calls += 1
        kernel = Kernel(
            op=name, kind=kind, phase=self.phase, read=sum(map(_tensor_bytes, inputs)),
            written=sum(map(_tensor_bytes, outputs)), flops=flops, gemm_dtype=dtype,
            region=region, region_call=self.region_calls if region else None, signature=_signature(inputs, outputs),
        )
        if kind not in ("gemm", "attention"):
            kernel.reasons = self.reasons(kernel, inputs, outputs)
        if name == "row_major":
            self.regions[kernel.region_call] = RegionCall(_copied, (inputs[0],), self.phase, self._rereads(inputs))
        index = len(self.kernels)
        self.kernels.append(kernel)
        for tensor in outputs:
            self._producers[StorageWeakRef(tensor.untyped_storage())] = index

    def reasons(self, kernel: Kernel, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> list[str]:
        """Why a non-GEMM kernel is not at its minimum traffic (see the module docstring); empty if it is."""
        reasons = []
        if kernel.kind == "copy":
            casts = sorted({f"{_dtype_name(i.dtype)} to {_dtype_name(o.dtype)}" for i in inputs for o in outputs if i.dtype != o.dtype})
            if casts:
                reasons.append("standalone cast " + ", ".join(casts))
            else:
                fp8 = any(tensor.dtype in FP8_DTYPES for tensor in outputs)
                reasons.append("standalone copy of an FP8 payload" if fp8 else "standalone copy")
        return reasons + self._activation_fp32(inputs + outputs) + self._rereads(inputs)

    def _activation_fp32(self, tensors: list[torch.Tensor]) -> list[str]:
        if any(tensor.dtype == torch.float32 and tensor.numel() >= self.activation_elements for tensor in tensors):
            return ["FP32 tensor of activation size"]
        return []

    def _rereads(self, inputs: list[torch.Tensor]) -> list[str]:
        """The first input that another non-GEMM kernel wrote in the same pass, named by that kernel (and
        its region); what the forward pass saved for backward is read there once, as it must be."""
        for tensor in inputs:
            index = self._producers.get(StorageWeakRef(tensor.untyped_storage()))
            producer = None if index is None else self.kernels[index]
            if producer is not None and producer.kind not in ("gemm", "attention") and producer.phase == self.phase:
                where = f" in {producer.region}" if producer.region else ""
                return [f"re-reads what {producer.op}{where} wrote"]
        return []


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """megatron-core's rotary embedding (``_apply_rotary_pos_emb_bshd``): x·cos + rotate_half(x)·sin."""
    first, second = torch.chunk(x, 2, dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin


class Layer(torch.nn.Module):
    """One GPT decoder layer on [seq, batch, hidden] BF16 inputs; ``flavour`` "stock" or "coat"."""

    def __init__(self, shape: LayerShape, flavour: str) -> None:
        super().__init__()
        if flavour not in FLAVOURS:
            raise ValueError(f"unknown flavour {flavour!r}; valid: {', '.join(FLAVOURS)}")
        self.shape, self.flavour = shape, flavour
        hidden, ffn = shape.hidden, shape.ffn
        norm = FP8LayerNorm if flavour == "coat" else torch.nn.LayerNorm
        self.input_norm = norm(hidden, dtype=torch.bfloat16)
        self.mlp_norm = norm(hidden, dtype=torch.bfloat16)
        self.qkv = torch.nn.Linear(hidden, 3 * hidden, dtype=torch.bfloat16)
        self.proj = torch.nn.Linear(hidden, hidden, dtype=torch.bfloat16)
        self.fc1 = torch.nn.Linear(hidden, ffn, dtype=torch.bfloat16)
        self.fc2 = torch.nn.Linear(ffn, hidden, dtype=torch.bfloat16)

    def _linear(self, module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, module.weight, module.bias) if self.flavour == "coat" else F.linear(x, module.weight, module.bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        seq, batch, hidden = x.shape
        heads, head_dim = self.shape.heads, hidden // self.shape.heads
        qkv = self._linear(self.qkv, self.input_norm(x)).view(seq, batch, heads, 3 * head_dim)
        query, key, value = torch.split(qkv, head_dim, dim=-1)
        query, key = _rope(query, cos, sin), _rope(key, cos, sin)
        attended = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (query, key, value)), is_causal=True)
        x = x + self._linear(self.proj, attended.permute(2, 0, 1, 3).reshape(seq, batch, hidden))
        intermediate = self._linear(self.fc1, self.mlp_norm(x))
        activated = fp8_gelu(intermediate) if self.flavour == "coat" else F.gelu(intermediate)
        return x + self._linear(self.fc2, activated)


def _scaled_mm_on_sm90(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``fp8_linear._scaled_mm_chosen`` as an sm_90 GPU answers it."""
    both_e5m2 = a.dtype == b.dtype == torch.float8_e5m2
    return not both_e5m2 and all(size % 16 == 0 for size in (*a.shape, b.shape[1]))


@contextlib.contextmanager
def _as_on_gpu(census: Census, compiled: bool) -> Iterator[None]:
    """COAT's path as an sm_90 GPU takes it: ``_scaled_mm`` where it applies, and each compiled call
    run eagerly with its operations marked (the modules imported the names they call); ``compiled``:
    where Inductor compiles the quantization, whose calls then also write the transposed payloads
    (``fp8_linear.transposes_in_quantization``), else where nothing is compiled."""
    quant, linear, activations = (sys.modules[name] for name in (
        "megatron_lowprec.numerics.quant", "megatron_lowprec.layers.fp8_linear", "megatron_lowprec.layers.fp8_activations"))
    with contextlib.ExitStack() as stack:
        for module in (quant, linear, activations):
            stack.enter_context(mock.patch.object(module, "compiled_where_fp8_converts", census.compiled_where_fp8_converts))
        stack.enter_context(mock.patch.object(linear, "_scaled_mm_chosen", _scaled_mm_on_sm90))
        stack.enter_context(mock.patch.object(linear, "triton_converts_fp8", lambda device: compiled))
        yield


def run_census(shape: LayerShape, flavour: str, compiled: bool = False) -> Census:
    """The kernels of one layer's forward and backward (see the module docstring), COAT's on the path
    of a GPU where its calls are ``compiled`` (:func:`_as_on_gpu`)."""
    census = Census(shape.tokens * shape.hidden)
    head_dim = shape.hidden // shape.heads
    with FakeTensorMode(), _as_on_gpu(census, compiled):
        layer = Layer(shape, flavour)
        x = torch.empty(shape.seq, shape.micro_batch, shape.hidden, dtype=torch.bfloat16, requires_grad=True)
        cos = torch.empty(shape.seq, 1, 1, head_dim, dtype=torch.bfloat16)
        sin = torch.empty(shape.seq, 1, 1, head_dim, dtype=torch.bfloat16)
        grad = torch.empty(shape.seq, shape.micro_batch, shape.hidden, dtype=torch.bfloat16)
        census.weights = {StorageWeakRef(parameter.untyped_storage()) for parameter in layer.parameters()}
        with fp8_weight_cache() if flavour == "coat" else contextlib.nullcontext(), census, \
                torch.autograd.graph.saved_tensors_hooks(census.save, lambda tensor: tensor):
            output = layer(x, cos, sin)
            census.phase = "backward"
            output.backward(grad)
            for cached in (sys.modules["megatron_lowprec.layers.fp8_linear"]._weight_cache or {}).values():
                for tensor in (tensor for tensor in cached if tensor is not None):
                    census.saved.pop(StorageWeakRef(tensor.untyped_storage()), None)
    return census


TRAFFIC_MARK = "# census traffic: "
"""Prefix of the line :func:`_traffic_noted` appends to each generated Triton kernel's source."""


def _kernel_traffic(kernel) -> list[list]:
    """[role, dtype, elements, graph input] of each buffer argument a Triton kernel accesses, the
    elements a sympy expression in the graph's size symbols: Inductor's own estimate
    (``SIMDKernel.estimate_kernel_num_bytes``), kept symbolic and split by role ("in", "out", or
    "in_out": read and written)."""
    from torch._inductor.utils import sympy_product
    from torch._inductor.virtualized import V

    arg_defs, call_args, _, _ = kernel.args.python_argdefs()
    accesses = kernel.features.buf_accesses()
    iteration = sympy_product(kernel.numels.values())
    traffic = []
    for definition, outer in zip(arg_defs, call_args):
        if outer not in accesses:
            continue
        inner = getattr(definition, "name", str(definition))
        role = "in_out" if inner.startswith("in_out_ptr") else "out" if inner.startswith("out_ptr") else "in"
        elements = V.graph.get_numel(outer)
        if V.graph.sizevars.optimization_hint(elements) > V.graph.sizevars.optimization_hint(iteration):
            elements = len({str(getattr(dep, "index", dep)) for dep in accesses[outer]}) * iteration
        traffic.append([role, _dtype_name(V.graph.get_dtype(outer)), str(elements), outer in V.graph.graph_inputs])
    return traffic


@contextlib.contextmanager
def _traffic_noted() -> Iterator[None]:
    """Inductor's Triton kernels generated with :func:`_kernel_traffic` as a last comment line."""
    import json

    from torch._inductor.codegen.triton import TritonKernel

    generate = TritonKernel.codegen_kernel

    def codegen_kernel(self, name=None):
        return generate(self, name) + "\n" + TRAFFIC_MARK + json.dumps(_kernel_traffic(self)) + "\n"

    with mock.patch.object(TritonKernel, "codegen_kernel", codegen_kernel):
        yield


def _placeholder_symbols(graph_module: torch.fx.GraphModule, inputs: tuple) -> dict[str, int]:
    """The values of a compiled graph's size symbols in one call: each placeholder's symbolic sizes
    (and symbolic integer arguments) against the call's inputs."""
    bound = {}
    placeholders = [node for node in graph_module.graph.nodes if node.op == "placeholder"]
    for node, value in zip(placeholders, inputs):
        example = node.meta.get("example_value", node.meta.get("val"))
        pairs = zip(example.shape, value.shape) if isinstance(example, torch.Tensor) else [(example, value)]
        for symbolic, actual in pairs:
            if isinstance(symbolic, torch.SymInt) and symbolic.node.expr.is_Symbol:
                bound[str(symbolic.node.expr)] = int(actual)
    return bound


def _on_cuda(tensor: torch.Tensor) -> torch.Tensor:
    """A fake CUDA tensor of ``tensor``'s sizes, strides and dtype, with the sizes the caller marked
    static (``torch._dynamo.mark_static``: constants of the compiled graph) marked so too."""
    copy = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="cuda")
    for dim in sorted(getattr(tensor, "_dynamo_static_indices", ())):
        torch._dynamo.mark_static(copy, dim)
    return copy


@dataclasses.dataclass
class GeneratedCall:
    """The Triton kernels one compiled call launched: (kernel name, its traffic) per launch, and the
    launches of torch's own kernels in the call's graph."""

    launches: list[tuple[str, list[list]]]
    extern_launches: int


def generate_calls(regions: dict[int, RegionCall], arch: int = 90) -> tuple[dict[int, GeneratedCall], int]:
    """Each compiled call of ``regions`` as Inductor generates it for ``arch`` on fake CUDA tensors,
    through the package's own compile (``numerics/compiled.py: compile_exact``, dynamic shapes: one
    graph per function and argument kinds, reused by calls of other sizes, as on a GPU), and the
    number of graphs compiled (what a first step compiles for these calls)."""
    import json
    import tempfile

    import sympy
    import torch._inductor.compile_fx as compile_fx_module

    from megatron_lowprec.numerics.compiled import compile_exact
    from tools.kernel_audit.codegen import cuda_codegen

    compiled: dict[Callable, Callable] = {}
    generated = {}
    with tempfile.TemporaryDirectory(prefix="lowprec-census-") as cache_dir, cuda_codegen(arch, cache_dir) as capture:
        bindings: list[dict[str, int]] = []
        capture_compile = compile_fx_module.compile_fx

        def compile_fx(model, example_inputs, *args, **kwargs):
            run = capture_compile(model, example_inputs, *args, **kwargs)

            def bound_run(*inputs):
                bindings.append(_placeholder_symbols(model, inputs))
                return run(*inputs)

            return bound_run

        with _traffic_noted(), mock.patch.object(compile_fx_module, "compile_fx", compile_fx), \
                FakeTensorMode(allow_non_fake_inputs=True):
            for call, region in regions.items():
                arguments = [_on_cuda(value) if isinstance(value, torch.Tensor) else value for value in region.args]
                calls = len(capture.calls)
                if region.function not in compiled:
                    compiled[region.function] = compile_exact(region.function)
                compiled[region.function](*arguments)
                if len(capture.calls) != calls + 1:
                    raise RuntimeError(f"compiled call {region.function.__name__} ran {len(capture.calls) - calls} graphs")
                graph, values = capture.calls[-1], bindings[-1]
                body = capture.wrappers[graph].split("def call(", 1)[-1].split("\ndef ", 1)[0]
                launches = []
                for name in re.findall(r"^\s+(\w+)\.run\(", body, flags=re.M):
                    source = capture.sources[f"{graph}:{name}"][1]
                    traffic = json.loads(source.rsplit(TRAFFIC_MARK, 1)[1].splitlines()[0])
                    for entry in traffic:
                        elements = sympy.sympify(entry[2])
                        entry[2] = int(elements.subs({symbol: values[symbol.name] for symbol in elements.free_symbols}))
                    launches.append((name, traffic))
                generated[call] = GeneratedCall(launches, capture.graph_launches(graph)["extern"])
        graphs = len(capture.wrappers)
    return generated, graphs


LARGE_INTERMEDIATE = 16
"""A buffer one kernel of a compiled call writes and another reads is counted as a re-read when it
holds at least 1/16 of the layer input's elements (a group's scale per element of 1 x 16 groups);
smaller ones (a tensor's amax, a split reduction's partial results) are not."""


def compiled_kernels(census: Census, arch: int = 90) -> list[Kernel]:
    """The census's kernels with each compiled call replaced by the Triton kernels Inductor generates
    for it on ``arch``, each at the bytes it reads and writes (see the module docstring)."""
    generated, census.compiled_graphs = generate_calls(census.regions, arch)
    kernels, seen = [], set()
    for kernel in census.kernels:
        if kernel.region is None:
            kernels.append(kernel)
        elif kernel.region_call not in seen:
            seen.add(kernel.region_call)
            kernels += _call_kernels(census, census.regions[kernel.region_call], generated[kernel.region_call],
                                     kernel.region_call)
    return kernels


def _call_kernels(census: Census, region: RegionCall, generated: GeneratedCall, call: int) -> list[Kernel]:
    if generated.extern_launches:
        raise RuntimeError(f"compiled call {region.function.__name__} launches {generated.extern_launches} of "
                           "torch's own kernels, which the census does not size")
    kernels, inputs_read = [], False
    for name, traffic in generated.launches:
        def sized(roles):
            return sum(elements * torch.empty((), dtype=getattr(torch, dtype)).element_size()
                       for role, dtype, elements, _ in traffic if role in roles)

        reads = [entry for entry in traffic if entry[0] != "out"]
        writes = [entry for entry in traffic if entry[0] != "in"]
        reasons = []
        if len(reads) == len(writes) == 1 and reads[0][1] == writes[0][1] and reads[0][2] == writes[0][2] and reads != writes:
            reasons.append("standalone copy of an FP8 payload" if reads[0][1].startswith("float8") else "standalone copy")
        if any(dtype == "float32" and elements >= census.activation_elements for _, dtype, elements, _ in traffic):
            reasons.append("FP32 tensor of activation size")
        if any(graph_input for *_, graph_input in reads):
            reasons += ["re-reads the input of its compiled call"] if inputs_read else region.reasons
            inputs_read = True
        if any(role == "in" and not graph_input and elements * LARGE_INTERMEDIATE >= census.activation_elements
               for role, _, elements, graph_input in reads):
            reasons.append("re-reads what another kernel of its compiled call wrote")
        kernels.append(Kernel(
            op=name, kind="compiled", phase=region.phase, read=sized(("in", "in_out")), written=sized(("out", "in_out")),
            region=region.function.__name__, region_call=call,
            signature=", ".join(f"{role} {dtype}[{elements}]" for role, dtype, elements, _ in traffic), reasons=reasons,
        ))
    return kernels


@dataclasses.dataclass
class Summary:
    """Totals of one census."""

    launches: int
    read: int
    written: int
    gemm_flops: dict[str, float]
    attention_flops: float
    seconds: float
    non_minimal: list[Kernel]
    saved: int = 0
    """Bytes autograd keeps for backward (:meth:`Census.save`)."""
    compiled_graphs: int = 0
    """Graphs Inductor compiles for the compiled calls (``Census.compiled_graphs``)."""

    @property
    def bytes(self) -> int:
        return self.read + self.written


def summarize(kernels: list[Kernel], saved: int = 0, compiled_graphs: int = 0) -> Summary:
    return Summary(
        saved=saved, compiled_graphs=compiled_graphs,
        launches=len(kernels),
        read=sum(kernel.read for kernel in kernels),
        written=sum(kernel.written for kernel in kernels),
        gemm_flops={dtype: sum(k.flops for k in kernels if k.kind == "gemm" and k.gemm_dtype == dtype) for dtype in H200_PEAK_FLOPS},
        attention_flops=sum(kernel.flops for kernel in kernels if kernel.kind == "attention"),
        seconds=sum(kernel.seconds() for kernel in kernels),
        non_minimal=[kernel for kernel in kernels if kernel.reasons],
    )



COUNTS = (("stock", "eager"), ("coat", "eager"), ("coat", "compiled"))
"""The censuses of a shape: every operation a kernel, and for coat also its path where its calls are
compiled, each compiled call as the kernels Inductor generates for it (:func:`compiled_kernels`; stock
has no compiled calls)."""


def censuses(shape: LayerShape) -> dict[tuple[str, str], tuple[list[Kernel], Summary]]:
    """(flavour, count) of :data:`COUNTS` -> the layer's kernels and their summary."""
    stock, coat, coat_compiled = run_census(shape, "stock"), run_census(shape, "coat"), run_census(shape, "coat", compiled=True)
    kernels = {COUNTS[0]: stock.kernels, COUNTS[1]: coat.kernels, COUNTS[2]: compiled_kernels(coat_compiled)}
    saved = {key: sum(census.saved.values()) for key, census in zip(COUNTS, (stock, coat, coat_compiled))}
    graphs = {COUNTS[2]: coat_compiled.compiled_graphs}
    return {key: (value, summarize(value, saved[key], graphs.get(key, 0))) for key, value in kernels.items()}


@dataclasses.dataclass
class Estimate:
    """The roofline step time of each census of GPT-1.3B, calibrated on the measured stock step."""

    step_ms: dict[tuple[str, str], float]
    calibration: float
    """Measured stock step over stock's roofline step."""

    def calibrated_ms(self, key: tuple[str, str]) -> float:
        return self.step_ms[key] * self.calibration

    def unexplained_ms_per_launch(self, summaries: dict[tuple[str, str], Summary]) -> float:
        """The measured coat step's excess over its calibrated estimate, per launch coat adds over stock
        in a step (eager count)."""
        extra_launches = SHAPES["gpt_1.3b"].layers * (summaries[COUNTS[1]].launches - summaries[COUNTS[0]].launches)
        return (MEASURED_STEP_MS["coat"] - self.calibrated_ms(COUNTS[1])) / extra_launches


def estimate(summaries: dict[tuple[str, str], Summary]) -> Estimate:
    """:class:`Estimate` from GPT-1.3B's summaries: a step is its layer count times the layer."""
    layers = SHAPES["gpt_1.3b"].layers
    step_ms = {key: 1e3 * layers * summary.seconds for key, summary in summaries.items()}
    return Estimate(step_ms, MEASURED_STEP_MS["stock"] / step_ms[COUNTS[0]])


SUMMARY_HEADER = [
    "shape", "layer flavour", "count", "launches", "read MB", "written MB", "FP8 GEMM GFLOP", "BF16 GEMM GFLOP",
    "attention GFLOP", "saved MB", "compiled graphs", "non-minimal kernels", "their MB", "layer roofline ms", "step roofline ms",
    "calibrated step ms", "measured step ms",
]


def summary_row(shape_name: str, key: tuple[str, str], summary: Summary, roofline: Estimate | None) -> list[str]:
    """One row of :data:`SUMMARY_HEADER`; the step columns for GPT-1.3B only (``roofline``)."""
    flavour, count = key
    step = ["–", "–", "–"]
    if roofline is not None:
        measured = f"{MEASURED_STEP_MS[flavour]:g}" if count == "eager" else "not measured"
        step = [f"{roofline.step_ms[key]:.1f}", f"{roofline.calibrated_ms(key):.1f}", measured]
    return [
        shape_name, flavour, count, summary.launches, f"{summary.read / 1e6:.2f}", f"{summary.written / 1e6:.2f}",
        f"{summary.gemm_flops['fp8'] / 1e9:.4g}", f"{summary.gemm_flops['bf16'] / 1e9:.4g}",
        f"{summary.attention_flops / 1e9:.4g}", f"{summary.saved / 1e6:.2f}", summary.compiled_graphs, len(summary.non_minimal),
        f"{sum(k.bytes for k in summary.non_minimal) / 1e6:.2f}", f"{1e3 * summary.seconds:.4g}", *step,
    ]


def non_minimal_rows(kernels: list[Kernel], limit: int | None = None) -> list[list[str]]:
    """The non-minimal kernels grouped by phase, operation, region and reasons, most bytes first, each
    with the tensors of its largest member."""
    groups: dict[tuple, list[Kernel]] = {}
    for kernel in kernels:
        if kernel.reasons:
            groups.setdefault((kernel.phase, kernel.op, kernel.region or "–", "; ".join(kernel.reasons)), []).append(kernel)
    ordered = sorted(groups.items(), key=lambda item: -sum(k.bytes for k in item[1]))
    return [[phase, op, region, len(members), f"{sum(k.bytes for k in members) / 1e6:.2f}", reasons,
             f"`{max(members, key=lambda k: k.bytes).signature}`"]
            for (phase, op, region, reasons), members in ordered[:limit]]


NON_MINIMAL_HEADER = ["phase", "kernel", "compiled region", "launches", "MB", "not minimal because", "largest launch"]

LEGEND = (
    "One GPT decoder layer (pre-LayerNorm, QKV, rotary embedding, causal flash attention, projection, "
    "LayerNorm, GELU MLP; BF16, no dropout), forward and backward, on fake tensors. `eager`: every aten "
    "operation that is not a view is one kernel launch at the bytes of its inputs and outputs, an upper "
    "COAT's path where nothing is compiled; `compiled`: COAT's path on GPUs that convert FP8 in Triton, "
    "where the linear layers' quantization also writes the transposed payloads their backward GEMMs take, "
    "each of its compiled calls (quantization, norm and GELU backward) replaced by the "
    "Triton kernels Inductor generates for it for sm_90, each at the bytes of its buffer arguments "
    "(Inductor's own estimate, at the call's sizes). `saved MB`: the activations autograd keeps for "
    "backward (weights and the step's FP8 weight copies excluded). `compiled graphs`: the graphs Inductor compiles for those calls, what "
    "a first step from an empty cache compiles for the layers. GEMM FLOPs are 2·M·N·K by input dtype; attention is one flash-attention kernel each way "
    "(causal). The roofline prices each kernel at max(bytes / 4.8 TB/s, FLOPs / 1979 TFLOP/s for FP8 or "
    "989 TFLOP/s for BF16) on an H200; a GPT-1.3B step is 24 times the layer, without the embedding, the "
    "LM head and the optimizer. `calibrated` scales every estimate by the measured stock step (175 ms "
    "forward and backward, H200, micro-batch 4) over stock's estimate; coat's measured 532 ms was taken "
    "with its quantization as eager operations. A non-GEMM kernel is not at its minimum traffic when it "
    "is a standalone copy or cast, moves an FP32 tensor as large as the layer's input, or re-reads a "
    "tensor another non-GEMM kernel wrote in the same pass (forward or backward); a generated kernel also "
    "when it reads its compiled call's input after another kernel of the call did (a per-tensor amax, "
    "then the cast). The weights' FP8 quantization is counted once per layer (one "
    "micro-batch per step)."
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.kernel_audit.census", description=__doc__.split("\n\n")[0])
    parser.add_argument("--top", type=int, default=20, help="non-minimal kernel groups listed per census (default 20)")
    parser.add_argument("--markdown", type=Path, metavar="PATH", help="also write the tables as a stamped result file")
    args = parser.parse_args(argv)
    if args.top < 1:
        raise SystemExit(f"--top must be at least 1, got {args.top}")
    from benchmarks.report import markdown_table, write_result

    rows, details, roofline, summaries = [], [], None, {}
    for shape_name in ("gpt_1.3b", "tiny"):
        counted = censuses(SHAPES[shape_name])
        kernels = {key: value[0] for key, value in counted.items()}
        summaries = {key: value[1] for key, value in counted.items()}
        if shape_name == "gpt_1.3b":
            roofline = estimate(summaries)
            gpt_summaries = summaries
        rows += [summary_row(shape_name, key, summaries[key], roofline if shape_name == "gpt_1.3b" else None)
                 for key in COUNTS]
        if shape_name == "gpt_1.3b":
            for key in COUNTS:
                details.append(f"#### GPT-1.3B, {key[0]}, {key[1]} count: the non-minimal kernels by bytes (top {args.top})"
                               "\n\n" + markdown_table(NON_MINIMAL_HEADER, non_minimal_rows(kernels[key], args.top)))
    speedup = roofline.step_ms[COUNTS[0]] / roofline.step_ms[COUNTS[2]]
    verdict = (
        f"GPT-1.3B: coat's calibrated eager estimate is {roofline.calibrated_ms(COUNTS[1]):.0f} ms against "
        f"{MEASURED_STEP_MS['coat']:g} ms measured; the {MEASURED_STEP_MS['coat'] - roofline.calibrated_ms(COUNTS[1]):.0f} ms "
        f"left are {1e6 * roofline.unexplained_ms_per_launch(gpt_summaries) / 1e3:.0f} µs per launch coat adds over stock. "
        f"With its compiled calls as Inductor generates them for sm_90 (compiled), coat's roofline is {speedup:.3f}x "
        f"stock's tokens/s; coat keeps {gpt_summaries[COUNTS[1]].saved / gpt_summaries[COUNTS[0]].saved:.2f}x "
        "stock's activation bytes for backward."
    )
    print(markdown_table(SUMMARY_HEADER, rows))
    print("\n" + verdict)
    for detail in details:
        print("\n" + detail)
    if args.markdown:
        write_result(args.markdown, "Traffic census of one transformer layer: COAT's FP8 layers against stock BF16",
                     SUMMARY_HEADER, rows, [LEGEND, verdict, *details])
    return 0


if __name__ == "__main__":
    sys.exit(main())
