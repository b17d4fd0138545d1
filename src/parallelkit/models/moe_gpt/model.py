"""A Mixture-of-Experts GPT: the foundation GPT with every (or every n-th) MLP replaced by an MoE layer.

Single-device code. A router scores ``num_experts`` expert MLPs per token and sends the token to its
``top_k`` best; only those run. An expert takes at most ``capacity`` assignments per forward; the rest are
dropped (the token passes through the residual connection only). Expert parallelism
(:mod:`parallelkit.distributed.expert_parallel`) plugs in at two seams that this file leaves open:

- ``MoELayer.routing``: how the routing statistics of all data-parallel ranks are gathered. Capacity is
  defined per expert per forward over the *global* micro-batch (all data-parallel ranks together), and
  assignments claim places in one global priority order (first choices before second choices, then token
  order, ranks in data-parallel order). So a parallel run drops exactly the assignments that one process
  with the whole batch drops, and the load-balancing loss uses the global routing fractions.
- ``GroupedExperts``: takes the kept tokens sorted by expert plus the count per expert; expert parallelism
  wraps it with token dispatch and combine (all-to-all) and keeps only this rank's experts.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from parallelkit.models.gpt.model import GPT, MLP, GPTConfig


class LocalRouting:
    """Routing statistics of this process only: the single-process case (one "rank")."""

    def gather(self, stats: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Return ``(stats of every rank stacked on dim 0, this rank's index)``."""
        return stats.unsqueeze(0), 0


class GroupedExperts(nn.Module):
    """Expert MLPs keyed by their global index; ``forward`` runs each expert on its contiguous slice.

    Experts are separate modules (not one stacked weight), so each keeps a globally unique parameter name:
    under expert parallelism a rank holds only its own experts and checkpoints need no resharding logic.
    """

    def __init__(self, cfg: GPTConfig, num_experts: int) -> None:
        super().__init__()
        self.experts = nn.ModuleDict({str(e): MLP(cfg) for e in range(num_experts)})

    def forward(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``tokens``: rows sorted by expert (the held experts, in key order); ``counts``: rows per held expert."""
        chunks = tokens.split(counts.tolist())
        outputs = [expert(chunk) for expert, chunk in zip(self.experts.values(), chunks)]
        return torch.cat(outputs) if outputs else tokens


class MoELayer(nn.Module):
    """Top-k gated mixture of expert MLPs with capacity, a load-balancing loss and an optional router z-loss.

    Args:
        cfg: the GPT config (width, bias, dropout of the expert MLPs).
        num_experts: expert MLPs in this layer.
        top_k: experts per token; for ``top_k > 1`` the chosen gates are renormalised to sum to 1.
        capacity_factor: an expert takes at most ``ceil(capacity_factor × tokens × top_k / num_experts)``
            assignments per forward, counted over the global micro-batch; ``num_experts / top_k`` or more
            never drops.
        aux_loss_weight: weight of the Switch-Transformer load-balancing loss ``E · Σ_e f_e · P_e``.
        z_loss_weight: weight of the router z-loss ``mean(logsumexp(logits)²)`` (0 = off).
        jitter: multiplicative uniform noise ``[1 - jitter, 1 + jitter]`` on the router input in training.
    """

    def __init__(
        self, cfg: GPTConfig, num_experts: int, top_k: int, capacity_factor: float, aux_loss_weight: float, z_loss_weight: float = 0.0, jitter: float = 0.0
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.capacity_factor = capacity_factor
        self.aux_loss_weight = aux_loss_weight
        self.z_loss_weight = z_loss_weight
        self.jitter = jitter
        self.router = nn.Linear(cfg.n_embd, num_experts, bias=False)
        self.experts = GroupedExperts(cfg, num_experts)
        self.routing: Any = LocalRouting()
        self.aux_loss: torch.Tensor | None = None  # the extra loss of the latest forward (with its graph)
        self.last_stats: dict[str, Any] = {}
        self._step = _StepStats(num_experts)

    def capacity(self, global_tokens: int) -> int:
        return math.ceil(self.capacity_factor * global_tokens * self.top_k / self.num_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        n, k, num_e = tokens.shape[0], self.top_k, self.num_experts
        router_in = tokens
        if self.training and self.jitter > 0:
            router_in = tokens * torch.empty_like(tokens).uniform_(1 - self.jitter, 1 + self.jitter)
        logits = self.router(router_in).float()
        probs = logits.softmax(dim=-1)
        top_p, top_e = probs.topk(k, dim=-1)  # (n, k)
        gates = top_p / top_p.sum(dim=-1, keepdim=True) if k > 1 else top_p

        # Assignments in priority order: slot-major (every first choice before any second), then token order.
        expert_of = top_e.t().reshape(-1)  # (k·n,)
        token_of = torch.arange(n, device=x.device).repeat(k)
        gate_of = gates.t().reshape(-1)
        onehot = F.one_hot(expert_of, num_e).view(k, n, num_e)
        local_counts = onehot.sum(dim=1)  # (k, E)
        lse = torch.logsumexp(logits, dim=-1)
        # One gather carries everything the global decisions and metrics need (counts are exact in float64).
        local_stats = torch.cat([local_counts.reshape(-1).double(), probs.detach().sum(0).double(), lse.detach().square().sum().double().view(1)])
        all_stats, me = self.routing.gather(local_stats)
        ranks = all_stats.shape[0]
        all_counts = all_stats[:, : k * num_e].round().long().view(ranks, k, num_e)
        per_slot = all_counts.sum(dim=0)  # (k, E)
        global_tokens = int(per_slot[0].sum())  # every token has exactly one first choice
        capacity = self.capacity(global_tokens)

        # Global position of each assignment in its expert's queue: earlier slots of every rank, then the
        # same slot of earlier ranks, then this rank's earlier tokens.
        offset = per_slot.cumsum(dim=0) - per_slot + all_counts[:me].sum(dim=0)
        within = (onehot.cumsum(dim=1) - 1).gather(2, top_e.t().unsqueeze(2)).reshape(-1)
        position = offset.reshape(-1)[torch.arange(k, device=x.device).repeat_interleave(n) * num_e + expert_of] + within
        kept = (position < capacity).nonzero().squeeze(1)
        order = torch.argsort(expert_of[kept], stable=True)
        kept = kept[order]
        counts = torch.bincount(expert_of[kept], minlength=num_e)

        expert_out = self.experts(tokens[token_of[kept]], counts)
        weighted = expert_out * gate_of[kept].unsqueeze(1).to(expert_out.dtype)
        out = torch.zeros_like(tokens).index_add(0, token_of[kept], weighted.to(tokens.dtype))

        self.aux_loss = self._extra_loss(probs, lse, per_slot, global_tokens)
        self._record(all_stats, per_slot, capacity, global_tokens)
        return out.view(shape)

    def _extra_loss(self, probs: torch.Tensor, lse: torch.Tensor, per_slot: torch.Tensor, global_tokens: int) -> torch.Tensor:
        # f_e (fraction of all assignments routed to e) is global; P_e (mean router probability) is this
        # rank's. The mean over ranks of E·Σ f_e·P_e(rank) is E·Σ f_e·P_e(global), so averaging the ranks'
        # losses and gradients (what data parallelism does) gives exactly the single-process loss.
        fraction = per_slot.sum(dim=0).to(probs.dtype) / (global_tokens * self.top_k)
        aux = self.num_experts * (fraction * probs.mean(dim=0)).sum()
        loss = self.aux_loss_weight * aux
        if self.z_loss_weight:
            loss = loss + self.z_loss_weight * lse.square().mean()
        return loss

    @torch.no_grad()
    def _record(self, all_stats: torch.Tensor, per_slot: torch.Tensor, capacity: int, global_tokens: int) -> None:
        num_e, k = self.num_experts, self.top_k
        load = per_slot.sum(dim=0)  # assignments per expert before capacity, over all ranks
        assignments = global_tokens * k
        dropped = int((load - load.clamp(max=capacity)).sum())
        fraction = load.double() / assignments
        mean_prob = all_stats[:, k * num_e : k * num_e + num_e].sum(dim=0) / global_tokens
        stats = {
            "aux_loss": float(num_e * (fraction * mean_prob).sum()),
            "z_loss": float(all_stats[:, -1].sum() / global_tokens),
            "dropped": dropped,
            "assignments": assignments,
            "load": load.cpu(),
            "capacity": capacity,
        }
        self.last_stats = stats
        if self.training:
            self._step.add(stats)


class _StepStats:
    """Routing statistics accumulated over the training forwards since the last read."""

    def __init__(self, num_experts: int) -> None:
        self.num_experts = num_experts
        self.reset()

    def reset(self) -> None:
        self.forwards = 0
        self.aux = 0.0
        self.z = 0.0
        self.dropped = 0
        self.assignments = 0
        self.load = torch.zeros(self.num_experts, dtype=torch.long)

    def add(self, stats: dict[str, Any]) -> None:
        self.forwards += 1
        self.aux += stats["aux_loss"]
        self.z += stats["z_loss"]
        self.dropped += stats["dropped"]
        self.assignments += stats["assignments"]
        self.load += stats["load"]


class MoEGPT(GPT):
    """The foundation :class:`~parallelkit.models.gpt.GPT` with Mixture-of-Experts MLPs.

    Args:
        vocab_size / block_size / n_layer / n_head / n_embd / dropout / bias: as for ``GPT``.
        num_experts: experts per MoE layer.
        top_k: experts per token (1 ≤ top_k ≤ num_experts; 1 or 2 is usual).
        capacity_factor: > 0; see :class:`MoELayer` (``num_experts / top_k`` never drops a token).
        aux_loss_weight: load-balancing loss weight (≥ 0).
        z_loss_weight: router z-loss weight (≥ 0; 0 = off).
        jitter: router input jitter in [0, 1) (0 = off; not bit-reproducible across strategies).
        moe_every: every ``moe_every``-th block (the last of each group) gets an MoE layer; 1 = all.

    Example::

        model = MoEGPT(vocab_size=128, block_size=64, n_layer=2, num_experts=4, top_k=2)
        loss = model.loss(model(idx), targets)   # cross-entropy + this forward's aux (and z) losses
    """

    def __init__(
        self,
        vocab_size: int = 128,
        block_size: int = 64,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        dropout: float = 0.0,
        bias: bool = True,
        num_experts: int = 4,
        top_k: int = 2,
        capacity_factor: float = 1.25,
        aux_loss_weight: float = 0.01,
        z_loss_weight: float = 0.0,
        jitter: float = 0.0,
        moe_every: int = 1,
    ) -> None:
        _check_moe_args(num_experts, top_k, capacity_factor, aux_loss_weight, z_loss_weight, jitter, moe_every, n_layer)
        super().__init__(vocab_size, block_size, n_layer, n_head, n_embd, dropout, bias)
        cfg = self.config
        for index, block in self.layers.items():
            if int(index) % moe_every == moe_every - 1:
                block.mlp = MoELayer(cfg, num_experts, top_k, capacity_factor, aux_loss_weight, z_loss_weight, jitter)
                block.mlp.apply(self._init_weights)
                for expert in block.mlp.experts.experts.values():  # GPT-2's scaled residual init, as in GPT
                    nn.init.normal_(expert.down_proj.weight, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))
        self.num_experts = num_experts
        self.top_k = top_k
        self._moe_totals: dict[str, Any] = {"steps": 0, "dropped": 0, "assignments": 0, "aux": 0.0, "forwards": 0, "load": {}}

    def moe_layers(self) -> dict[str, MoELayer]:
        return {name: m for name, m in self.named_modules() if isinstance(m, MoELayer)}

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Cross-entropy plus the load-balancing (and z-) losses of the forward that produced ``logits``."""
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        for layer in self.moe_layers().values():
            if layer.aux_loss is not None:
                loss = loss + layer.aux_loss
        return loss

    # ---------------------------------------------------------------- metrics (global over all ranks)
    def step_metrics(self) -> dict[str, float]:
        """Routing metrics of the training forwards since the last call (one optimizer step), then reset."""
        steps = [layer._step for layer in self.moe_layers().values()]
        forwards = sum(s.forwards for s in steps)
        if not forwards:
            return {}
        load = sum(s.load for s in steps) / forwards  # assignments per expert per forward, mean over layers
        metrics = {
            "moe_aux_loss": sum(s.aux for s in steps) / forwards,
            "moe_dropped_frac": sum(s.dropped for s in steps) / max(sum(s.assignments for s in steps), 1),
            **{f"moe_load_e{e}": float(v) for e, v in enumerate(load.tolist())},
        }
        if any(layer.z_loss_weight for layer in self.moe_layers().values()):
            metrics["moe_z_loss"] = sum(s.z for s in steps) / forwards
        self._totals_add(steps)
        for s in steps:
            s.reset()
        return metrics

    def _totals_add(self, steps: list[_StepStats]) -> None:
        totals = self._moe_totals
        totals["steps"] += 1
        for name, s in zip(self.moe_layers(), steps):
            totals["dropped"] += s.dropped
            totals["assignments"] += s.assignments
            totals["aux"] += s.aux
            totals["forwards"] += s.forwards
            totals["load"][name] = totals["load"].get(name, 0) + s.load

    def summary_metrics(self, trainer: Any) -> dict[str, Any]:
        """``summary.json["moe"]``: routing over the whole run, and the expert all-to-all traffic."""
        self.step_metrics()  # fold in forwards not yet read
        totals = self._moe_totals
        layers = self.moe_layers()
        comm = getattr(getattr(trainer, "strategy", None), "comm_stats", None)
        steps = max(getattr(trainer, "global_step", 0), 1)
        from parallelkit.distributed.expert_parallel import MOE_ALL_TO_ALL

        return {
            "moe": {
                "num_experts": self.num_experts,
                "top_k": self.top_k,
                "moe_layers": len(layers),
                "capacity": {name: layer.last_stats.get("capacity") for name, layer in layers.items()},
                "aux_loss_mean": totals["aux"] / totals["forwards"] if totals["forwards"] else None,
                "dropped_frac": totals["dropped"] / totals["assignments"] if totals["assignments"] else None,
                "tokens_per_expert": {name: v.tolist() for name, v in totals["load"].items()},
                "all_to_all_bytes_per_step": comm.bytes(MOE_ALL_TO_ALL) / steps if comm is not None else None,
                "all_to_all_per_step": comm.calls(MOE_ALL_TO_ALL) / steps if comm is not None else None,
            }
        }


def _check_moe_args(
    num_experts: Any, top_k: Any, capacity_factor: Any, aux_loss_weight: Any, z_loss_weight: Any, jitter: Any, moe_every: Any, n_layer: Any
) -> None:
    from parallelkit.errors import ConfigError

    def is_int(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    def is_num(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

    if not is_int(num_experts) or num_experts < 1:
        raise ConfigError(f"model.num_experts should be an int greater than 0. Got {num_experts!r}.")
    if not is_int(top_k) or top_k < 1:
        raise ConfigError(f"model.top_k should be an int greater than 0 (1 or 2 is usual). Got {top_k!r}.")
    if top_k > num_experts:
        raise ConfigError(
            f"model.top_k={top_k} is more than model.num_experts={num_experts}: a token cannot pick more experts than exist. Use top_k <= {num_experts}."
        )
    if not is_num(capacity_factor) or capacity_factor <= 0:
        raise ConfigError(
            f"model.capacity_factor should be a number greater than 0 (1.0-2.0 is usual; {num_experts / top_k:g} = "
            f"num_experts / top_k never drops a token). Got {capacity_factor!r}."
        )
    for name, value in (("aux_loss_weight", aux_loss_weight), ("z_loss_weight", z_loss_weight)):
        if not is_num(value) or value < 0:
            raise ConfigError(f"model.{name} should be a number >= 0 (0 turns it off). Got {value!r}.")
    if not is_num(jitter) or not 0 <= jitter < 1:
        raise ConfigError(f"model.jitter should be a number in [0, 1) (0 = off). Got {jitter!r}.")
    if not is_int(moe_every) or moe_every < 1 or (is_int(n_layer) and moe_every > n_layer):
        raise ConfigError(f"model.moe_every should be an int from 1 to model.n_layer={n_layer} (1: every block is MoE). Got {moe_every!r}.")
