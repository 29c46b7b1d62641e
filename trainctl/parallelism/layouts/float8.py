"""Float8 training (`training.fp8`): the model's large linear layers run their matrix products in
float8 through torchao's `Float8Linear`, with dynamic scales (`tensorwise`: one scale per tensor;
`rowwise`: one per row of each operand, more accurate, somewhat slower). Master weights, gradients,
optimizer state and every other op keep the job's dtype (bf16 autocast over fp32 parameters).

Which linears convert (`converts`):

- never the output head (`output`: the logits' precision decides the loss) nor an MoE `router` (its
  top-k choice is discontinuous in its logits); norms, embeddings, attention's score and value
  products and MoE experts (grouped weights, not `nn.Linear`) are not linears and stay as they are;
- only layers whose in and out features are multiples of 16 (the float8 GEMM's requirement);
- only layers large enough for float8 to pay: the cast to float8 and back is memory-bound work that
  a small GEMM does not amortise. The thresholds are torchao's, from its H100 speed tables per
  recipe: tensorwise skips a layer with in_features <= 4096 and out_features <= 1024; rowwise skips
  out_features <= 2048, in_features <= 1024, or both out_features <= 4096 and in_features <= 2048.
  So small test shapes (the `debug` preset) convert nothing, and Llama-3's K/V projections
  (dim -> 8 x 128) stay in bf16 under tensorwise.

With the tensorwise recipe where data parallelism shards parameters (FSDP2), the weights are
all-gathered in float8 (half the bytes of bf16), and after each optimizer step every float8 weight's
scale is computed in one all-reduce (`after_optimizer_step`). Under tensor parallelism the layers
keep the plain column/row-wise styles: their DTensor weights cast with globally reduced scales, and
their activations are communicated in bf16 (torchao's float8 tensor-parallel styles, which
all-gather activations in float8, are not used).

Where the model's hardware cannot run it, the job is refused before anything is built
(`check_float8_device`): float8 GEMMs need compute capability 8.9 or newer (Ada, Hopper, Blackwell).
"""

from __future__ import annotations

import torch
from torch import nn

from trainctl.parallelism.layouts.float8_rule import Float8Recipe, converts_shape

MIN_CAPABILITY = (8, 9)
"""CUDA compute capability of the first GPUs with float8 tensor cores (Ada / Hopper)."""


class Float8Unavailable(ValueError):
    """`training.fp8` asked of a device or an environment that cannot run it."""


def check_float8_device(recipe: str, device: torch.device) -> None:
    """Refuse `training.fp8` on a CPU or a GPU without float8 tensor cores, naming what is wrong."""
    if recipe == "none":
        return
    if device.type != "cuda":
        raise Float8Unavailable(
            f"spec.training.fp8 {recipe!r} needs a GPU with float8 tensor cores; this rank runs on {device.type}"
        )
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise Float8Unavailable(
            f"spec.training.fp8 {recipe!r} needs compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer "
            f"(Ada, Hopper, Blackwell); {name} has {capability[0]}.{capability[1]}"
        )


def converts(module: nn.Module, name: str, recipe: Float8Recipe) -> bool:
    """Whether the linear `module` (fully qualified `name`) trains in float8 (module docstring)."""
    if type(module) is not nn.Linear:
        return False
    out_features, in_features = module.weight.shape
    return converts_shape(name, in_features, out_features, recipe)


def _torchao_float8():
    try:
        import torchao.float8 as float8
    except ImportError as err:  # an optional dependency: only float8 jobs need it
        raise Float8Unavailable(
            "spec.training.fp8 needs torchao (pip install 'trainctl[fp8]' or torchao>=0.17), which is not installed"
        ) from err
    return float8


def apply_float8(part: nn.Module, recipe: Float8Recipe, *, fsdp: bool) -> list[str]:
    """Swap `part`'s convertible linears for `Float8Linear` in place (names and state-dict keys are
    unchanged); `fsdp`: the part's parameters will be sharded by FSDP2, so tensorwise weights are
    all-gathered in float8. Returns the converted modules' names."""
    float8 = _torchao_float8()
    if recipe == "tensorwise":
        config = float8.Float8LinearConfig(enable_fsdp_float8_all_gather=fsdp)
    else:
        config = float8.Float8LinearConfig.from_recipe_name(recipe)
        # torchtitan's setting for rowwise: compiled casts round like eager ones
        torch._inductor.config.emulate_precision_casts = True
    chosen = [name for name, module in part.named_modules() if converts(module, name, recipe)]
    if chosen:
        names = set(chosen)
        float8.convert_to_float8_training(part, config=config, module_filter_fn=lambda _m, fqn: fqn in names)
    return chosen


def precomputes_scales(recipe: str, fsdp: bool) -> bool:
    """Whether the optimizer step is followed by `after_optimizer_step` (tensorwise under FSDP2)."""
    return recipe == "tensorwise" and fsdp


def after_optimizer_step(parts: list[nn.Module]) -> None:
    """Compute every float8 weight's scale for the next FSDP all-gather, in one all-reduce per part."""
    float8 = _torchao_float8()
    for part in parts:
        float8.precompute_float8_dynamic_scale_for_fsdp(part)
