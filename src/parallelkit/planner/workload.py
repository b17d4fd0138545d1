"""What the planner plans for, from the composed config alone: the model's shape, the batch, the precision.

No corpus is read and no model is built for the known models (``model=gpt``, ``model=moe_gpt``, ``model=hf``):
their parameter counts, the part tensor parallelism splits and the GEMM shapes follow from the config's sizes
(:mod:`parallelkit.planner.shapes`, checked against the real modules in ``tests/unit/test_planner_workload.py``).
Only a model of the user's own package is built once, on the meta device.

- **vocabulary**: a transformers config's ``vocab_size`` (``model.config`` / ``model.pretrained``); else
  ``model.vocab_size`` when the config sets it (``+model.vocab_size=51200``: the model's real vocabulary, no
  tokenizer needed); else the data module's (instantiated, never configured: no windows are cut).
- **sequence length and batch**: ``data.seq_len`` and ``data.global_batch_size`` as written.
- **precision** (:data:`PRECISIONS`): ``trainer.precision`` / ``callbacks=[amp]`` for parallelkit's own runs; the
  published runs name theirs (bf16 weights with fp32 master weights and optimizer state).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from parallelkit.errors import ConfigError
from parallelkit.planner.shapes import ModelShape, shape_from_config


@dataclass(frozen=True)
class Precision:
    """Bytes per element of each thing a rank holds or moves.

    Args:
        param / grad: the working weights and their gradients (as reduced between ranks).
        master: an fp32 copy beside low-precision weights (0: the weights are the master copy).
        state: one optimizer slot (Adam's two moments: 2 slots).
        activation: saved activations and the tensors tensor/pipeline parallelism send.
        compute: which matmul rate applies (``fp32`` or ``bf16``).
    """

    name: str
    param: int
    grad: int
    master: int
    state: int
    activation: int
    compute: str

    def model_state(self, slots: int) -> int:
        """Bytes per parameter of the whole model state (the ZeRO paper's 16 for mixed-precision Adam)."""
        return self.param + self.grad + self.master + slots * self.state


PRECISIONS: dict[str, Precision] = {
    # Everything fp32 (trainer.precision=32-true).
    "fp32": Precision("fp32", 4, 4, 0, 4, 4, "fp32"),
    # torch autocast (Lightning's bf16-mixed / 16-mixed, parallelkit's amp callback): the fp32 weights are the
    # master copy, matmuls and most saved activations are 16-bit.
    "amp": Precision("amp", 4, 4, 0, 4, 2, "bf16"),
    # Megatron / DeepSpeed mixed precision as the ZeRO paper counts it (Rajbhandari et al. 2020, §3.1): 16-bit
    # weights and gradients, fp32 master weights and Adam moments — 2 + 2 + 12 = 16 bytes per parameter.
    "mixed": Precision("mixed", 2, 2, 4, 4, 2, "bf16"),
    # bf16 weights with fp32 gradient accumulation and reduction (Megatron's bf16 default, Llama 3 §3.3.2):
    # 2 + 4 + 12 = 18 bytes per parameter (Megatron-LM docs/distrib_optimizer.md).
    "mixed_fp32_grads": Precision("mixed_fp32_grads", 2, 4, 4, 4, 2, "bf16"),
    # Everything bf16 (trainer.precision=bf16-true).
    "bf16": Precision("bf16", 2, 2, 0, 2, 2, "bf16"),
}
TRAINER_PRECISION = {"32-true": "fp32", "32": "fp32", "bf16-mixed": "amp", "16-mixed": "amp", "bf16": "amp",
                     "16": "amp", "bf16-true": "bf16"}
RECOMPUTE = ("none", "selective", "selective_op", "full")
ATTENTION = ("flash", "dense")


@dataclass(frozen=True)
class Runtime:
    """How the training code overlaps communication with compute (a property of the implementation).

    Args:
        overlap_dp: the data-parallel gradient all-reduce runs during backward (DDP buckets) rather than after it.
            parallelkit's ``GradAllReduce`` (hybrid4d without sharding) averages after the last backward: no.
        overlap_sharding: ZeRO-3/FSDP all-gathers are prefetched and reduce-scatters run during backward
            (FSDP2 does both).
        p2p_scatter_gather: pipeline sends carry ``1/tp`` of the activations (Megatron's scatter/gather); without
            it hybrid4d sends the whole replicated activation from every tp rank — unless the layout is sequence
            parallel, whose stage outputs are sequence shards (``Layout.sequence_parallel``: ``1/tp`` either way).
        async_p2p: pipeline sends and receives run asynchronously, behind the next chunk's compute (Llama 3,
            arXiv:2407.21783, §3.3.2): only what exceeds that compute is exposed. Default: on the critical path.
        deallocate_stage_outputs: a stage frees its output once sent, keeping only what backward needs
            (Megatron-LM's ``deallocate_pipeline_outputs``; Llama 3 §3.3.2); ``torch.distributed.pipelining``
            keeps each chunk's output until its backward: no.
        unfused_elementwise: norms, rotary embeddings, repeated key/value heads and the activation function run op by op
            in eager PyTorch, as the model code writes them (torchtitan's Llama without ``torch.compile``;
            :mod:`~parallelkit.planner.eager_ops`). Default: fused, each step reading its input and writing its output
            once.
    """

    overlap_dp: bool = False
    overlap_sharding: bool = True
    p2p_scatter_gather: bool = False
    async_p2p: bool = False
    deallocate_stage_outputs: bool = False
    unfused_elementwise: bool = False


PARALLELKIT_RUNTIME = Runtime()


@dataclass(frozen=True)
class Workload:
    """One training step's work: the model, the global batch and how it is computed.

    Args:
        shape: the model (:class:`~parallelkit.planner.shapes.ModelShape`).
        seq_len: tokens per sequence.
        global_batch: sequences per optimizer step (all ranks together).
        per_rank_batch: instead of ``global_batch``, sequences per data-parallel rank (data.per_device_batch_size).
        precision: a :data:`PRECISIONS` entry.
        recompute: ``none``, ``selective`` (Korthikanti et al.: the attention core recomputed), ``selective_op``
            (torchtitan's selective op checkpointing: :mod:`~parallelkit.planner.selective_op`) or ``full`` (each
            layer recomputed).
        optimizer_slots: fp32 tensors of optimizer state per parameter (Adam 2, SGD 1).
        optimizer: the optimizer's class (``optim.optimizer._target_``): what ``--calibrate`` times a step of.
        optimizer_kwargs: its configured arguments (``optim.optimizer`` less Hydra's keys), as ``(name, value)`` pairs.
        attention: ``flash`` (fused: no score matrix saved, causal half of the scores computed) or ``dense``.
        accumulate: ``trainer.accumulate_grad_batches`` as configured (the search may pick others; see
            :mod:`parallelkit.planner.search`).
        runtime: the implementation's overlap (:class:`Runtime`).
    """

    shape: ModelShape
    seq_len: int
    global_batch: int | None
    precision: Precision
    recompute: str = "none"
    optimizer_slots: int = 2
    optimizer: str = "torch.optim.AdamW"
    optimizer_kwargs: tuple[tuple[str, Any], ...] = ()
    attention: str = "flash"
    per_rank_batch: int | None = None
    accumulate: int = 1
    runtime: Runtime = field(default_factory=Runtime)

    def __post_init__(self) -> None:
        if self.recompute not in RECOMPUTE:
            raise ConfigError(f"recompute={self.recompute!r} is not one of {', '.join(RECOMPUTE)}.")
        if self.attention not in ATTENTION:
            raise ConfigError(f"attention={self.attention!r} is not one of {', '.join(ATTENTION)}.")
        for name in ("seq_len", "optimizer_slots", "accumulate"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} should be an int greater than 0. Got {value!r}.")
        if (self.global_batch is None) == (self.per_rank_batch is None):
            raise ConfigError("Set exactly one of data.global_batch_size and data.per_device_batch_size to plan a run.")

    @property
    def num_params(self) -> int:
        return self.shape.num_params

    def with_(self, **changes: Any) -> Workload:
        return replace(self, **changes)


# ------------------------------------------------------------------------------------ from the config
def precision_from_config(cfg: Any) -> Precision:
    """parallelkit's own precision for the run: the amp callback, else ``trainer.precision``."""
    callbacks = cfg.get("callbacks") or {}
    if "amp" in callbacks:
        return PRECISIONS["amp"]
    value = str(cfg.trainer.get("precision", "32-true"))
    if value not in TRAINER_PRECISION:
        raise ConfigError(f"trainer.precision={value} is not one the planner knows ({', '.join(TRAINER_PRECISION)}).")
    return PRECISIONS[TRAINER_PRECISION[value]]


def optimizer_slots(optim_target: str) -> int:
    """fp32 tensors of optimizer state per parameter element: Adam(W) 2 (both moments), SGD 1 (momentum)."""
    name = optim_target.rsplit(".", 1)[-1].lower()
    return 2 if "adam" in name else 1


def workload_from_config(cfg: Any, *, datamodule: Any = None, runtime: Runtime = PARALLELKIT_RUNTIME) -> Workload:
    """The :class:`Workload` the composed ``train`` config describes (see the module docstring).

    ``datamodule``: an already instantiated data module (``strategy=auto`` at launch has one); without it the
    data module is instantiated only if nothing else gives the vocabulary.
    """
    data = cfg.data
    seq_len = data.get("seq_len")
    if seq_len is None:
        if datamodule is None:
            from hydra.utils import instantiate

            datamodule = instantiate(data)
        seq_len = datamodule.model_kwargs().get("block_size")
    if not isinstance(seq_len, int) or seq_len < 1:
        raise ConfigError(f"The planner needs a sequence length (data.seq_len); got {seq_len!r}.")

    def vocab_from_data() -> int:
        nonlocal datamodule
        if datamodule is None:
            from hydra.utils import instantiate

            datamodule = instantiate(data)
        if getattr(datamodule, "train_set", False) is None and callable(getattr(datamodule, "build", None)):
            datamodule.build()  # the vocabulary of a corpus: read it, without cutting the batch (no configure)
        vocab = datamodule.model_kwargs().get("vocab_size")
        if not vocab:
            raise ConfigError(f"model={cfg.model._target_} needs a vocabulary: set +model.vocab_size=N, or use a data module that has one.")
        return int(vocab)

    shape = shape_from_config(cfg.model, seq_len, vocab_from_data, datamodule_kwargs=lambda: _data_kwargs(cfg, datamodule))
    accumulate = cfg.trainer.get("accumulate_grad_batches", 1) or 1
    return Workload(
        shape=shape, seq_len=seq_len, global_batch=data.get("global_batch_size"), per_rank_batch=data.get("per_device_batch_size"),
        precision=precision_from_config(cfg), recompute=str(cfg.get("recompute", "none")),
        optimizer_slots=optimizer_slots(cfg.optim.optimizer._target_), optimizer=str(cfg.optim.optimizer._target_),
        optimizer_kwargs=optimizer_kwargs(cfg.optim.optimizer), accumulate=int(accumulate), runtime=runtime,
    )


def optimizer_kwargs(optimizer_cfg: Any) -> tuple[tuple[str, Any], ...]:
    """The arguments ``optim.optimizer`` gives its class besides the parameters, hashable (lists as tuples)."""
    from omegaconf import OmegaConf

    values = OmegaConf.to_container(optimizer_cfg, resolve=True) if OmegaConf.is_config(optimizer_cfg) else dict(optimizer_cfg)
    return tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in values.items() if not k.startswith("_"))


def _data_kwargs(cfg: Any, datamodule: Any) -> dict[str, Any]:
    if datamodule is None:
        from hydra.utils import instantiate

        datamodule = instantiate(cfg.data)
    return datamodule.model_kwargs()
