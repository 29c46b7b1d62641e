"""Tensor + sequence parallelism as declarative DTensor plans (Megatron-style, via `parallelize_module`).

The model is not edited: each plan maps module names (the contract in docs/architecture.md) to a
`ParallelStyle`, and `parallelize_module` turns the named weights into DTensors on the TP mesh.

Per block: `attention.wq/wk/wv` and `feed_forward.w1/w3` are column-parallel (heads / hidden units
split across TP ranks; the model's `-1`-head reshapes see the local heads), `attention.wo` and
`feed_forward.w2` are row-parallel (partial sums reduced). `tok_embeddings` is vocabulary-parallel
(row-wise on the embedding table) and `output` column-parallel with vocabulary-sharded logits, which
the trainer reduces with a parallel cross-entropy inside `loss_context` (never gathering the logits).

With sequence parallelism the activations between blocks are DTensors sharded on the sequence dim
(dim 1): the norms (`attention_norm`, `ffn_norm`, `norm`) run on sequence shards, the attention and
feed-forward inputs are all-gathered along the sequence, and their row-parallel outputs are
reduce-scattered back to sequence shards. Activations stay DTensors (not local tensors) so the model
still sees the global sequence length when it builds default positions.

Pipeline stages under SP exchange plain local sequence shards [batch, seq / tp, dim]: a stage without
the embedding wraps its input as a sequence-sharded DTensor, one without the output head unwraps its
result, so the stage boundary carries ordinary tensors and positions still span the whole sequence.

Models with `qkv_bias` shard the q/k/v biases with their rows (ColwiseParallel does). `qk_norm`'s
`attention.q_norm` / `k_norm` run on the local heads: their weights are replicated DTensors and their
inputs head-sharded (`SequenceParallel` on dim 2), so their gradients are summed over the TP ranks.
With `tie_embeddings` the embedding and the output head are both sharded on the vocabulary (dim 0 of
the one matrix) and re-tied to one DTensor after sharding.

MoE blocks (`moe` instead of `feed_forward`) keep their MoE module replicated across TP ranks: its
input is gathered to full (replicated) activations and, under SP, its output is re-sharded.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from functools import partial

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from trainctl.parallelism.model.transformer import tie_embeddings


def _block_plan(block: nn.Module, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """Plan for one decoder block, keyed by module names relative to the block."""
    between = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, ParallelStyle] = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=between, use_local_output=not sequence_parallel),
    }
    if hasattr(block.attention, "q_norm"):
        plan["attention.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        plan["attention.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    if sequence_parallel:
        plan["attention_norm"] = SequenceParallel()
        plan["ffn_norm"] = SequenceParallel()
        # Inputs (x, cos, sin): gather x along the sequence; the rotary tables are full already.
        plan["attention"] = PrepareModuleInput(
            input_layouts=(Shard(1), None, None),
            desired_input_layouts=(Replicate(), None, None),
        )
    if hasattr(block, "feed_forward"):
        plan["feed_forward.w1"] = ColwiseParallel()
        plan["feed_forward.w3"] = ColwiseParallel()
        plan["feed_forward.w2"] = RowwiseParallel(output_layouts=between, use_local_output=not sequence_parallel)
        if sequence_parallel:
            plan["feed_forward"] = PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            )
    elif hasattr(block, "moe") and sequence_parallel:
        # Gather the input; re-shard the replicated output on the sequence dim (a local slice).
        plan["moe"] = _Chain(
            PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
            ),
            PrepareModuleOutput(
                output_layouts=(Replicate(),), desired_output_layouts=(Shard(1),), use_local_output=False
            ),
        )
    return plan


class _Chain(ParallelStyle):
    """Apply several styles to one module in order (input preparation, then output preparation)."""

    def __init__(self, *styles: ParallelStyle) -> None:
        super().__init__()
        self.styles = styles

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for style in self.styles:
            module = style._apply(module, device_mesh)
        return module


def _top_plan(model: nn.Module, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """Plan for the embedding, final norm and output head (skipping those a pipeline stage lacks)."""
    plan: dict[str, ParallelStyle] = {}
    if getattr(model, "tok_embeddings", None) is not None:
        plan["tok_embeddings"] = RowwiseParallel(
            input_layouts=Replicate(),
            output_layouts=Shard(1) if sequence_parallel else Replicate(),
            use_local_output=not sequence_parallel,
        )
    if sequence_parallel and getattr(model, "norm", None) is not None:
        plan["norm"] = SequenceParallel()
    if getattr(model, "output", None) is not None:
        plan["output"] = ColwiseParallel(
            input_layouts=Shard(1) if sequence_parallel else Replicate(),
            output_layouts=Shard(-1),
            use_local_output=False,
        )
    return plan


def check_tensor_parallel(model: nn.Module, tp: int) -> None:
    """Raise ValueError naming the dimension that `tp` does not divide."""
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError("tensor parallel needs a trainctl Transformer (with a .config)")
    for name in ("n_heads", "n_kv_heads", "ffn_dim", "vocab_size"):
        value = getattr(config, name)
        if value % tp:
            raise ValueError(f"tp={tp} must divide model {name}={value}")


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool) -> nn.Module:
    """Shard `model` in place over the 1-d `tp_mesh` (see the module docstring); returns it.

    Call before context parallel and FSDP (the order of docs/architecture.md). Afterwards the logits are
    a DTensor sharded on the vocabulary: compute the loss and call backward inside `loss_context(True)`.
    Some parameters stay plain tensors (norms without SP, MoE modules), so without FSDP on top an
    optimizer must not put DTensors and plain tensors in one foreach parameter group.
    """
    if tp_mesh.ndim != 1:
        raise ValueError(f"apply_tensor_parallel needs a 1-d TP mesh, got {tp_mesh.ndim} dims")
    check_tensor_parallel(model, tp_mesh.size())
    parallelize_module(model, tp_mesh, _top_plan(model, sequence_parallel))
    tie_embeddings(model)
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, _block_plan(block, sequence_parallel))
    if sequence_parallel and getattr(model, "tok_embeddings", "absent") is None:
        # Prepended: context parallel's default-positions hook must see the global (DTensor) length.
        model.register_forward_pre_hook(partial(_stage_input_to_dtensor, tp_mesh), with_kwargs=True, prepend=True)
    if sequence_parallel and getattr(model, "output", "absent") is None:
        model.register_forward_hook(_stage_output_to_local)
    return model


def _stage_input_to_dtensor(tp_mesh: DeviceMesh, module: nn.Module, args: tuple, kwargs: dict):
    """Pipeline stage without the embedding, under SP: its input is this rank's sequence shard.

    Checked at call time and idempotent: pipeline stage views may share one hook table.
    """
    if module.tok_embeddings is None and args and not isinstance(args[0], DTensor):
        return (DTensor.from_local(args[0], tp_mesh, [Shard(1)], run_check=False), *args[1:]), kwargs
    return None


def _stage_output_to_local(module: nn.Module, args: tuple, output: object) -> object:
    """Pipeline stage without the output head, under SP: send the local sequence shard on."""
    if module.output is None and isinstance(output, DTensor):
        return output.to_local()
    return output


def loss_context(tp_enabled: bool) -> AbstractContextManager[None]:
    """Context for the loss and its backward: DTensor loss parallel under TP, a no-op otherwise.

    Under TP the logits are vocabulary-sharded; inside this context `F.cross_entropy` on them computes
    the softmax statistics with all-reduces over the TP group instead of gathering the logits. The
    returned loss is a replicated DTensor; `.full_tensor()` (or `.to_local()`) gives a plain scalar.
    """
    return loss_parallel() if tp_enabled else nullcontext()
