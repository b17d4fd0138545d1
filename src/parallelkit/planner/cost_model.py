"""Seconds of one optimizer step of a layout on a machine, term by term.

- **compute** per layer and micro-batch: every GEMM at its per-rank shape (``tp`` splits heads and MLP columns;
  ``b·s`` rows) timed by the profile's roofline (:meth:`Hardware.gemm_time`: matmul efficiency falls for small or
  thin GEMMs), backward = twice the forward GEMMs, plus the memory-bound work (norms, activation functions,
  softmax, residuals, dropout: the bytes they read and write at the memory bandwidth, backward twice forward; op by
  op where the runtime runs them unfused, ``Runtime.unfused_elementwise``: :mod:`~parallelkit.planner.eager_ops`).
  ``recompute=full`` runs each layer's forward again before its backward (its tp collectives too);
  ``selective`` the attention core (dense attention; fused attention recomputes nothing extra); ``selective_op``
  torchtitan's policy: every second matmul of the block and its memory-bound forward (:mod:`.selective_op`). The last stage
  adds the output layer and the loss, the first the embedding.
- **tensor parallel**: 2 all-reduces forward and 2 backward per layer on the activations (sequence parallel: each
  a reduce-scatter + an all-gather, the same bytes on NCCL, timed as the profile times those two operations),
  exposed (DTensor runs them in line); the vocabulary-parallel embedding and loss add one
  all-reduce of the activations and three small ones of the logits' statistics. **Sequence parallel** also runs the
  norms, residual adds and dropouts on a ``1/tp`` shard of the sequence (their memory-bound time ÷ tp), and once per
  step sums the partial gradients of the parameters tensor parallelism leaves whole (norms, row-parallel biases)
  over ``tp`` (Megatron-LM's ``_allreduce_layernorm_grads``; parallelkit's ``TensorParallel.sync``).
- **expert parallel**: dispatch and combine all-to-alls, forward and backward, ``top_k`` copies of each token.
- **pipeline**: ``m·T_max + (p − 1)/v·T_avg`` for per-micro-batch stage times ``T`` (Narayanan et al. 2021,
  §2.2: bubble ``(p − 1)/m``, interleaved ``(p − 1)/(v·m)``); zero-bubble schedules a third of that bubble
  (ZB-H1, Qi et al. 2023, with equal F, B, W times); point-to-point sends of ``b·s·h`` activations per stage
  boundary and direction at the run's activation precision (``/tp`` with scatter/gather or sequence parallel), on
  the critical path — with ``Runtime.async_p2p`` (Llama 3
  §3.3.2) only the pipeline's fill and drain wait on them (the bubble keeps them); in the steady state they run
  behind the compute, exposed as the overlapped collectives below. **Tied embeddings** under a pipeline: the first
  and the last stage each hold the embedding and sum its gradient once per step, after the pipeline's last backward
  (Megatron's embedding group: one all-reduce of ``V·h/tp`` gradients between two ranks).
- **context parallel** (``cp``): each rank runs ``s/cp`` tokens of every sequence (GEMM rows, memory-bound work, tp
  collectives, pipeline sends and the head all ÷ cp); ring attention computes ``2·cp`` blocks of ``(s/2cp)²``
  (``2·cp + 1`` for dense kernels); its hops or all-to-alls: :mod:`~parallelkit.planner.cost_context_parallel`.
- **data parallel and sharding**: :mod:`~parallelkit.planner.cost_gradients` (the all-reduce, FSDP's gathers and
  reduce-scatters). Overlap with backward is the runtime's (:class:`~parallelkit.planner.workload.Runtime`):
  overlapped communication costs only what exceeds the compute it hides behind, and at least one unit's share.
- **optimizer step**: memory-bound over the rank's (sharded) state.
- **host time**: the profile's host seconds per step, micro-batch, block and step, block and micro-batch
  (:meth:`~parallelkit.planner.hardware.Hardware.host_time`, measured by ``--calibrate``; 0 in the GPU profiles, where
  the host runs ahead of the device), for the pipeline rank holding the most blocks; on the critical path (a CPU rank's
  host is its compute) and in the shared-units bound below; plus, where measured, a pipeline's and the gradient
  all-reduce's CPU (``pp_host_overhead``, ``dp_host_overhead``).
- **DTensor dispatch**: tensor parallelism and FSDP2 run on DTensors, each operation of which costs the profile's
  ``dtensor_op_overhead`` on the host: per tp layer and micro-batch its 6 split linears × (1 forward + 2 backward)
  × 2 (the matmul and its redistribution) = 36 (+12 under full recompute); per FSDP2 unit and micro-step 8 (the
  unshard/reshard and reduce-scatter hooks); an optimizer step of ~10 elementwise ops per parameter tensor, or
  ~10 in all where the step runs multi-tensor over one mesh's DTensors (FSDP2 without tensor parallelism or experts).
  Where the profile measured the CPU seconds tensor parallelism / FSDP2 over ``g`` ranks add per step, micro-batch and
  block and micro-batch (``Hardware.parallel_host_time``, ``--calibrate`` on CPU: tiny GPTs under hybrid4d), that figure replaces
  the op count (× micro-batches for tp; × micro-steps for FSDP2 without a pipeline, once per step with one).
- **compute scale**: every compute term × the profile's ``compute_scale`` (a block's kernels measured in a training
  step over the roofline above; 1 in the GPU profiles).
- **shared compute units**: when a node has fewer compute units than ranks (CPU processes on fewer cores) the step
  takes at least the node's total compute divided by its units (idle pipeline ranks leave theirs to the others).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from parallelkit.distributed.parallel_dims import CP, DP, EP, PP, SHARDING, TP
from parallelkit.planner.cost_context_parallel import context_parallel_time, kv_local_bytes
from parallelkit.planner.cost_gradients import data_parallel_time, finalize_grads_time, fsdp_copy_out_time
from parallelkit.planner.eager_ops import EAGER_KERNELS, eager_block_bytes
from parallelkit.planner.hardware import Hardware
from parallelkit.planner.layout import Layout, Stages, crosses_nodes, group_crosses_nodes, members_per_node
from parallelkit.planner.memory import RankMemory
from parallelkit.planner.selective_op import recomputed_matmuls
from parallelkit.planner.workload import Workload

COMM_AXES = (DP, SHARDING, CP, TP, PP, EP)
INLINE_AXES = (CP, TP, EP, PP)  # per micro-batch, on the critical path (cp: its exposed part, computed per layer)


@dataclass
class LayerTimes:
    """Seconds of one layer for one micro-batch (compute and the exposed tp/ep communication)."""

    forward: float
    backward: float
    recompute: float
    comm_tp: float  # of which tensor-parallel communication (forward, backward, recompute)
    comm_ep: float  # of which expert-parallel all-to-alls
    flops: float  # model FLOPs (forward + backward, no recompute)
    tp_bytes: float = 0.0
    ep_bytes: float = 0.0
    comm_cp: float = 0.0  # of which context parallelism's exposed ring hops / all-to-alls
    cp_bytes: float = 0.0

    @property
    def total(self) -> float:
        return self.forward + self.backward + self.recompute


@dataclass
class StepTime:
    """The step's time terms (seconds) and what decided them."""

    compute: float = 0.0  # the pipeline's compute path incl. recompute (excl. communication)
    recompute: float = 0.0
    bubble: float = 0.0
    comm: dict[str, float] = field(default_factory=dict)  # exposed seconds per axis
    comm_bytes: dict[str, float] = field(default_factory=dict)  # bytes the busiest rank sends per step, per axis
    comm_bytes_by_rank: list[dict[str, float]] = field(default_factory=list)  # per representative pipeline rank
    crosses: dict[str, bool] = field(default_factory=dict)
    optimizer: float = 0.0
    dispatch: float = 0.0  # DTensor operations' host overhead (tp, FSDP2)
    fsdp_copy: float = 0.0  # FSDP2's all-gather copy-out on the compute stream (cost_gradients.fsdp_copy_out_time)
    host: float = 0.0  # the host's own time per step (training loop, module calls, autograd; Hardware.host_time)
    shared_units_floor: float = 0.0  # the node-sharing bound, when it decides
    total: float = 0.0
    model_flops: float = 0.0

    def as_dict(self) -> dict[str, float]:
        out = {"compute": self.compute, "recompute": self.recompute, "bubble": self.bubble, "optimizer": self.optimizer,
               "dispatch": self.dispatch, "host": self.host, "fsdp_copy": self.fsdp_copy,
               "shared_units_floor": self.shared_units_floor, "total": self.total}
        out.update({f"comm_{a}": v for a, v in self.comm.items()})
        return out


class CostModel:
    """Times layouts of one workload on one machine (caching what repeats across layouts)."""

    def __init__(self, workload: Workload, hardware: Hardware) -> None:
        self.w, self.hw = workload, hardware
        self._layers: dict[tuple, LayerTimes] = {}
        self._heads: dict[tuple, tuple[float, float, float]] = {}

    # ---------------------------------------------------------------- one layer
    def layer(self, b: int, tp: int, ep: int, moe: bool, tp_cross: bool, ep_cross: bool, sp: bool = False,
              cp: int = 1, cp_mode: str = "ring", cp_cross: bool = False) -> LayerTimes:
        key = (b, tp, ep, moe, tp_cross, ep_cross, sp, cp, cp_mode, cp_cross)
        if key not in self._layers:
            self._layers[key] = self._layer(*key)
        return self._layers[key]

    def _layer(self, b: int, tp: int, ep: int, moe: bool, tp_cross: bool, ep_cross: bool, sp: bool,
               cp: int = 1, cp_mode: str = "ring", cp_cross: bool = False) -> LayerTimes:
        w, hw, shape = self.w, self.hw, self.w.shape
        e, dtype, s = w.precision.activation, w.precision.compute, w.seq_len
        h, a, kv, d, f = shape.hidden, shape.heads, shape.kv_heads, shape.head_dim, shape.ffn
        rows = b * s / cp  # this rank's tokens
        gemm = hw.gemm_time
        # Attention projections (column-parallel q, k, v; row-parallel output), per rank.
        proj = gemm(rows, (a + 2 * kv) * d / tp, h, e, dtype) + gemm(rows, h, a * d / tp, e, dtype)
        heads = b * a / tp
        causal = 0.5 if w.attention == "flash" else 1.0  # a fused kernel skips the masked half of the scores
        if cp > 1 and cp_mode == "ring":  # 2·cp + 1 blocks of (s/2cp)², two of them diagonal (half of each: fused)
            chunk, blocks = s / (2 * cp), 2 * cp + (0 if w.attention == "flash" else 1)
            core = blocks * (gemm(chunk, chunk, d, e, dtype, heads) + gemm(chunk, d, chunk, e, dtype, heads))
        else:  # Ulysses: the whole sequence for heads / cp heads
            core = causal * (gemm(s, s, d, e, dtype, heads / cp) + gemm(s, d, s, e, dtype, heads / cp))
        if moe:  # router, then each token's top_k experts (whole on every tp rank, spread over ep)
            tokens = rows * shape.top_k
            per_expert = tokens * ep / shape.experts
            mats = 3 if shape.gated else 2
            mlp = gemm(rows, shape.experts, h, e, dtype)
            mlp += (shape.experts / ep) * ((mats - 1) * gemm(per_expert, f, h, e, dtype) + gemm(per_expert, h, f, e, dtype))
            ffn_width, mlp_rows = f, tokens
        else:
            mats = 3 if shape.gated else 2
            mlp = (mats - 1) * gemm(rows, f / tp, h, e, dtype) + gemm(rows, h, f / tp, e, dtype)
            ffn_width, mlp_rows = f / tp, rows
        # Memory-bound work of the forward, bytes read + written: 2 norms, 2 residual adds, the activation
        # function, attention softmax (dense) or nothing extra (fused), dropout where there is dropout.
        sbh = rows * h
        replicated = 2 * 2 * e * sbh + 2 * 3 * e * sbh + (2 * 3 * e * sbh if shape.dropout else 0)
        # Sequence parallelism runs the norms, residual adds and dropouts on a 1/tp shard of the sequence (Korthikanti
        # et al. 2022, §4.2.2): their bytes ÷ tp. Without it every tp rank runs them on the whole sequence.
        mem = replicated / (tp if sp else 1)
        mem += (3 if shape.gated else 2) * e * mlp_rows * ffn_width
        if w.attention == "dense":
            mem += 2 * e * s * s * b * a / tp / cp * (2 if shape.dropout else 1)
        if shape.family.startswith("hf:") and shape.gated:  # rotary embeddings on q and k
            mem += 2 * e * rows * (a + kv) * d / tp
        kernels = 14 + (2 * shape.experts / max(ep, 1) if moe else 0)
        if w.runtime.unfused_elementwise:  # op by op, as eager model code runs it (eager_ops.py)
            mem += eager_block_bytes(shape, e, rows, tp, sp, mlp_rows, ffn_width) - replicated / (tp if sp else 1)
            mem -= (3 if shape.gated else 2) * e * mlp_rows * ffn_width  # the fused activation function and rotary
            mem -= 2 * e * rows * (a + kv) * d / tp if shape.family.startswith("hf:") and shape.gated else 0.0
            kernels += EAGER_KERNELS - 14
        elementwise = hw.memory_time(mem, kernels)
        forward = proj + core + mlp + elementwise
        backward = 2 * (proj + core + mlp) + 2 * elementwise
        # Tensor parallel: 2 all-reduces of the activations forward, 2 backward (exposed).
        act = e * sbh
        if tp > 1 and sp:  # each all-reduce becomes a reduce-scatter + an all-gather (the same bytes on NCCL's ring)
            tp_one = hw.collective_time("reduce_scatter", act, tp, tp_cross) + hw.collective_time("all_gather", act, tp, tp_cross)
        else:
            tp_one = hw.collective_time("all_reduce", act, tp, tp_cross) if tp > 1 else 0.0
        tp_bytes = 4 * act * 2 * (tp - 1) / tp if tp > 1 else 0.0
        ep_one = hw.collective_time("all_to_all", act * shape.top_k, ep, ep_cross) if (moe and ep > 1) else 0.0
        ep_bytes = 4 * act * shape.top_k * (ep - 1) / ep if (moe and ep > 1) else 0.0
        cp_f, cp_b, cp_bytes_f, cp_bytes_b = context_parallel_time(w, hw, b, tp, cp, cp_mode, cp_cross, core)
        comm_f, comm_b = 2 * tp_one + 2 * ep_one + cp_f, 2 * tp_one + 2 * ep_one + cp_b
        recompute = 0.0
        passes = 2  # forward and backward; full recompute runs the forward's collectives once more
        if w.recompute == "full":
            recompute = forward + comm_f
            passes = 3
        elif w.recompute == "selective" and w.attention == "dense":
            recompute = core + hw.memory_time(2 * e * s * s * b * a / tp / cp, 2)
        elif w.recompute == "selective_op":  # every second matmul and the memory-bound forward (selective_op.py)
            matmuls = recomputed_matmuls(shape, tp, moe)
            recompute = sum(gemm(rows * per_token, out, width, e, dtype) for per_token, out, width in matmuls) + elementwise
            if w.attention == "dense" and not (cp > 1 and cp_mode == "ring"):  # the math kernel's scores are not saved
                recompute += core
        flops = 3 * 2 * rows * (((a + 2 * kv) * d * h + a * d * h) / tp + (mats * f * h * (shape.top_k if moe else 1)) / (1 if moe else tp))
        flops += 3 * 2 * 2 * causal * s * s * d * heads / cp
        return LayerTimes(forward + comm_f, backward + comm_b, recompute, passes * 2 * tp_one, passes * 2 * ep_one, flops,
                          tp_bytes * passes / 2, ep_bytes * passes / 2, comm_cp=cp_f * (passes - 1) + cp_b,
                          cp_bytes=cp_bytes_f * (passes - 1) + cp_bytes_b)

    def kv_local_bytes(self, b: int, tp: int, cp: int) -> float:
        """``|k_local|`` (:func:`~parallelkit.planner.cost_context_parallel.kv_local_bytes`)."""
        return kv_local_bytes(self.w, b, tp, cp)

    def head(self, b: int, tp: int, tp_cross: bool, cp: int = 1) -> tuple[float, float, float]:
        """(forward + backward seconds, exposed tp seconds, FLOPs) of the output layer and the loss (``s/cp`` tokens)."""
        key = (b, tp, tp_cross, cp)
        if key not in self._heads:
            w, hw = self.w, self.hw
            e, dtype, rows, v = w.precision.activation, w.precision.compute, b * w.seq_len / cp, w.shape.vocab / tp
            gemm = hw.gemm_time(rows, v, w.shape.hidden, e, dtype)
            loss = hw.memory_time(rows * v * (e + 3 * 4) * 2, 6)  # logits → fp32 softmax → gradient, read and written
            comm = 0.0
            if tp > 1:  # vocabulary-parallel loss: max, sum and the target logit over tp (fp32 per token)
                comm = 3 * hw.collective_time("all_reduce", 4 * rows, tp, tp_cross)
                comm += hw.collective_time("all_reduce", e * rows * w.shape.hidden, tp, tp_cross)  # embedding's output
            self._heads[key] = (3 * gemm + loss + comm, comm, 3 * 2 * rows * v * w.shape.hidden)
        return self._heads[key]

    # ---------------------------------------------------------------- the step
    def step(self, layout: Layout, stages: Stages, memory: list[RankMemory]) -> StepTime:
        """The step time of ``layout`` (``stages`` and ``memory``: the representative pipeline ranks)."""
        w, hw, shape = self.w, self.hw, self.w.shape
        n = hw.devices_per_node
        cross = {axis: crosses_nodes(layout.dims, axis, n) for axis in COMM_AXES}
        if layout.cp > 1:  # the gradient groups that take cp in (layout.replica_group, layout.shard_group)
            cross[DP] = cross[DP] if layout.sharding > 1 else group_crosses_nodes(layout.dims, (DP, SHARDING, CP), n)
            cross[SHARDING] = group_crosses_nodes(layout.dims, (SHARDING, CP), n) if layout.sharding > 1 else False
        # Members of one gradient group on a node: a ring across nodes gets their share of the network.
        dp_axes = (DP, SHARDING, CP) if layout.sharding == 1 else (DP,)
        per_node = {DP: members_per_node(layout.dims, dp_axes, n), SHARDING: members_per_node(layout.dims, (SHARDING, CP), n)}
        b, m, tp, ep, cp = layout.micro_batch, layout.micro_steps, layout.tp, layout.ep, layout.cp
        v = layout.virtual_stages if layout.pp > 1 else 1
        out = StepTime(crosses=cross, comm=dict.fromkeys(COMM_AXES, 0.0), comm_bytes=dict.fromkeys(COMM_AXES, 0.0))
        moe_ids = set(shape.moe_layer_ids)
        per_mb, compute_only, recompute, flops, inline = [], [], [], [], []
        for i, layers in enumerate(stages.layers):
            n_moe = sum(1 for layer in layers if layer in moe_ids) if moe_ids else 0
            c = r = fl = 0.0
            comm = dict.fromkeys(INLINE_AXES, 0.0)
            sent = dict.fromkeys(COMM_AXES, 0.0)
            for count, is_moe in ((len(layers) - n_moe, False), (n_moe, True)):
                if count:
                    lt = self.layer(b, tp, ep, is_moe, cross[TP], cross[EP], layout.sequence_parallel, cp, layout.cp_mode, cross[CP])
                    c += count * (lt.total - lt.comm_tp - lt.comm_ep - lt.comm_cp)
                    r += count * lt.recompute
                    fl += count * lt.flops
                    comm[TP] += count * lt.comm_tp
                    comm[EP] += count * lt.comm_ep
                    comm[CP] += count * lt.comm_cp
                    sent[TP] += count * lt.tp_bytes
                    sent[EP] += count * lt.ep_bytes
                    sent[CP] += count * lt.cp_bytes
            c, r = c * hw.compute_scale, r * hw.compute_scale  # kernels inside a step (Hardware.compute_scale)
            act = w.precision.activation * b * w.seq_len / cp * shape.hidden  # this rank's s/cp tokens
            if stages.first[i] and tp > 1:  # the vocabulary-parallel embedding's all-reduce
                comm[TP] += hw.collective_time("all_reduce", act, tp, cross[TP])
                sent[TP] += 2 * act * (tp - 1) / tp
            if stages.last[i]:
                ht, hcomm, hfl = self.head(b, tp, cross[TP], cp)
                c, fl, comm[TP] = c + (ht - hcomm) * hw.compute_scale, fl + hfl, comm[TP] + hcomm
                sent[TP] += 3 * 2 * 4 * b * w.seq_len / cp * (tp - 1) / tp if tp > 1 else 0.0
            if layout.pp > 1:
                # The stage output at the activation precision (bf16/fp16 under mixed precision); a sequence shard
                # under sequence parallelism, as with Megatron's scatter/gather: 1/tp of it per tp rank.
                msg = act / (tp if w.runtime.p2p_scatter_gather or layout.sequence_parallel else 1)
                comm[PP] = stages.sends[i] * hw.collective_time("p2p", msg, 2, cross[PP])
                sent[PP] = stages.sends[i] * msg
            per_mb.append(c + sum(comm.values()))
            compute_only.append(c)
            recompute.append(r)
            flops.append(fl)
            inline.append(comm)
            out.comm_bytes_by_rank.append({axis: value * m for axis, value in sent.items()})
        weights = stages.weights
        total_weight = sum(weights)
        async_p2p = w.runtime.async_p2p and layout.pp > 1
        steady = [t - c[PP] for t, c in zip(per_mb, inline)] if async_p2p else per_mb  # sends behind the compute
        worst = max(range(len(steady)), key=steady.__getitem__)
        t_max = steady[worst]
        t_avg = sum(t * k for t, k in zip(per_mb, weights)) / total_weight
        bubble_factor = 1 / 3 if layout.schedule in ("zero_bubble", "zbv") else 1.0
        out.bubble = (layout.pp - 1) / v * t_avg * bubble_factor if layout.pp > 1 else 0.0
        out.compute = m * compute_only[worst]
        out.recompute = m * recompute[worst]
        pipeline = m * t_max + out.bubble
        for axis in INLINE_AXES:  # in line with the bottleneck stage's compute: exposed every micro-batch
            out.comm[axis] = m * inline[worst][axis]
        if async_p2p:  # overlapped with the steady state's compute: what exceeds it, at least one send
            out.comm[PP] = _exposed(out.comm[PP], m * t_max, max(1, m * stages.sends[worst]))
            pipeline += out.comm[PP]
        # Data-parallel and sharding collectives, per representative rank; the slowest decides.
        dp_time = sh_time = 0.0
        for i, mem in enumerate(memory):
            dpt, sht, sent = data_parallel_time(w, hw, layout, mem, cross, per_node)
            dp_time, sh_time = max(dp_time, dpt), max(sh_time, sht)
            for axis, value in sent.items():
                out.comm_bytes_by_rank[i][axis] += value
        for axis in COMM_AXES:
            out.comm_bytes[axis] = max(r[axis] for r in out.comm_bytes_by_rank)
        units = max(len(stages.layers[worst]), 1)
        backward_window = m * t_max * 2 / 3  # the compute a gradient reduction can hide behind
        exposed_dp = _exposed(dp_time, backward_window, units) if w.runtime.overlap_dp else dp_time
        exposed_sh = _exposed(sh_time, m * t_max, units) if w.runtime.overlap_sharding else sh_time
        out.comm[DP], out.comm[SHARDING] = exposed_dp, exposed_sh
        # Once per step, after the last backward and before the optimizer (not overlapped): sequence parallel's
        # partial gradients over tp, tied embeddings' gradient between the first and the last stage.
        finalize = dict.fromkeys((TP, PP), 0.0)
        for i in range(len(memory)):
            times, sent = finalize_grads_time(w, hw, layout, stages, i, cross)
            for axis in (TP, PP):
                finalize[axis] = max(finalize[axis], times[axis])
                out.comm_bytes_by_rank[i][axis] += sent[axis]
        for axis in (TP, PP):
            out.comm[axis] += finalize[axis]
            out.comm_bytes[axis] = max(r[axis] for r in out.comm_bytes_by_rank)
        out.optimizer = max(self._optimizer(mem) for mem in memory)
        out.fsdp_copy = max(fsdp_copy_out_time(w, hw, layout, mem) for mem in memory)
        # Host time: the rank holding the most blocks; a pipeline rank runs m micro-batches through each of its chunks,
        # and its schedule's actions and sends cost what the profile measured a pipeline adding (CPU profiles).
        # The gradient all-reduce's CPU (sharding == 1: plain replicas; FSDP2 and ZeRO 1-2 reduce otherwise), once per step.
        replicas = layout.dp * layout.cp if layout.sharding == 1 else 1
        dp_host = [hw.parallel_host_time("dp", replicas, len(layers), 1) for layers in stages.layers]
        out.host = max(hw.host_time(len(layers), m) + (hw.parallel_host_time("pp", layout.pp, len(layers), m) or 0.0) + (extra or 0.0)
                       for layers, extra in zip(stages.layers, dp_host))
        out.dispatch = max(self._dispatch(layout, layers, mem) for layers, mem in zip(stages.layers, memory))
        critical = (pipeline + exposed_dp + exposed_sh + finalize[TP] + finalize[PP] + out.fsdp_copy + out.optimizer + out.host
                    + out.dispatch)
        if hw.units_per_node < n:  # ranks share compute units: the node's busy time, spread over its units
            ranks_per_node = min(n, layout.world)
            mean_compute = sum(c * k for c, k in zip(compute_only, weights)) / total_weight
            busy = (mean_compute * m + out.fsdp_copy + out.optimizer + out.host + out.dispatch) * ranks_per_node
            # A pipeline's sends wait for one neighbour while the other ranks' work fills the shared units (their CPU
            # is the pipeline's host time); the other axes' collectives hold every rank of their groups at once. Where
            # the gradient all-reduce's CPU was measured (in out.host), its wall is that CPU on the shared units: dp = 8
            # on 2 CPUs stepped in 218-226 ms, the ranks' 51-56 ms of CPU each over 2 cores with nothing on top.
            dp_wall = 0.0 if any(t is not None for t in dp_host) else exposed_dp
            floor = busy / hw.units_per_node + dp_wall + exposed_sh + sum(out.comm[a] for a in INLINE_AXES if a != PP)
            if floor > critical:
                out.shared_units_floor = floor
                critical = floor
        out.total = critical
        out.model_flops = sum(f * k for f, k in zip(flops, weights)) / total_weight * m
        return out

    def _dispatch(self, layout: Layout, layers: list[int], mem: RankMemory) -> float:
        """Host seconds of the DTensor operations of tensor parallelism and FSDP2 (see the module docstring); where
        the profile measured a mechanism's host time (:meth:`Hardware.parallel_host_time`: its optimizer's work on
        the DTensors included) that figure instead."""
        if layout.tp == 1 and layout.sharding == 1:
            return 0.0
        shape, m, hw = self.w.shape, layout.micro_steps, self.hw
        measured, ops, covered = 0.0, 0.0, True
        if layout.tp > 1:
            tp_host = hw.parallel_host_time("tp", layout.tp, len(layers), m)
            if tp_host is None:
                ops += m * len(layers) * (48 if self.w.recompute == "full" else 36)
                covered = False
            else:
                measured += tp_host
        if layout.sharding > 1:
            # FSDP2 gathers per micro-step without a pipeline, once per step with one (gathers_per_step)
            sh_host = hw.parallel_host_time("sharding", layout.shard_group, len(layers), m if layout.pp == 1 else 1)
            if sh_host is None or layout.zero_stage < 3:
                ops += m * (len(layers) + 1) * 8
                covered = False
            else:
                measured += sh_host
        if not covered:
            tensors = len(layers) * shape.layer_tensors + 3  # + embedding / head / final norm
            # The optimizer's ~10 elementwise ops: per tensor, or once over all of them where every parameter is a
            # DTensor of one mesh (FSDP2 alone; experts stay plain tensors beside them): the step then runs
            # multi-tensor (use_foreach_for_dtensors).
            ops += 10 * (1 if layout.tp == 1 and not shape.moe_layer_ids else tensors)
        return measured + ops * hw.dtensor_op_overhead

    def _optimizer(self, memory: RankMemory) -> float:
        """The optimizer step reads the gradients and reads/writes the weights, master copy and moments; where the
        profile measured a step (``optimizer_element_time``), that per element the rank updates."""
        p, slots = self.w.precision, self.w.optimizer_slots
        elements = memory.optimizer / max(slots * p.state, 1) if slots * p.state else memory.param_elements
        if self.hw.optimizer_element_time:
            return elements * self.hw.optimizer_element_time
        per_element = p.grad + 2 * (p.master or p.param) + 2 * slots * p.state + (p.param if p.master else 0)
        return self.hw.memory_time(elements * per_element, 4)


def _exposed(comm: float, window: float, units: int) -> float:
    """Communication overlapped with ``window`` seconds of compute: what exceeds the window, and at least one
    unit's share (the first gather / last reduction has nothing to hide behind)."""
    if comm <= 0:
        return 0.0
    return max(comm - window, comm / units)
