"""The typed schema of ``lowprec-train``'s Hydra config, and the checks that run before any work.

Hydra merges ``configs/train.yaml`` and one file per group (``model/``, ``precision/``,
``optimizer/``, ``data/``, ``trainer/``, ``logging/``, and ``baseline/`` where one is chosen) onto
:class:`TrainConfig`, so a misspelt or unknown key is an error that names the node and its valid
keys. Earlier spellings of renamed keys and values (:data:`RENAMED_KEYS`, :data:`RENAMED_VALUES`)
are still accepted with a warning (:func:`adopt_renamed_spellings`). :func:`validate` then checks the values that depend on each
other (parallel layout, batch sizes, option names) before a process group, a model or a dataset
exists.
"""

from __future__ import annotations

import importlib.util
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from megatron_lowprec.data.tokenizer import BYTE_BPE_FILE, TOKENIZER_KINDS
from megatron_lowprec.layers.settings import LayerPrecision, layer_precision_of
from megatron_lowprec.optim.settings import OptimizerPrecision, SettingError
from megatron_lowprec.optim.strategies import PrecisionStrategy, get_strategy

NORMALIZATIONS = ("LayerNorm", "RMSNorm")
ACTIVATIONS = ("gelu", "swiglu")
POSITION_EMBEDDINGS = ("learned_absolute", "rope")
TRANSFORMER_IMPLS = ("local", "transformer_engine")
ATTENTION_BACKENDS = ("auto", "sdpa", "unfused", "te")
DATA_KINDS = ("embedded", "indexed")
LR_DECAY_STYLES = ("cosine", "linear", "constant")
OPTIMIZERS = ("adamw", "muon")
MUON_SCALE_MODES = ("spectral", "shape_scaling", "unit_rms_norm")
MUON_TP_MODES = ("blockwise", "duplicated")
MUON_COEFFICIENT_TYPES = ("simple", "quintic")
TE_FP8_RECIPES = ("delayed", "tensorwise")
EXIT_SIGNALS = ("SIGUSR1", "SIGUSR2", "SIGHUP", "SIGQUIT", "SIGTERM")


@dataclass
class ModelConfig:
    """A megatron-core ``GPTModel`` (``TransformerConfig`` plus the model's own arguments)."""

    name: str = "tiny"
    """Label used in run names and summaries."""
    num_layers: int = 2
    """Transformer layers."""
    hidden_size: int = 64
    """Model width."""
    num_attention_heads: int = 4
    """Attention heads; must be divisible by the tensor-parallel size."""
    num_query_groups: Optional[int] = None
    """Grouped-query attention groups (``None``: multi-head attention)."""
    ffn_hidden_size: Optional[int] = None
    """MLP width (``None``: 4 x hidden_size, megatron's default)."""
    seq_length: int = 64
    """Tokens per training sequence."""
    max_position_embeddings: Optional[int] = None
    """Positions of learned embeddings (``None``: seq_length)."""
    vocab_size: Optional[int] = None
    """Vocabulary size (``None``: the tokenizer's), padded to ``make_vocab_size_divisible_by x TP``."""
    make_vocab_size_divisible_by: int = 128
    """Padding multiple of the vocabulary, as megatron's ``--make-vocab-size-divisible-by``."""
    normalization: str = "LayerNorm"
    """``LayerNorm`` (GPT) or ``RMSNorm`` (LLaMA)."""
    activation: str = "gelu"
    """MLP activation: ``gelu`` (GPT) or ``swiglu`` (LLaMA, a gated linear unit)."""
    position_embedding_type: str = "rope"
    """``rope`` (rotary, the papers' choice) or ``learned_absolute``."""
    rotary_percent: float = 1.0
    """Fraction of each head's dimensions that rotary embeddings rotate."""
    rotary_base: int = 10000
    """Rotary base frequency."""
    untie_embeddings_and_output_weights: bool = True
    """Separate input embedding and LM head (Collage App. E.2: untied)."""
    add_bias_linear: bool = True
    """Biases in the linear layers (GPT: yes, LLaMA: no)."""
    hidden_dropout: float = 0.0
    """Dropout after attention and MLP."""
    attention_dropout: float = 0.0
    """Dropout on attention probabilities."""
    init_method_std: float = 0.02
    """Standard deviation of the normal weight initialisation."""
    layernorm_epsilon: float = 1.0e-5
    """Epsilon of the normalisation layers."""
    transformer_impl: str = "local"
    """``local`` (megatron's plain-torch layer spec) or ``transformer_engine`` (needs TE)."""
    use_cpu_initialization: bool = True
    """Initialise each weight whole on the CPU and keep this rank's shard (megatron's
    ``use_cpu_initialization``), so that every TP/PP layout starts from the same weights; the model
    then moves to the GPU. ``false``: each rank initialises its shards on the GPU from its own
    tensor-parallel RNG stream (faster start for large models; the weights depend on the layout)."""
    attention_backend: str = "auto"
    """Core attention: ``sdpa`` (PyTorch's scaled_dot_product_attention: flash, memory-efficient or
    cuDNN kernels on GPUs), ``unfused`` (megatron's DotProductAttention, the seq x seq scores in
    memory), ``te`` (Transformer Engine's, needs TE); ``auto``: ``te`` in TE's layer spec, else ``sdpa``."""


@dataclass
class PrecisionConfig(LayerPrecision, OptimizerPrecision):
    """The precision option (one registry entry of :mod:`megatron_lowprec.optim.strategies`): its
    optimizer's settings (:class:`~megatron_lowprec.optim.settings.OptimizerPrecision`, which
    Megatron-LM's flags and ``build_optimizer`` take too), the layers'
    (:class:`~megatron_lowprec.layers.settings.LayerPrecision`, which Megatron-LM's layer flags and
    ``apply_layer_precision`` take too) and the gradient buffer's."""

    grad_reduce_in_fp32: Optional[bool] = None
    """Keep megatron-core's DDP gradient buffer in FP32: gradients accumulate over micro-batches and are
    reduced over data-parallel ranks in FP32 (megatron-core's ``grad_reduce_in_fp32``). ``None``: the
    option's own (:func:`reduces_grads_in_fp32`): FP32 for the options that keep an FP32 master, BF16
    for the others (each option's in docs/reference/options.md). FP32 costs 2 bytes per parameter
    more than BF16 (a 4-byte gradient buffer instead of a 2-byte one, counted in the reported
    bytes/param) and twice the bytes of every gradient all-reduce or reduce-scatter; BF16 rounds each
    micro-batch's accumulation and the reduction to BF16."""
    te_fp8_recipe: Optional[str] = None
    """Transformer Engine's own FP8 linears (megatron-core's ``fp8="hybrid"``) with this ``fp8_recipe``:
    ``delayed`` (DelayedScaling) or ``tensorwise`` (Float8CurrentScaling); needs Transformer Engine.
    ``baseline=te_fp8`` selects it with option D, the baseline COAT's FP8 flow is compared against."""
    megatron_optimizer: bool = False
    """Train with megatron-core's own ``get_megatron_optimizer`` instead of this package's AdamW: BF16
    parameters, FP32 main gradients and master weights, its Adam (torch's without apex/TE). The stock
    Megatron-LM path that ``baseline=megatron`` selects; it has option D's numerics, so ``option``
    must be D. With ``optimizer=muon`` it is megatron-core's own Muon (``TensorParallelMuon`` for the
    hidden weights, its Adam for the rest), where NVIDIA's emerging-optimizers imports."""
    emulate_exclude: Optional[list[str]] = None
    """Deprecated spelling of ``layers_exclude``, accepted with a warning."""

    def check(self) -> None:
        """The optimizer's settings, then the layers' with this option; :class:`SettingError` naming
        the first that cannot apply."""
        OptimizerPrecision.check(self)
        layer_precision_of(self).check(self.option)


@dataclass
class OptimizerConfig:
    """The optimizer, its hyper-parameters and the learning-rate schedule (megatron's ``OptimizerParamScheduler``)."""

    name: str = "adamw"
    """``adamw``, or ``muon``: Muon (momentum orthogonalised by Newton-Schulz) for the 2-D hidden weights
    and AdamW for the embedding, the output layer, norms and biases, both with ``precision``'s option
    (megatron-core's ``optimizer="muon"``; ``optimizer=muon`` selects the preset)."""
    lr: float = 3.0e-3
    """Peak learning rate."""
    min_lr: float = 3.0e-4
    """Learning rate at the end of the decay."""
    lr_warmup_steps: int = 20
    """Linear warmup steps from 0 to ``lr``."""
    lr_decay_steps: Optional[int] = None
    """Steps of the decay (``None``: ``trainer.max_steps``)."""
    lr_decay_style: str = "cosine"
    """``cosine``, ``linear`` or ``constant``."""
    weight_decay: float = 0.1
    """Decoupled weight decay (not applied to biases and norms)."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.95
    """Adam beta2."""
    adam_eps: float = 1.0e-8
    """Adam epsilon."""
    clip_grad: float = 1.0
    """Clip gradients to this global L2 norm (0 disables)."""
    muon_momentum: float = 0.95
    """Muon: momentum coefficient (an EMA of the gradients, as torch's and megatron-core's Muon)."""
    muon_use_nesterov: bool = True
    """Muon: Nesterov momentum (orthogonalise g + momentum x buffer)."""
    muon_num_ns_steps: int = 5
    """Muon: Newton-Schulz iterations."""
    muon_coefficient_type: str = "simple"
    """Muon: the Newton-Schulz coefficients, megatron-core's names: ``simple`` (Keller Jordan's (3.4445,
    -4.775, 2.0315) at every iteration, torch's and Moonshot's) or ``quintic`` (a triple per iteration,
    megatron-core's default)."""
    muon_scale_mode: str = "spectral"
    """Muon: the update's scale per m x n weight, megatron-core's names: ``spectral`` (√max(m, n)),
    ``shape_scaling`` (√max(1, m/n)) or ``unit_rms_norm`` (√(m/n))."""
    muon_extra_scale_factor: float = 0.2
    """Muon: a factor on that scale. ``spectral`` with 0.2 is Moonshot's 0.2·√max(m, n) (arXiv
    2502.16982), which matches AdamW's update RMS so that AdamW's ``lr`` and ``weight_decay`` carry over."""
    muon_split_qkv: bool = True
    """Muon: orthogonalise a fused QKV weight's query, key and value rows (each kind over all query
    groups) as three matrices, each with its own scale (megatron-core's ``muon_split_qkv``, on by default)."""
    muon_tp_mode: str = "blockwise"
    """Muon with tensor parallelism, megatron-core's ``muon_tp_mode``: ``blockwise`` (its default)
    orthogonalises each shard on its own, ``duplicated`` all-gathers each sharded weight and
    orthogonalises it whole on every rank (the update of the unsplit weight)."""
    use_distributed_optimizer: bool = False
    """Megatron's distributed optimizer (ZeRO-1): each data-parallel rank keeps and updates only its
    shard of every optimizer state (gradients reduce-scattered, parameters all-gathered); needs a
    data-parallel size above 1. Training is bit-identical either way. With ``name=muon`` it is
    megatron's layer-wise distributed optimizer, as Megatron-LM's ``--use-distributed-optimizer``
    with ``--optimizer muon``: each rank keeps and updates whole parameters (gradients all-reduced)."""
    # Resuming with another schedule (Megatron-LM's --override-opt_param-scheduler and
    # --use-checkpoint-opt_param-scheduler); with neither, a schedule that differs from the
    # checkpoint's (lr, min_lr, warmup, decay steps or style, weight decay) stops the run.
    override_opt_param_scheduler: bool = False
    """On resume, take this config's schedule and continue it from the checkpoint's step."""
    use_checkpoint_opt_param_scheduler: bool = False
    """On resume, keep the checkpoint's schedule and ignore this config's."""
    distributed: Optional[bool] = None
    """Deprecated spelling of ``use_distributed_optimizer``, accepted with a warning."""


@dataclass
class DataConfig:
    """Where the tokens come from."""

    kind: str = "embedded"
    """``embedded`` (the shipped corpus, prepared on first use) or ``indexed`` (prepared .bin/.idx)."""
    data_prefix: list[str] = field(default_factory=list)
    """``indexed``: prefixes written by ``lowprec-prepare-data``."""
    data_weights: Optional[list[float]] = None
    """``indexed``: blend weights of the prefixes (``None``: by size)."""
    tokenizer_type: str = "byte_bpe"
    """``indexed``: byte_bpe, gpt2_bpe or sentencepiece."""
    tokenizer_dir: Optional[str] = None
    """``byte_bpe``: directory holding tokenizer.json."""
    vocab_file: Optional[str] = None
    """``gpt2_bpe``: vocab.json."""
    merge_file: Optional[str] = None
    """``gpt2_bpe``: merges.txt."""
    sentencepiece_model: Optional[str] = None
    """``sentencepiece``: the .model file."""
    split: str = "980,10,10"
    """Train/valid/test split weights (the papers use 980:10:10)."""
    cache_dir: Optional[str] = None
    """Where the embedded corpus and dataset indices are cached (``None``: $MEGATRON_LOWPREC_CACHE, else $XDG_CACHE_HOME/megatron_lowprec, else ~/.cache/megatron_lowprec)."""


@dataclass
class TrainerConfig:
    """Parallel layout, batch sizes, and the cadence of logging, evaluation and checkpoints."""

    tensor_model_parallel_size: int = 1
    """Tensor-parallel ranks."""
    pipeline_model_parallel_size: int = 1
    """Pipeline stages; the remaining ranks are data parallel."""
    micro_batch_size: int = 4
    """Sequences per micro-batch on one data-parallel rank."""
    global_batch_size: int = 8
    """Sequences per optimizer step over all data-parallel ranks (micro-batches are accumulated)."""
    max_steps: int = 300
    """Optimizer steps to train."""
    log_interval: int = 25
    """Print and record training metrics every this many steps."""
    eval_interval: int = 100
    """Evaluate on the validation split every this many steps (and at the end)."""
    eval_iters: int = 4
    """Global batches per evaluation."""
    sharpness_interval: int = 0
    """Measure the last-token loss sharpness ("To FP8 and Back Again" §3.1) every this many steps (0: never)."""
    sharpness_eps: float = 5.0e-4
    """Half-width of the sharpness box, relative to each logit's magnitude plus one."""
    sharpness_sequences: int = 4
    """Validation sequences the sharpness is averaged over."""
    save_interval: int = 0
    """Save a checkpoint every this many steps (0: only at the end)."""
    save: bool = True
    """Save a checkpoint at the end (and at ``save_interval``)."""
    # Preemption (Megatron-LM's --exit-signal-handler): on SIGTERM or exit_signal every rank
    # finishes its step, saves a checkpoint and exits 0.
    exit_signal: Optional[str] = "SIGUSR1"
    """A signal handled like SIGTERM, e.g. the one SLURM's ``--signal`` sends before the time limit
    (SIGUSR1, SIGUSR2, SIGHUP, SIGQUIT or SIGTERM; ``null``: SIGTERM alone)."""
    max_nonfinite_steps: int = 3
    """Stop the run (exit 3, no checkpoint of the diverged state) once the loss or the gradient norm
    has been NaN or infinite for this many steps in a row (0: never stop for it)."""
    seed: int = 1234
    """Seed of initialisation, dropout, data order and stochastic rounding."""
    dry_run: bool = False
    """Print the resolved config and the plan, then exit without training."""
    deterministic: bool = False
    """Make a GPU run repeat bit for bit (``train/determinism.py``: deterministic algorithms, attention
    backward and NCCL reductions); costs attention-backward speed on GPUs."""
    profile: bool = False
    """Profile a window of steps with torch.profiler (Megatron-LM's ``--profile --use-pytorch-profiler``):
    a Chrome trace and a table of operators by time per profiled rank in ``<run_dir>/profile/``."""
    profile_step_start: int = 10
    """Steps done when profiling starts: the first profiled step is the one the log numbers this + 1."""
    profile_step_end: int = 12
    """Steps done when profiling stops: the last profiled step is the one the log numbers this."""
    profile_ranks: list[int] = field(default_factory=lambda: [0])
    """Global ranks that profile."""


@dataclass
class LoggingConfig:
    """Console, metrics file and Weights & Biases."""

    wandb: bool = True
    """Log to wandb (offline unless WANDB_MODE says otherwise)."""
    wandb_project: str = "megatron-lowprec"
    """wandb project."""
    wandb_mode: str = "offline"
    """wandb mode when WANDB_MODE is unset: offline, online or disabled."""
    metrics_file: str = "metrics.jsonl"
    """JSON-lines metrics file in the run directory (always written)."""


@dataclass
class TrainConfig:
    """The whole run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    run_dir: Optional[str] = None
    """Run directory (config, metrics, checkpoints); ``None``: ``runs/<time>-<model>-<option>``."""
    resume: Optional[bool] = None
    """``None``: resume when run_dir holds a checkpoint; ``true``: require one; ``false``: start fresh."""
    resume_allow_changes: list[str] = field(default_factory=list)
    """Keys that may differ from the checkpoint's on resume (any of ``trainer.global_batch_size``,
    ``trainer.micro_batch_size``, ``model.seq_length``, ``model.rotary_base``,
    ``model.layernorm_epsilon``); any other change of the model's architecture or batch geometry
    stops the resume (the checkpoint records them)."""
    resume_from: Optional[str] = None
    """A checkpoint directory (``<run_dir>/checkpoints/iter_<N>``, of this run or another) to resume
    from exactly: where it is damaged the run stops instead of falling back to an older one."""


ARCHITECTURE_FIELDS = (
    "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
    "max_position_embeddings", "vocab_size", "make_vocab_size_divisible_by", "normalization", "activation",
    "position_embedding_type", "rotary_percent", "rotary_base", "untie_embeddings_and_output_weights",
    "add_bias_linear", "layernorm_epsilon",
)
"""The ``model`` keys that change the parameters' shapes or what they mean."""

RESUME_CHANGEABLE = (
    "trainer.global_batch_size", "trainer.micro_batch_size", "model.seq_length", "model.rotary_base",
    "model.layernorm_epsilon",
)
"""The recorded keys that ``resume_allow_changes`` may let differ from the checkpoint's."""


def run_shape(config: "TrainConfig") -> dict[str, object]:
    """The architecture (:data:`ARCHITECTURE_FIELDS`, ``max_position_embeddings`` as in effect), the
    batch geometry and the optimizer of ``config``, by key: what a checkpoint records and a resume must match."""
    model = config.model
    shape = {f"model.{name}": getattr(model, name) for name in ARCHITECTURE_FIELDS}
    shape["model.max_position_embeddings"] = model.max_position_embeddings or model.seq_length
    shape["model.seq_length"] = model.seq_length
    shape["trainer.global_batch_size"] = config.trainer.global_batch_size
    shape["trainer.micro_batch_size"] = config.trainer.micro_batch_size
    shape["optimizer.name"] = config.optimizer.name
    return shape


class ConfigError(ValueError):
    """A config value that cannot work, named with the valid choices."""


def _choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{name}={value!r} is not valid; choose one of: {', '.join(choices)}")


def _positive(name: str, value: int) -> None:
    if value < 1:
        raise ConfigError(f"{name}={value} must be a positive integer")


STOCK_OPTIMIZER_LABEL = "megatron"
"""How runs with ``precision.megatron_optimizer`` name their option in logs, summaries and checkpoints."""


def precision_strategy(precision: PrecisionConfig) -> PrecisionStrategy:
    """The strategy of ``precision.option`` with its ``master_storage`` applied (``ValueError`` if
    it cannot apply)."""
    return precision.strategy()


def uses_fp8_layers(precision: PrecisionConfig) -> bool:
    """Whether the model runs COAT's FP8 layer flow: ``precision.fp8_layers`` if given, else the
    option's own (:meth:`~megatron_lowprec.layers.settings.LayerPrecision.uses_fp8_layers`)."""
    return precision.uses_fp8_layers(precision.option)


def reduces_grads_in_fp32(precision: PrecisionConfig) -> bool:
    """Whether DDP keeps the gradients in FP32: ``precision.grad_reduce_in_fp32`` if given, else the
    option's own (:attr:`~megatron_lowprec.optim.strategies.PrecisionStrategy.default_grad_reduce_in_fp32`)."""
    if precision.grad_reduce_in_fp32 is not None:
        return precision.grad_reduce_in_fp32
    return get_strategy(precision.option).default_grad_reduce_in_fp32


def option_label(precision: PrecisionConfig) -> str:
    """The option's canonical name, or ``megatron`` for megatron-core's own optimizer."""
    return STOCK_OPTIMIZER_LABEL if precision.megatron_optimizer else get_strategy(precision.option).name


def _validate_megatron_optimizer(precision: PrecisionConfig) -> None:
    if get_strategy(precision.option).name != "D":
        raise ConfigError(
            f"precision.megatron_optimizer=true runs megatron-core's FP32-master Adam, option D's numerics; "
            f"precision.option={precision.option!r} cannot go with it (use baseline=megatron)"
        )
    if precision.track_update_quality or precision.fused or precision.master_storage not in (None, "fp32"):
        raise ConfigError(
            "precision.track_update_quality, precision.fused and precision.master_storage belong to this package's AdamW; "
            "megatron-core's optimizer (precision.megatron_optimizer=true) has neither"
        )


def model_parallel_size(config: TrainConfig) -> int:
    """Ranks one model replica spans: tensor x pipeline parallel size."""
    return config.trainer.tensor_model_parallel_size * config.trainer.pipeline_model_parallel_size


def data_parallel_size(config: TrainConfig, world_size: int) -> int:
    """Data-parallel ranks left once tensor and pipeline parallelism take theirs."""
    model_parallel = model_parallel_size(config)
    if world_size % model_parallel:
        launch = (
            f"; launch a multiple of {model_parallel} ranks: torchrun --nproc-per-node {model_parallel} "
            f"-m megatron_lowprec.train ..., or launch/torchrun.sh --nproc-per-node {model_parallel} ..."
        )
        raise ConfigError(
            f"world size {world_size} is not divisible by tensor_model_parallel_size x "
            f"pipeline_model_parallel_size = {config.trainer.tensor_model_parallel_size} x "
            f"{config.trainer.pipeline_model_parallel_size}{launch}"
        )
    return world_size // model_parallel


def _validate_te_fp8(precision: PrecisionConfig) -> None:
    """Transformer Engine's FP8 linears: a recipe it has, installed, and no other layer flow."""
    if precision.te_fp8_recipe is not None:
        _choice("precision.te_fp8_recipe", precision.te_fp8_recipe, TE_FP8_RECIPES)
        if importlib.util.find_spec("transformer_engine") is None:
            raise ConfigError(
                "baseline=te_fp8 (precision.te_fp8_recipe) needs Transformer Engine, which is not installed; "
                "precision=coat is this package's FP8 flow without it"
            )
        if uses_fp8_layers(precision) or precision.emulate is not None:
            raise ConfigError("precision.te_fp8_recipe replaces the linear layers with TE's; drop fp8_layers/emulate")


def _megatron_muon_imports() -> bool:
    """Whether megatron-core's own Muon can run: its emerging-optimizers package imports."""
    try:
        import emerging_optimizers.orthogonalized_optimizers  # noqa: F401
    except ImportError:
        return False
    return True


def _validate_muon(config: TrainConfig) -> None:
    optimizer = config.optimizer
    _choice("optimizer.muon_scale_mode", optimizer.muon_scale_mode, MUON_SCALE_MODES)
    _choice("optimizer.muon_tp_mode", optimizer.muon_tp_mode, MUON_TP_MODES)
    _choice("optimizer.muon_coefficient_type", optimizer.muon_coefficient_type, MUON_COEFFICIENT_TYPES)
    if not 0 <= optimizer.muon_momentum < 1 or optimizer.muon_num_ns_steps < 1 or not optimizer.muon_extra_scale_factor > 0:
        raise ConfigError(
            f"optimizer.muon_momentum={optimizer.muon_momentum} must be in [0, 1), optimizer.muon_num_ns_steps="
            f"{optimizer.muon_num_ns_steps} >= 1 and optimizer.muon_extra_scale_factor={optimizer.muon_extra_scale_factor} > 0"
        )
    refused = [
        (
            config.precision.megatron_optimizer and not _megatron_muon_imports(),
            "baseline=megatron: megatron-core's own Muon needs NVIDIA's emerging-optimizers, which does not import here "
            "(it declares Python >= 3.12; .ci/megatron_newest.sh builds a venv where it runs on 3.11)",
        ),
        (config.precision.track_update_quality, "precision.track_update_quality=true (Muon measures no update quality)"),
    ]
    for refused_setting, why in refused:
        if refused_setting:
            raise ConfigError(f"optimizer.name=muon cannot run with {why}; use optimizer=adamw")


def _validate_optimizer(optimizer: OptimizerConfig) -> None:
    checks = [
        ("lr", optimizer.lr, optimizer.lr >= 0, ">= 0"),
        ("min_lr", optimizer.min_lr, 0 <= optimizer.min_lr <= max(optimizer.lr, 0), "in [0, optimizer.lr]"),
        ("lr_warmup_steps", optimizer.lr_warmup_steps, optimizer.lr_warmup_steps >= 0, ">= 0"),
        ("weight_decay", optimizer.weight_decay, optimizer.weight_decay >= 0, ">= 0"),
        ("adam_beta1", optimizer.adam_beta1, 0 <= optimizer.adam_beta1 < 1, "in [0, 1)"),
        ("adam_beta2", optimizer.adam_beta2, 0 <= optimizer.adam_beta2 < 1, "in [0, 1)"),
        ("adam_eps", optimizer.adam_eps, optimizer.adam_eps > 0, "> 0"),
        ("clip_grad", optimizer.clip_grad, optimizer.clip_grad >= 0, ">= 0 (0 disables clipping)"),
    ]
    for name, value, valid, expected in checks:
        if not (valid and math.isfinite(value)):
            raise ConfigError(f"optimizer.{name}={value} is not valid; it must be finite and {expected}")
    if optimizer.lr_decay_steps is not None and optimizer.lr_decay_steps < 1:
        raise ConfigError(f"optimizer.lr_decay_steps={optimizer.lr_decay_steps} must be a positive integer or null")


def _validate_split(split: str) -> None:
    """``data.split``: up to three comma-separated non-negative weights (train, valid, test; missing
    ones are 0, as in Megatron-LM), with training and validation samples."""
    try:
        weights = [float(part) for part in split.split(",")]
    except ValueError:
        weights = []
    if not 1 <= len(weights) <= 3 or not all(math.isfinite(weight) and weight >= 0 for weight in weights):
        raise ConfigError(
            f"data.split={split!r} is not valid; give up to three comma-separated non-negative weights "
            "train,valid,test such as '980,10,10'"
        )
    weights += [0.0] * (3 - len(weights))
    if weights[0] <= 0 or weights[1] <= 0:
        raise ConfigError(
            f"data.split={split!r} leaves no training or no validation samples; the train and valid weights "
            "must be above 0, such as '980,10,10'"
        )


TOKENIZER_FILES = {
    "byte_bpe": ("tokenizer_dir",),
    "gpt2_bpe": ("vocab_file", "merge_file"),
    "sentencepiece": ("sentencepiece_model",),
}
"""The ``data`` keys each tokenizer type of an ``indexed`` run is loaded from."""


def _validate_indexed_data(data: DataConfig) -> None:
    """``data.kind=indexed``: the prefixes' ``.bin``/``.idx`` files and the tokenizer's files exist."""
    if not data.data_prefix:
        raise ConfigError("data.kind=indexed needs data.data_prefix (files written by lowprec-prepare-data)")
    for prefix in data.data_prefix:
        missing = [suffix for suffix in (".bin", ".idx") if not Path(prefix + suffix).is_file()]
        if missing:
            raise ConfigError(
                f"data.data_prefix entry {prefix!r} has no {' or '.join(prefix + suffix for suffix in missing)}; "
                "write them with lowprec-prepare-data"
            )
    if data.data_weights is not None and len(data.data_weights) != len(data.data_prefix):
        raise ConfigError(
            f"data.data_weights has {len(data.data_weights)} entries for {len(data.data_prefix)} data.data_prefix entries"
        )
    _choice("data.tokenizer_type", data.tokenizer_type, TOKENIZER_KINDS)
    for key in TOKENIZER_FILES[data.tokenizer_type]:
        value = getattr(data, key)
        if value is None:
            raise ConfigError(
                f"data.tokenizer_type={data.tokenizer_type} needs data.{key} "
                f"(the tokenizer the data was prepared with); set {', '.join('data.' + k for k in TOKENIZER_FILES[data.tokenizer_type])}"
            )
        path = Path(value) / BYTE_BPE_FILE if key == "tokenizer_dir" else Path(value)
        if not path.is_file():
            raise ConfigError(f"data.{key}={value!r}: {str(path)!r} does not exist")


def _validate_profile(trainer: TrainerConfig, world_size: int) -> None:
    if not 0 <= trainer.profile_step_start < min(trainer.profile_step_end, trainer.max_steps):
        raise ConfigError(
            f"trainer.profile_step_start={trainer.profile_step_start} and trainer.profile_step_end={trainer.profile_step_end} "
            f"profile no step of trainer.max_steps={trainer.max_steps}; they must satisfy "
            "0 <= profile_step_start < profile_step_end and profile_step_start < max_steps"
        )
    outside = [rank for rank in trainer.profile_ranks if not 0 <= rank < world_size]
    if outside or not trainer.profile_ranks:
        raise ConfigError(
            f"trainer.profile_ranks={list(trainer.profile_ranks)} must name ranks of this run: 0 to {world_size - 1}"
        )


RENAMED_KEYS = {
    "precision.emulate_exclude": "precision.layers_exclude",
    "optimizer.distributed": "optimizer.use_distributed_optimizer",
}
"""Earlier spellings of keys and the current ones: the Megatron-LM flag's name (``--lowprec-layers-exclude``),
megatron-core's name (``use_distributed_optimizer``)."""

RENAMED_VALUES = {"precision.te_fp8_recipe": {"current": "tensorwise"}}
"""Earlier spellings of values and the current ones: megatron-core's ``fp8_recipe`` names."""


def adopt_renamed_spellings(config: TrainConfig) -> TrainConfig:
    """``config`` with every earlier spelling of :data:`RENAMED_KEYS` and :data:`RENAMED_VALUES` it
    uses moved to the current one, each with a warning naming both."""
    for old, new in RENAMED_KEYS.items():
        (section, old_name), new_name = old.split("."), new.split(".")[1]
        node = getattr(config, section)
        if getattr(node, old_name) is not None:
            warnings.warn(f"{old} is deprecated; use {new}", FutureWarning, stacklevel=2)
            setattr(node, new_name, getattr(node, old_name))
            setattr(node, old_name, None)
    for key, renamed in RENAMED_VALUES.items():
        section, name = key.split(".")
        node = getattr(config, section)
        value = getattr(node, name)
        if value in renamed:
            warnings.warn(f"{key}={value} is deprecated; use {key}={renamed[value]}", FutureWarning, stacklevel=2)
            setattr(node, name, renamed[value])
    return config


def to_yaml(config: TrainConfig) -> str:
    """The resolved config as YAML (written to the run directory and printed by ``dry_run``), without
    the earlier spellings of :data:`RENAMED_KEYS`."""
    from omegaconf import OmegaConf

    values = OmegaConf.to_container(OmegaConf.structured(config))
    for old in RENAMED_KEYS:
        section, name = old.split(".")
        del values[section][name]
    return OmegaConf.to_yaml(values)


def validate(config: TrainConfig, world_size: int) -> None:
    """Fail fast, before any work, on a config that cannot run on ``world_size`` ranks."""
    model, trainer = config.model, config.trainer
    try:
        config.precision.check()
    except SettingError as error:
        raise ConfigError(error.spelled(lambda name: f"precision.{name}")) from None
    _choice("model.normalization", model.normalization, NORMALIZATIONS)
    _choice("model.activation", model.activation, ACTIVATIONS)
    _choice("model.position_embedding_type", model.position_embedding_type, POSITION_EMBEDDINGS)
    _choice("model.transformer_impl", model.transformer_impl, TRANSFORMER_IMPLS)
    _choice("model.attention_backend", model.attention_backend, ATTENTION_BACKENDS)
    _choice("data.kind", config.data.kind, DATA_KINDS)
    _choice("optimizer.lr_decay_style", config.optimizer.lr_decay_style, LR_DECAY_STYLES)
    _choice("optimizer.name", config.optimizer.name, OPTIMIZERS)
    if config.optimizer.name == "muon":
        _validate_muon(config)
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "micro_batch_size",
                 "global_batch_size", "log_interval", "eval_interval", "eval_iters", "sharpness_sequences"):
        _positive(f"trainer.{name}", getattr(trainer, name))
    for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length"):
        _positive(f"model.{name}", getattr(model, name))
    if trainer.sharpness_interval < 0 or trainer.sharpness_eps <= 0:
        raise ConfigError(
            f"trainer.sharpness_interval={trainer.sharpness_interval} must be >= 0 and "
            f"trainer.sharpness_eps={trainer.sharpness_eps} > 0"
        )
    _positive("trainer.max_steps", trainer.max_steps)
    if trainer.profile:
        _validate_profile(trainer, world_size)
    if trainer.max_nonfinite_steps < 0:
        raise ConfigError(
            f"trainer.max_nonfinite_steps={trainer.max_nonfinite_steps} is not valid; it must be a positive integer, or 0 never to stop"
        )
    if trainer.save_interval < 0:
        raise ConfigError(
            f"trainer.save_interval={trainer.save_interval} is not valid; it must be a positive integer, or 0 to save at the end only"
        )
    if model.max_position_embeddings is not None:
        _positive("model.max_position_embeddings", model.max_position_embeddings)
        if model.seq_length > model.max_position_embeddings:
            raise ConfigError(
                f"model.seq_length={model.seq_length} is above model.max_position_embeddings={model.max_position_embeddings}, "
                "the positions the model embeds; set model.seq_length <= max_position_embeddings (or max_position_embeddings=null)"
            )
    _validate_split(config.data.split)
    tp, pp = trainer.tensor_model_parallel_size, trainer.pipeline_model_parallel_size
    if model.num_attention_heads % tp:
        raise ConfigError(
            f"model.num_attention_heads={model.num_attention_heads} is not divisible by "
            f"trainer.tensor_model_parallel_size={tp}"
        )
    if model.num_query_groups is not None and model.num_query_groups % tp:
        raise ConfigError(
            f"model.num_query_groups={model.num_query_groups} is not divisible by "
            f"trainer.tensor_model_parallel_size={tp}"
        )
    if model.hidden_size % model.num_attention_heads:
        raise ConfigError(
            f"model.hidden_size={model.hidden_size} is not divisible by "
            f"model.num_attention_heads={model.num_attention_heads}"
        )
    if model.num_layers % pp:
        raise ConfigError(
            f"model.num_layers={model.num_layers} is not divisible by trainer.pipeline_model_parallel_size={pp}"
        )
    dp = data_parallel_size(config, world_size)
    if trainer.global_batch_size % (trainer.micro_batch_size * dp):
        raise ConfigError(
            f"trainer.global_batch_size={trainer.global_batch_size} is not divisible by "
            f"trainer.micro_batch_size x data-parallel size = {trainer.micro_batch_size} x {dp}"
        )
    if model.transformer_impl == "transformer_engine" and importlib.util.find_spec("transformer_engine") is None:
        raise ConfigError(
            "model.transformer_impl=transformer_engine needs Transformer Engine, which is not installed; "
            "use model.transformer_impl=local"
        )
    if model.attention_backend == "te" and importlib.util.find_spec("transformer_engine") is None:
        raise ConfigError(
            "model.attention_backend=te needs Transformer Engine, which is not installed; "
            "use model.attention_backend=sdpa (or auto)"
        )
    if config.optimizer.use_distributed_optimizer:
        if dp == 1:
            raise ConfigError(
                f"optimizer.use_distributed_optimizer=true shards the optimizer state over the data-parallel ranks, but "
                f"{world_size} rank(s) at TP {tp} x PP {pp} leave a data-parallel size of 1; "
                "set optimizer.use_distributed_optimizer=false or launch more ranks"
            )
        if not config.precision.shared_randomness:
            raise ConfigError(
                "optimizer.use_distributed_optimizer=true updates each element on one rank only, so replicas cannot drift; "
                "precision.shared_randomness=false needs optimizer.use_distributed_optimizer=false"
            )
    _validate_te_fp8(config.precision)
    _validate_optimizer(config.optimizer)
    if config.data.kind == "indexed":
        _validate_indexed_data(config.data)
    if config.precision.megatron_optimizer:
        _validate_megatron_optimizer(config.precision)
    if config.resume and config.run_dir is None:
        raise ConfigError("resume=true needs run_dir=<the directory of the run to resume>")
    _validate_fault_handling(config)


def _validate_fault_handling(config: TrainConfig) -> None:
    """The exit signal, the schedule choice on resume, ``resume_allow_changes`` and ``resume_from``."""
    if config.trainer.exit_signal is not None:
        _choice("trainer.exit_signal", config.trainer.exit_signal, EXIT_SIGNALS)
    if config.optimizer.override_opt_param_scheduler and config.optimizer.use_checkpoint_opt_param_scheduler:
        raise ConfigError(
            "optimizer.override_opt_param_scheduler=true (take the config's schedule) and "
            "optimizer.use_checkpoint_opt_param_scheduler=true (keep the checkpoint's) contradict each other; set one"
        )
    for key in config.resume_allow_changes:
        _choice("resume_allow_changes entry", key, RESUME_CHANGEABLE)
    if config.resume_from is not None and config.resume is False:
        raise ConfigError(f"resume_from={config.resume_from!r} and resume=false contradict each other; drop one")
