"""Mixture-of-experts feed-forward: top-k routing, Switch-style load balancing, dropless dispatch.

`MoEFeedForward(dim, ffn_dim, moe_config)` replaces a block's dense SwiGLU. Module names are fixed
(TP plans, expert parallelism and checkpoints refer to them): `router` (a bias-free linear gate),
`experts` (`GroupedExperts`: SwiGLU weights `w1`, `w3` of shape [experts, dim, ffn_dim] and `w2` of
shape [experts, ffn_dim, dim]) and `shared_expert` (an always-on dense SwiGLU, the
`FeedForward` of dense blocks, or None).

Routing: softmax over all experts in float32, then top-k. With top_k > 1 the k weights are
renormalised to sum to 1 (Mixtral); with top_k == 1 the raw probability is kept (Switch), so the
router still gets a gradient from the language-model loss.

Load balancing (spec `moe.aux_loss`, `AuxLoss`): the Switch Transformer auxiliary loss generalised
to top-k, taken per forward (one micro-batch on one rank), in one of two conventions:

- `per_layer_sum`: per MoE layer `coef * E * sum_e f_e * P_e`, `f_e` the fraction of the layer's k*T
  token-to-expert assignments that go to expert e and `P_e` the mean router probability of e over
  its T tokens (coef when balanced); summed over layers.
- `transformers`: Hugging Face Mixtral's `load_balancing_loss_func` times `router_aux_loss_coef`:
  `coef * E * sum_e (C_e / N) * (S_e / N)` with `C_e` the assignments to e and `S_e` the router
  probabilities of e summed over all MoE layers and `N` the layers' tokens (coef * top_k when balanced).

Both are formed from additive per-layer states (`AuxLoss.layer_state`: the layer's scalar loss, or
its [C (E), S (E), T] statistics), so a pipeline stage passes the sum of its layers' states to the
next and the last stage takes `AuxLoss.value` of the total. Every MoE layer stores its state on
itself after each forward; `pop_aux_loss(model)` (or `pop_aux_state`) sums and clears them, and the
caller adds the loss to the language-model loss of the same micro-batch. Because micro-batches have
the same size under every layout, DP, EP, TP and PP reproduce the single-process result.

Dispatch is dropless: assignments are sorted by expert, each expert runs on its contiguous slice,
and results are weighted and summed back per token. Where the experts run is delegated to a
dispatcher: `LocalDispatcher` here, the all-to-all one in `expert_parallel`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, get_args

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from trainctl.parallelism.model.feed_forward import FeedForward
from trainctl.spec.model_spec import MoEAuxLoss
from trainctl.spec.presets import MoEConfig


class GroupedExperts(nn.Module):
    """`num_local` SwiGLU experts stored as stacked weights; runs each on its contiguous token slice."""

    def __init__(self, num_experts: int, dim: int, hidden: int):
        super().__init__()
        self.num_local = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Each expert initialised like an `nn.Linear` of the same fan-in."""
        dim, hidden = self.w1.shape[1], self.w1.shape[2]
        for weight, fan_in in ((self.w1, dim), (self.w3, dim), (self.w2, hidden)):
            bound = 1.0 / math.sqrt(fan_in)
            nn.init.uniform_(weight, -bound, bound)

    def forward(self, x: Tensor, counts: list[int]) -> Tensor:
        """`x` holds tokens sorted by local expert, `counts[e]` of them for expert e."""
        if len(counts) != self.num_local:
            raise ValueError(f"got token counts for {len(counts)} experts, this module holds {self.num_local}")
        # Expert parallelism makes the weights DTensors sharded on the expert dim: use the local shard.
        w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w2, self.w3))
        outputs = []
        for e, chunk in enumerate(torch.split(x, counts)):
            hidden = F.silu(chunk @ w1[e]) * (chunk @ w3[e])
            outputs.append(hidden @ w2[e])
        return torch.cat(outputs) if outputs else x.new_zeros(0, x.shape[-1])


class Dispatcher(Protocol):
    """Where routed tokens are computed: locally, or across an expert-parallel group."""

    def run(self, experts: GroupedExperts, x_sorted: Tensor, counts: Tensor) -> Tensor:
        """Apply the experts to `x_sorted` (assignments sorted by global expert id, `counts[e]` for
        expert e) and return the outputs in the same order."""
        ...


class LocalDispatcher:
    """All experts live in this process."""

    def run(self, experts: GroupedExperts, x_sorted: Tensor, counts: Tensor) -> Tensor:
        return experts(x_sorted, counts.tolist())


@dataclass(frozen=True)
class Routing:
    """One forward's routing decision: per token the k chosen experts and their combine weights."""

    probs: Tensor
    """[tokens, experts] float32 softmax of the router logits."""
    indices: Tensor
    """[tokens, k] chosen experts."""
    weights: Tensor
    """[tokens, k] combine weights (renormalised when k > 1)."""


def route(logits: Tensor, top_k: int) -> Routing:
    """Softmax over experts, then top-k (renormalised when top_k > 1)."""
    num_experts = logits.shape[-1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}] (num_experts), got {top_k}")
    probs = torch.softmax(logits.float(), dim=-1)
    weights, indices = torch.topk(probs, top_k, dim=-1)
    if top_k > 1:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(probs=probs, indices=indices, weights=weights)


def load_balancing_loss(routing: Routing, num_experts: int) -> Tensor:
    """Switch aux loss (without its coefficient): `E * sum_e f_e * P_e`; 1.0 when perfectly balanced."""
    assignments = routing.indices.reshape(-1)
    fraction = torch.bincount(assignments, minlength=num_experts).to(routing.probs.dtype) / assignments.numel()
    mean_prob = routing.probs.mean(dim=0)
    return num_experts * torch.sum(fraction * mean_prob)


AUX_LOSS_CONVENTIONS = get_args(MoEAuxLoss)
"""Values of `MoEConfig.aux_loss` (spec `moe.aux_loss`)."""


@dataclass(frozen=True)
class AuxLoss:
    """The load-balancing loss of one micro-batch, built from the MoE layers' additive states."""

    convention: str
    coef: float
    num_experts: int

    def __post_init__(self) -> None:
        if self.convention not in AUX_LOSS_CONVENTIONS:
            raise ValueError(f"unknown moe aux_loss {self.convention!r}; known: {', '.join(AUX_LOSS_CONVENTIONS)}")

    @classmethod
    def of(cls, config: MoEConfig) -> AuxLoss:
        return cls(config.aux_loss, config.aux_loss_coef, config.num_experts)

    @property
    def state_size(self) -> int:
        """Length of a layer's (and of a sum of layers') 1-d float32 state."""
        return 1 if self.convention == "per_layer_sum" else 2 * self.num_experts + 1

    def zero_state(self, device: torch.device) -> Tensor:
        return torch.zeros(self.state_size, device=device, dtype=torch.float32)

    def layer_state(self, routing: Routing) -> Tensor:
        """One layer's contribution: [its scaled Switch loss] (per_layer_sum), or [assignments per
        expert (E), router probability sums per expert (E), tokens] (transformers)."""
        if self.convention == "per_layer_sum":
            return (self.coef * load_balancing_loss(routing, self.num_experts)).reshape(1)
        counts = torch.bincount(routing.indices.reshape(-1), minlength=self.num_experts).to(torch.float32)
        rows = routing.probs.new_full((1,), routing.probs.shape[0])
        return torch.cat([counts, routing.probs.sum(dim=0), rows])

    def value(self, state: Tensor) -> Tensor:
        """The aux loss (coefficient included) of a summed state."""
        if self.convention == "per_layer_sum":
            return state[0]
        e = self.num_experts
        counts, prob_sums, rows = state[:e], state[e : 2 * e], state[2 * e]
        return self.coef * (torch.sum((counts / rows) * (prob_sums / rows)) * e)


class MoEFeedForward(nn.Module):
    """Top-k routed SwiGLU experts with an optional shared expert and a load-balancing aux loss."""

    def __init__(self, dim: int, ffn_dim: int, moe_config: MoEConfig):
        super().__init__()
        if moe_config.top_k > moe_config.num_experts:
            raise ValueError(f"moe top_k {moe_config.top_k} exceeds num_experts {moe_config.num_experts}")
        self.num_experts = moe_config.num_experts
        self.top_k = moe_config.top_k
        self.aux = AuxLoss.of(moe_config)
        self.router = nn.Linear(dim, moe_config.num_experts, bias=False)
        self.experts = GroupedExperts(moe_config.num_experts, dim, ffn_dim)
        self.shared_expert = FeedForward(dim, ffn_dim) if moe_config.shared_expert else None
        self.dispatcher: Dispatcher = LocalDispatcher()
        self.aux_state: Tensor | None = None

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        routing = route(self.router(tokens), self.top_k)
        self.aux_state = self.aux.layer_state(routing)

        flat_experts = routing.indices.reshape(-1)
        order = torch.argsort(flat_experts, stable=True)
        token_of = order // self.top_k
        counts = torch.bincount(flat_experts, minlength=self.num_experts)
        expert_out = self.dispatcher.run(self.experts, tokens[token_of], counts)
        weighted = expert_out * routing.weights.reshape(-1)[order].unsqueeze(-1).to(expert_out.dtype)
        out = torch.zeros_like(tokens).index_add_(0, token_of, weighted.to(tokens.dtype))
        if self.shared_expert is not None:
            out = out + self.shared_expert(tokens)
        return out.reshape(shape)


def aux_loss_of(module: nn.Module) -> AuxLoss | None:
    """The aux-loss form of the MoE layers under `module` (None when it holds none)."""
    return next((sub.aux for sub in module.modules() if isinstance(sub, MoEFeedForward)), None)


def pop_aux_state(module: nn.Module) -> Tensor | None:
    """Sum of the aux-loss states the MoE layers under `module` stored in their last forward,
    clearing them; None when `module` ran no MoE layer since the last call."""
    total: Tensor | None = None
    for sub in module.modules():
        if isinstance(sub, MoEFeedForward) and sub.aux_state is not None:
            total = sub.aux_state if total is None else total + sub.aux_state
            sub.aux_state = None
    return total


def pop_aux_loss(module: nn.Module) -> Tensor | None:
    """The aux loss of the MoE layers under `module` from their last forward (clearing their
    states); None when `module` ran no MoE layer since the last call."""
    state = pop_aux_state(module)
    aux = aux_loss_of(module)
    return None if state is None or aux is None else aux.value(state)
