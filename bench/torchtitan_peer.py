"""A torchtitan peer for trainctl's GPU benchmark: the same job as ``bench/gpu.py``'s ``compile`` run,
trained by torchtitan's own ``Trainer``.

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site:. python3 bench/torchtitan_peer.py --warmup 3 --steps 8 --out torchtitan.json
    PYTHONPATH=/tmp/site:. python3 bench/torchtitan_peer.py --smoke          # CPU, tiny model, 3 steps
    PYTHONPATH=/tmp/site:. python3 bench/torchtitan_peer.py --check-shape    # CPU, meta device only

Harness: ``torchtitan.train.Trainer`` (torchtitan 0.2.2) drives everything: its process-group and
mesh set-up, meta-device model build, ``parallelize_llama`` (per-TransformerBlock ``torch.compile``
via its ``apply_compile``, no FSDP on one rank), ``init_weights``, ``build_optimizers`` (AdamW
fused), its warm-up/cosine LR schedule, the ``train()``/``train_step`` loop (autocast bf16 through
``maybe_enable_amp`` on one device, fp32 master weights, sum-reduced cross entropy / valid tokens,
``clip_grad_norm_``) and its metrics (its own tokens/s and MFU are recorded as reported). This script
only adds, through a ``Trainer`` subclass, a synchronized timer around each ``train_step``.

The job (trainctl preset ``llama-1b``, as in ``bench/gpu.py``): vocab 128,256, dim 2048, 16 layers,
32 heads / 8 KV heads, SwiGLU 8192, RoPE theta 500,000 without Llama-3.1 frequency scaling
(torchtitan applies it by default; scaling_factor 1 turns it off exactly), RMSNorm eps 1e-5,
untied embeddings; seq 2048, 4 sequences per step, no gradient accumulation, no activation
checkpointing, AdamW lr 3e-4 betas (0.9, 0.95) wd 0.1 eps 1e-8 fused, grad clip 1.0, bfloat16
autocast over float32 parameters. The script checks that torchtitan's model has exactly as many
parameters as trainctl's ``Transformer`` for the same config (1,498,482,688 for ``llama-1b``).
torchtitan's default ``compile.components`` is ``["model", "loss"]``: the loss function is compiled
too (trainctl compiles the decoder blocks only); ``--no-compile-loss`` compiles the blocks only.

Deviations from torchtitan's stock llama3 recipe, all forced by the benchmark machine (no network,
no ``datasets`` / ``torchdata`` / ``tyro`` preinstalled):

* Data: torchtitan's HF text loader (``torchtitan.hf_datasets.text_datasets``, C4 through
  ``datasets``) is replaced by byte-level windows of the Python standard library's ``.py`` files
  (token = byte value, as trainctl's ``ByteTokenizer``; like ``bench/gpu.py``'s data, though not
  the same sample order), served through torchtitan's own ``ParallelAwareDataloader``. When the
  ``datasets`` package is not installed, that torchtitan module (imported unconditionally by
  ``torchtitan.train`` and ``torchtitan.models.llama3``) is pre-registered in ``sys.modules`` as a
  stub whose builders raise; nothing calls them, since the train spec here supplies the loader.
* No tokenizer (``build_tokenizer_fn=None``; sdpa causal attention does not need one), no state-dict
  adapter (no checkpointing).
* The job config is built in code (a ``JobConfig`` dataclass) instead of from a TOML file / tyro CLI.
* The model is registered as train spec ``trainctl_llama3``, a copy of torchtitan's ``llama3`` spec
  with the three changes above and one flavor built from trainctl's preset.

Why torchtitan 0.2.2 (the newest 0.2.x, a pure-python wheel): 0.3.0 requires ``spmd_types==0.2.3``
and ``torch_checkpointing`` (neither on the machine) and imports them from its llama3 model, loss
and config modules; its README says each release pins a PyTorch nightly (whether 0.3.0 runs on
torch 2.11 was not tried). 0.2.2 imports and trains with torch 2.11 (checked on CPU only). Extra wheels it needs (carried in ``.whl``, ``--no-deps``):
torchtitan 0.2.2, torchdata 0.11.0 (``StatefulDataLoader``), tyro 1.0.17 (imported by
``torchtitan.config``) with docstring-parser 0.18.0 and typeguard 4.6.1.

Timing: ``--warmup`` steps (compilation, allocator growth) are left out; over the ``--steps`` that
follow, each ``train_step`` is timed between ``torch.cuda.synchronize()`` calls, and the median is
reported with tokens/s = 4 x 2048 / median. Peak memory is ``torch.cuda.max_memory_allocated`` after
``reset_peak_memory_stats`` at the end of the warm-up; torchtitan resets the peak counters itself
after each metrics log (every step here), so the peak is read inside each log call (after the
optimizer step) and the maximum over measured steps is kept. MFU uses trainctl's formula
(``training_flops_per_token(config, seq_len)`` x tokens/s / ``peak_flops(device, "bfloat16")``), next
to torchtitan's own (its FLOPs count full, not causal, attention: a larger numerator).

``--smoke`` runs the same code on CPU with a tiny shape (vocab 256, dim 64, 2 layers, seq 64,
3 steps). torchtitan 0.2.2 assumes an accelerator (``device_module`` is ``torch.cuda`` when none is
found), so the smoke run points torchtitan's device globals at a small CPU stand-in (memory stats
empty) and uses gloo; that shim is only installed under ``--smoke``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import platform
import socket
import statistics
import sys
import sysconfig
import time
import types
from pathlib import Path
from typing import Any

SMOKE_SHAPE = {"vocab_size": 256, "dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 128}
SPEC_NAME = "trainctl_llama3"
FLAVOR = "trainctl"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="llama-1b", help="trainctl preset whose shape to train (default llama-1b)")
    p.add_argument("--seq-len", type=int, default=None, help="default 2048 (64 with --smoke)")
    p.add_argument("--batch", type=int, default=4, help="sequences per step (one micro-batch)")
    p.add_argument("--warmup", type=int, default=3, help="steps left out of the timing")
    p.add_argument("--steps", type=int, default=8, help="measured steps")
    p.add_argument("--no-compile", action="store_true", help="eager (default: torchtitan's per-block compile)")
    p.add_argument("--no-compile-loss", action="store_true", help="compile the decoder blocks only, not the loss")
    p.add_argument("--float8", choices=("none", "tensorwise", "rowwise"), default="none",
                   help="torchtitan's Float8 linears (quantize.linear.float8): tensorwise or rowwise scaling")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny model, 3 steps (1 warm-up + 2 measured)")
    p.add_argument("--check-shape", action="store_true", help="build torchtitan's and trainctl's model on meta, compare, exit")
    p.add_argument("--out", type=Path, default=None, help="also write the result JSON here")
    p.add_argument("--dump-folder", default=None, help="torchtitan's job.dump_folder (default: a temp dir)")
    args = p.parse_args(argv)
    if args.smoke:
        args.warmup, args.steps = 1, 2
        args.seq_len = args.seq_len or 64
    args.seq_len = args.seq_len or 2048
    return args


# --------------------------------------------------------------------------------------------------
# Import-time adjustments (before torchtitan is imported)


def stub_module(name: str, missing: str, functions: tuple[str, ...]) -> bool:
    """Pre-register module `name` as a stub whose `functions` raise, when the package `missing` (which
    the module imports at its top) is not installed. Returns whether the stub was installed."""
    if importlib.util.find_spec(missing) is not None:
        return False

    def _unavailable(*_args: Any, **_kwargs: Any) -> Any:
        raise RuntimeError(f"{name} is stubbed out by bench/torchtitan_peer.py (the `{missing}` package is not installed)")

    stub = types.ModuleType(name)
    stub.__doc__ = f"Stand-in installed by bench/torchtitan_peer.py: `{missing}` is not installed."
    for function in functions:
        setattr(stub, function, _unavailable)
    sys.modules[name] = stub
    return True


def maybe_stub_text_datasets() -> bool:
    """`torchtitan.train` (via `components.validate`) and `torchtitan.models.llama3` import
    `torchtitan.hf_datasets.text_datasets`, which imports `datasets` at module level. This benchmark
    never uses that loader (its train spec supplies a byte-level one), so without `datasets` the module
    is a stub whose builders raise."""
    return stub_module("torchtitan.hf_datasets.text_datasets", "datasets",
                       ("build_text_dataloader", "build_text_validation_dataloader"))


def maybe_stub_moe_kernels() -> bool:
    """`torchtitan.models.moe` imports its Triton kernels at module level; CPU-only torch builds have no
    `triton`, and this dense benchmark never routes tokens, so without it the module is a stub."""
    return stub_module("torchtitan.models.moe.kernels", "triton", ("generate_permute_indices",))


class _CpuDeviceModule:
    """The parts of `torch.cuda` torchtitan 0.2.2 calls, for a CPU smoke run (no memory statistics)."""

    @staticmethod
    def set_device(_device: Any) -> None:
        return None

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def get_device_name(_device: Any = None) -> str:
        return "cpu"

    @staticmethod
    def get_device_properties(_device: Any = None) -> Any:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return types.SimpleNamespace(total_memory=total, name="cpu")

    @staticmethod
    def memory_stats(_device: Any = None) -> dict[str, int]:
        return {}

    @staticmethod
    def reset_peak_memory_stats(_device: Any = None) -> None:
        return None

    @staticmethod
    def empty_cache() -> None:
        return None

    @staticmethod
    def synchronize(_device: Any = None) -> None:
        return None


def install_cpu_shim() -> None:
    """Point torchtitan's module-level `device_type`/`device_module` at the CPU (smoke only)."""
    import torchtitan.components.metrics as tt_metrics
    import torchtitan.distributed.parallel_dims as tt_parallel_dims
    import torchtitan.distributed.utils as tt_dist_utils
    import torchtitan.tools.profiling as tt_profiling
    import torchtitan.tools.utils as tt_utils

    shim = _CpuDeviceModule()
    for module in (tt_utils, tt_metrics, tt_dist_utils, tt_profiling, tt_parallel_dims):
        if hasattr(module, "device_type"):
            module.device_type = "cpu"
        if hasattr(module, "device_module"):
            module.device_module = shim


def set_single_process_env() -> None:
    """The torchrun variables torchtitan reads, for one process on one device (kept if already set)."""
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])


# --------------------------------------------------------------------------------------------------
# Shape: trainctl ModelConfig -> torchtitan TransformerModelArgs


def trainctl_config(args: argparse.Namespace) -> Any:
    from trainctl.spec.presets import PRESETS, ModelConfig

    if args.smoke:  # under float8, a feed-forward wide enough for the auto filter to convert w1 and w3
        return ModelConfig(**{**SMOKE_SHAPE, **({"ffn_dim": 1040} if args.float8 != "none" else {})})
    return PRESETS[args.preset]


def torchtitan_args(config: Any, seq_len: int) -> Any:
    """torchtitan llama3 `TransformerModelArgs` with exactly `config`'s shape (checked on meta later)."""
    from torchtitan.models.llama3.model.args import RoPEScalingArgs, TransformerModelArgs

    unsupported = {
        "moe": config.moe is not None,
        "tie_embeddings": config.tie_embeddings,
        "qkv_bias": config.qkv_bias,
        "qk_norm": config.qk_norm,
        "explicit_head_dim": config.explicit_head_dim not in (None, config.dim // config.n_heads),
        "rope_scaling": config.rope_scaling is not None,
    }
    bad = [k for k, v in unsupported.items() if v]
    if bad:
        raise SystemExit(f"torchtitan's llama3 model cannot express these trainctl features: {bad}")
    # torchtitan: hidden = int(2 * 4 * dim / 3); hidden = int(multiplier * hidden); round up to multiple_of.
    base = int(2 * 4 * config.dim / 3)
    multiplier, multiple_of = config.ffn_dim / base, config.ffn_dim
    if config.ffn_dim == 8192 and config.dim == 2048:
        multiplier, multiple_of = 1.5, 256  # Llama 3.2 1B's own values (same 8192)
    return TransformerModelArgs(
        dim=config.dim,
        n_layers=config.n_layers,
        n_heads=config.n_heads,
        n_kv_heads=config.n_kv_heads,
        vocab_size=config.vocab_size,
        multiple_of=multiple_of,
        ffn_dim_multiplier=multiplier,
        norm_eps=config.norm_eps,
        rope_theta=config.rope_theta,
        # scaling_factor 1: freqs / 1 below the band, (1 - s) * f + s * f inside it: no scaling.
        rope_scaling_args=RoPEScalingArgs(scaling_factor=1.0),
        max_seq_len=seq_len,
        attn_type="sdpa",
        attn_mask_type="causal",
    )


def check_shape(config: Any, model_args: Any) -> dict[str, int]:
    """Build torchtitan's and trainctl's models on meta; fail unless every shape matches."""
    import torch
    from torchtitan.models.llama3.model.model import Transformer as TTTransformer

    from trainctl.parallelism.model.transformer import Transformer as TCTransformer

    with torch.device("meta"):
        tt = TTTransformer(model_args)
        tc = TCTransformer(config)
    n_tt = sum(p.numel() for p in tt.parameters())
    n_tc = sum(p.numel() for p in tc.parameters())
    block = tt.layers["0"]
    got = {
        "ffn_dim": block.feed_forward.w1.out_features,
        "q_out": block.attention.wq.out_features,
        "kv_out": block.attention.wk.out_features,
        "vocab": tt.output.out_features,
    }
    want = {
        "ffn_dim": config.ffn_dim,
        "q_out": config.n_heads * config.head_dim,
        "kv_out": config.n_kv_heads * config.head_dim,
        "vocab": config.vocab_size,
    }
    if got != want or n_tt != n_tc or block.attention_norm.eps != config.norm_eps:
        raise SystemExit(f"shape mismatch: torchtitan {got} {n_tt:,} params, trainctl {want} {n_tc:,} params")
    return {"params_torchtitan": n_tt, "params_trainctl": n_tc}


# --------------------------------------------------------------------------------------------------
# Data: byte-level windows of the standard library, through torchtitan's ParallelAwareDataloader


def stdlib_bytes(max_files: int, min_bytes: int) -> bytes:
    """Concatenated bytes of the first `max_files` stdlib .py files (sorted paths), at least `min_bytes`."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts:
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if len(chunks) >= max_files and total >= min_bytes:
            break
    if total < min_bytes:
        raise SystemExit(f"only {total} bytes of stdlib source under {root}; need {min_bytes}")
    return b"".join(chunks)


def build_byte_dataloader(dp_world_size: int, dp_rank: int, tokenizer: Any, job_config: Any, **_kwargs: Any) -> Any:
    """torchtitan DataLoaderBuilder: seq_len + 1 byte windows, (input, labels) shifted by one."""
    import torch
    from torch.utils.data import IterableDataset
    from torchtitan.components.dataloader import ParallelAwareDataloader

    del tokenizer
    seq_len = job_config.training.seq_len
    batch = job_config.training.local_batch_size
    data = torch.frombuffer(bytearray(stdlib_bytes(200, (seq_len + 1) * batch * 4)), dtype=torch.uint8).long()

    class ByteWindows(IterableDataset):
        def __iter__(self):  # type: ignore[override]
            n = (data.numel() - 1) // seq_len
            i = dp_rank
            while True:
                start = (i % n) * seq_len
                window = data[start : start + seq_len + 1]
                yield {"input": window[:-1].clone()}, window[1:].clone()
                i += dp_world_size

    return ParallelAwareDataloader(ByteWindows(), dp_rank=dp_rank, dp_world_size=dp_world_size, batch_size=batch)


# --------------------------------------------------------------------------------------------------
# Job config and trainer


def build_job_config(args: argparse.Namespace, dump_folder: str) -> Any:
    from torchtitan.config import JobConfig

    jc = JobConfig()
    jc.job.dump_folder = dump_folder
    jc.job.description = f"trainctl peer: torchtitan llama3, trainctl preset {'smoke' if args.smoke else args.preset}"
    jc.model.name = SPEC_NAME
    jc.model.flavor = FLAVOR
    jc.optimizer.name = "AdamW"
    jc.optimizer.lr = 3e-4
    jc.optimizer.beta1, jc.optimizer.beta2 = 0.9, 0.95
    jc.optimizer.eps = 1e-8
    jc.optimizer.weight_decay = 0.1
    jc.optimizer.implementation = "fused"
    total = args.warmup + args.steps
    jc.lr_scheduler.warmup_steps = min(10, total)  # trainctl's default: 10 warm-up steps, then cosine to 0.1
    jc.lr_scheduler.decay_type = "cosine"
    jc.lr_scheduler.min_lr_factor = 0.1
    jc.training.local_batch_size = args.batch
    jc.training.global_batch_size = args.batch  # one micro-batch: no gradient accumulation
    jc.training.seq_len = args.seq_len
    jc.training.max_norm = 1.0
    jc.training.steps = total
    jc.training.dtype = "float32"  # parameters (master weights), gradients, AdamW state
    jc.training.mixed_precision_param = "bfloat16"  # autocast dtype on one device
    jc.training.dataset = "trainctl_stdlib_bytes"
    jc.parallelism.data_parallel_replicate_degree = 1
    jc.parallelism.data_parallel_shard_degree = -1  # = 1 on one rank: no FSDP
    jc.activation_checkpoint.mode = "none"
    jc.compile.enable = not args.no_compile
    jc.compile.components = ["model"] if args.no_compile_loss else ["model", "loss"]
    if args.float8 != "none":
        # torchtitan's float8 converter; its auto filter skips the linears too small to gain, with the
        # thresholds trainctl's layouts/float8.py applies, and the output head stays in bf16 as in trainctl.
        jc.model.converters = ["quantize.linear.float8"]
        fp8 = jc.quantize.linear.float8
        fp8.recipe_name = None if args.float8 == "tensorwise" else args.float8  # None: the tensorwise default
        fp8.filter_fqns = ["output", "auto_filter_small_kn"]
        fp8.emulate = args.smoke  # no float8 tensor cores on CPU: torchao's emulation (eager only)
        if args.smoke:
            jc.compile.enable = False
    jc.metrics.log_freq = 1
    jc.metrics.enable_tensorboard = False
    jc.metrics.enable_wandb = False
    jc.checkpoint.enable = False
    jc.validation.enable = False
    jc.debug.seed = 0
    return jc


def register_spec(model_args: Any) -> None:
    import torchtitan.protocols.train_spec as train_spec_module
    from torchtitan.models.llama3 import get_train_spec

    spec = dataclasses.replace(
        get_train_spec(),
        model_args={FLAVOR: model_args},
        build_dataloader_fn=build_byte_dataloader,
        build_tokenizer_fn=None,
        build_validator_fn=None,
        state_dict_adapter=None,
    )
    train_spec_module.register_train_spec(SPEC_NAME, spec)


def make_trainer_class(warmup: int, on_cuda: bool) -> type:
    import torch
    from torchtitan.components.metrics import BaseLogger
    from torchtitan.train import Trainer

    def sync() -> None:
        if on_cuda:
            torch.cuda.synchronize()

    class RecordingLogger(BaseLogger):
        """Keeps torchtitan's per-step metrics and the CUDA peak since the last reset, then delegates."""

        def __init__(self, inner: BaseLogger) -> None:
            self.inner = inner
            self.records: dict[int, dict[str, Any]] = {}

        def log(self, metrics: dict[str, Any], step: int) -> None:
            record = dict(metrics)
            if on_cuda:
                record["max_memory_allocated"] = torch.cuda.max_memory_allocated()
            self.records[step] = record
            self.inner.log(metrics, step)

        def close(self) -> None:
            self.inner.close()

    class TimedTrainer(Trainer):
        """torchtitan's Trainer; `train_step` timed between device synchronizations."""

        def __init__(self, job_config: Any) -> None:
            super().__init__(job_config)
            self.step_seconds: dict[int, float] = {}
            self.recorder = RecordingLogger(self.metrics_processor.logger)
            self.metrics_processor.logger = self.recorder

        def train_step(self, data_iterator: Any) -> None:
            sync()
            start = time.perf_counter()
            super().train_step(data_iterator)
            sync()
            self.step_seconds[self.step] = time.perf_counter() - start
            if self.step == warmup and on_cuda:
                torch.cuda.reset_peak_memory_stats()

    return TimedTrainer


def run(args: argparse.Namespace) -> dict[str, Any]:
    stubbed = maybe_stub_text_datasets()
    maybe_stub_moe_kernels()
    set_single_process_env()

    import torch
    import torchtitan
    from torchtitan.tools.logging import init_logger

    from trainctl.parallelism.sizing.flops import peak_flops, training_flops_per_token

    init_logger()
    config = trainctl_config(args)
    model_args = torchtitan_args(config, args.seq_len)
    shape = check_shape(config, model_args)
    if args.check_shape:
        return {"torchtitan_version": torchtitan.__version__, "torch_version": torch.__version__, **shape}

    on_cuda = torch.cuda.is_available() and not args.smoke
    if not on_cuda:
        if not args.smoke:
            raise SystemExit("no CUDA device: run with --smoke (CPU) or --check-shape")
        install_cpu_shim()
    register_spec(model_args)

    import tempfile

    dump = args.dump_folder or tempfile.mkdtemp(prefix="torchtitan-peer-")
    job_config = build_job_config(args, dump)
    trainer_cls = make_trainer_class(args.warmup, on_cuda)
    trainer = None
    try:
        trainer = trainer_cls(job_config)
        trainer.train()
        measured = [trainer.step_seconds[s] for s in sorted(trainer.step_seconds) if s > args.warmup]
        records = {s: r for s, r in trainer.recorder.records.items() if s > args.warmup}
        last = trainer.recorder.records[max(trainer.recorder.records)]
        tt_flops = trainer.metrics_processor.num_flops_per_token
        tt_peak = trainer.metrics_processor.gpu_peak_flops
        float8_linears = sorted(
            name for part in trainer.model_parts for name, m in part.named_modules() if type(m).__name__ == "Float8Linear"
        )
    finally:
        if trainer is not None:
            trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()

    device_name = torch.cuda.get_device_name(0) if on_cuda else platform.processor() or "cpu"
    median = statistics.median(measured)
    tokens = args.batch * args.seq_len
    tps = tokens / median
    flops_per_token = training_flops_per_token(config, args.seq_len)
    peak = peak_flops(device_name, "bfloat16") if on_cuda else None
    peak_mem = max((r.get("max_memory_allocated", 0) for r in records.values()), default=0) if on_cuda else None
    tt_mfu = [r["mfu(%)"] for r in records.values() if "mfu(%)" in r]
    tt_tps = [r["throughput(tps)"] for r in records.values() if "throughput(tps)" in r]
    return {
        "harness": "torchtitan Trainer",
        "torchtitan_version": torchtitan.__version__,
        "torch_version": torch.__version__,
        "python": platform.python_version(),
        "device": device_name,
        "smoke": args.smoke,
        "preset": "smoke" if args.smoke else args.preset,
        **shape,
        "seq_len": args.seq_len,
        "batch": args.batch,
        "tokens_per_step": tokens,
        "float8": args.float8,
        "float8_converters": list(job_config.model.converters),
        "float8_linears": float8_linears,
        "compile": job_config.compile.enable,
        "compile_components": list(job_config.compile.components) if job_config.compile.enable else [],
        "mixed_precision": "autocast bfloat16 (torchtitan maybe_enable_amp), float32 parameters",
        "optimizer": "AdamW fused lr 3e-4 betas (0.9, 0.95) wd 0.1, grad clip 1.0",
        "data": "byte-level stdlib .py windows via torchtitan ParallelAwareDataloader",
        "text_datasets_stubbed": stubbed,
        "warmup_steps": args.warmup,
        "measured_steps": len(measured),
        "step_times_s": [round(t, 6) for t in measured],
        "step_time_median_s": median,
        "tokens_per_s": tps,
        "peak_memory_bytes": peak_mem,
        "peak_memory_gib": None if peak_mem is None else peak_mem / 2**30,
        "final_loss": last.get("loss_metrics/global_avg_loss"),
        "final_grad_norm": last.get("grad_norm"),
        "trainctl_flops_per_token": flops_per_token,
        "peak_flops_bf16": peak,
        "mfu": None if peak is None else flops_per_token * tps / peak,
        "torchtitan_flops_per_token": tt_flops,
        "torchtitan_peak_flops": tt_peak,
        "torchtitan_mfu": None if not tt_mfu or not on_cuda else statistics.median(tt_mfu) / 100,
        "torchtitan_tokens_per_s": None if not tt_tps else statistics.median(tt_tps),
        "losses": {str(s): r.get("loss_metrics/global_avg_loss") for s, r in sorted(trainer.recorder.records.items())},
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    text = json.dumps(result, indent=2)
    print(text, flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
