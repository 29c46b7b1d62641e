"""MoE layer: routing, dropless dispatch against a dense per-token loop, the load-balancing loss."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from trainctl.parallelism.model.moe import MoEFeedForward, load_balancing_loss, pop_aux_loss, route
from trainctl.spec.presets import MoEConfig


def dense_reference(moe: MoEFeedForward, x: torch.Tensor) -> torch.Tensor:
    """Every token, every chosen expert, one at a time: what the sorted dispatch must equal."""
    tokens = x.reshape(-1, x.shape[-1])
    probs = torch.softmax(moe.router(tokens).float(), dim=-1)
    rows = []
    for t in range(tokens.shape[0]):
        top_p, top_e = torch.topk(probs[t], moe.top_k)
        if moe.top_k > 1:
            top_p = top_p / top_p.sum()
        acc = torch.zeros_like(tokens[t])
        for p, e in zip(top_p, top_e.tolist(), strict=True):
            ex = moe.experts
            hidden = F.silu(tokens[t] @ ex.w1[e]) * (tokens[t] @ ex.w3[e])
            acc = acc + p * (hidden @ ex.w2[e])
        if moe.shared_expert is not None:
            acc = acc + moe.shared_expert(tokens[t])
        rows.append(acc)
    return torch.stack(rows).reshape(x.shape)


@pytest.mark.parametrize(("experts", "top_k", "shared"), [(4, 2, False), (4, 1, True), (8, 3, False)])
def test_dispatch_matches_dense_loop_forward_and_backward(experts: int, top_k: int, shared: bool) -> None:
    torch.manual_seed(0)
    moe = MoEFeedForward(16, 24, MoEConfig(num_experts=experts, top_k=top_k, shared_expert=shared))
    x = torch.randn(2, 7, 16, requires_grad=True)
    out = moe(x)
    ref = dense_reference(moe, x)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)

    probe = torch.randn_like(out)
    grads = torch.autograd.grad((out * probe).sum(), [x, *moe.parameters()])
    ref_grads = torch.autograd.grad((ref * probe).sum(), [x, *moe.parameters()])
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_routing_renormalises_top_k_and_keeps_raw_probability_for_top_1() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    two = route(logits, 2)
    assert two.indices.tolist() == [[0, 1]]
    torch.testing.assert_close(two.weights.sum(), torch.tensor(1.0))
    one = route(logits, 1)
    torch.testing.assert_close(one.weights, torch.softmax(logits, -1)[:, :1])
    with pytest.raises(ValueError, match="top_k"):
        route(logits, 5)


def test_load_balancing_loss_values() -> None:
    # Uniform router, assignments spread evenly: E * sum(1/E * 1/E) = 1.
    balanced = route(torch.zeros(8, 4), 1)
    balanced = type(balanced)(balanced.probs, torch.arange(8).remainder(4).unsqueeze(1), balanced.weights)
    torch.testing.assert_close(load_balancing_loss(balanced, 4), torch.tensor(1.0))
    # Every token confidently on expert 0: f = P = (1, 0, 0, 0) in the limit, loss -> E.
    collapsed = route(torch.tensor([[50.0, 0.0, 0.0, 0.0]]).repeat(6, 1), 1)
    torch.testing.assert_close(load_balancing_loss(collapsed, 4), torch.tensor(4.0))


def test_aux_loss_is_stored_scaled_and_popped_once() -> None:
    torch.manual_seed(1)
    moe = MoEFeedForward(8, 16, MoEConfig(num_experts=4, top_k=2, aux_loss_coef=0.5))
    model = torch.nn.Sequential(moe)
    x = torch.randn(3, 5, 8)
    model(x)
    routing = route(moe.router(x.reshape(-1, 8)), 2)
    aux = pop_aux_loss(model)
    assert aux is not None
    torch.testing.assert_close(aux, 0.5 * load_balancing_loss(routing, 4))
    assert pop_aux_loss(model) is None
    # The aux loss reaches the router through P_e.
    model(x)
    (router_grad,) = torch.autograd.grad(pop_aux_loss(model), [moe.router.weight])
    assert router_grad.abs().sum() > 0


def test_top_k_larger_than_experts_is_rejected() -> None:
    with pytest.raises(ValueError, match="top_k 5 exceeds num_experts 4"):
        MoEFeedForward(8, 16, MoEConfig(num_experts=4, top_k=5))


def _router_logits_and_aux(config: MoEConfig) -> tuple[list[torch.Tensor], torch.Tensor]:
    """A debug-moe model's router logits (per MoE layer) and its aux loss on one forward."""
    from dataclasses import replace

    from trainctl.parallelism.model.transformer import build_model
    from trainctl.spec.presets import PRESETS

    model = build_model(replace(PRESETS["debug-moe"], n_layers=3, moe=config), seed=5)
    logits: list[torch.Tensor] = []
    for layer in model.layers.values():
        layer.moe.router.register_forward_hook(lambda _m, _a, out: logits.append(out))
    model(torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3)))
    aux = pop_aux_loss(model)
    assert aux is not None
    return logits, aux


@pytest.mark.parametrize("top_k", [2, 3])
def test_transformers_convention_equals_mixtral_load_balancing_loss(top_k: int) -> None:
    transformers_mixtral = pytest.importorskip("transformers.models.mixtral.modeling_mixtral")
    config = MoEConfig(num_experts=4, top_k=top_k, aux_loss_coef=0.3, aux_loss="transformers")
    logits, aux = _router_logits_and_aux(config)
    theirs = 0.3 * transformers_mixtral.load_balancing_loss_func(tuple(logits), 4, top_k)
    torch.testing.assert_close(aux, theirs, rtol=1e-6, atol=0.0)
    # Same gradient into every layer's router logits.
    torch.testing.assert_close(torch.autograd.grad(aux, logits, retain_graph=True), torch.autograd.grad(theirs, logits))
    # Not the per-layer convention: that one sums per-layer values (1.0 each when balanced, not top_k in all).
    per_layer = sum(load_balancing_loss(route(x, top_k), 4) for x in logits)
    assert not torch.allclose(aux, 0.3 * per_layer)


def test_per_layer_sum_convention_sums_each_layers_loss() -> None:
    logits, aux = _router_logits_and_aux(MoEConfig(num_experts=4, top_k=2, aux_loss_coef=0.3))
    torch.testing.assert_close(aux, sum(0.3 * load_balancing_loss(route(x, 2), 4) for x in logits))


def test_unknown_aux_loss_convention_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown moe aux_loss 'switch'"):
        MoEFeedForward(8, 16, MoEConfig(num_experts=4, top_k=2, aux_loss="switch"))
