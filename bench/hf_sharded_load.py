"""Sharded against whole-model loading of a Hugging Face checkpoint: peak host memory and load time per rank.

One random Llama-shaped `transformers` model (`LlamaForCausalLM` built from a config and written with
`save_pretrained`, sharded with an index file) is loaded under a tp x fsdp layout by `world` CPU
ranks (gloo), two ways, each in fresh processes:

- *sharded*: what the Trainer does (`engine.model_setup.build_parallel_model`): the model built on
  the meta device, cut and sharded, then each rank reads only its regions of the safetensors files;
- *whole*: the peer: the whole model built on CPU, every tensor read whole
  (`hf_import.read_model_weights`), then parallelized the same way (how every rank loaded before).

Per rank: the peak resident set size reached while building and loading, above the process's size
just before (`VmHWM` after resetting it through /proc/self/clear_refs, minus `VmRSS`; file pages of
the memory-mapped safetensors count while mapped), and the wall time. The ratio sharded / whole of
the mean peak should be close to 1 / (tp x fsdp) for a model whose matrices dominate.

    .venv/bin/python bench/hf_sharded_load.py --json bench/results-hf-sharded-load.json
    .venv/bin/python bench/hf_sharded_load.py --smoke     # seconds: a small model
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from trainctl.parallelism.checkpoint.hf_import import read_model_weights
from trainctl.parallelism.engine.distributed import init_distributed
from trainctl.parallelism.engine.model_setup import build_parallel_model
from trainctl.parallelism.layouts.grid import RankGrid
from trainctl.parallelism.layouts.mesh import build_mesh
from trainctl.parallelism.layouts.parallelize import parallelize
from trainctl.parallelism.model.transformer import build_model
from trainctl.spec.job import JobSpecBody
from trainctl.spec.presets import resolve_model

SHAPES = {
    "full": {"vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8,
             "num_attention_heads": 16, "num_key_value_heads": 8},
    "smoke": {"vocab_size": 2048, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2},
}


def write_model(directory: Path, shape: dict[str, int]) -> int:
    """A random LlamaForCausalLM of `shape` saved in 4 safetensors shards; returns its parameter count."""
    import transformers

    config = transformers.LlamaConfig(**shape, max_position_embeddings=512, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config)
    size = sum(p.numel() for p in model.parameters())
    shard_bytes = size * 4 // 4  # fp32, four files
    model.save_pretrained(str(directory), max_shard_size=f"{shard_bytes // 1_000_000 + 1}MB")
    return size


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _load(rank: int, world: int, port: int, body_json: str, mode: str, out: Any) -> None:
    torch.set_num_threads(1)
    init_distributed(rank, world, "127.0.0.1", port, device="cpu")
    job = JobSpecBody.model_validate_json(body_json)
    config = resolve_model(job.model)
    pmesh = build_mesh(RankGrid.from_spec(job.parallelism), "cpu")
    device = torch.device("cpu")
    torch.distributed.barrier()
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    before, start = _status("VmRSS"), time.perf_counter()
    if mode == "sharded":
        build_parallel_model(job, config, pmesh, device)
    else:
        model = build_model(config, job.training.seed)
        model.load_state_dict(read_model_weights(job.model.from_pretrained, model, config))
        parallelize(model, pmesh, job, device)
    seconds = time.perf_counter() - start
    out.put((rank, _status("VmHWM") - before, seconds))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def run(mode: str, body: JobSpecBody, port: int) -> list[dict[str, float]]:
    """Load under `mode` on body's world size in fresh processes; per rank peak bytes and seconds."""
    world = body.parallelism.world_size
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_load, args=(r, world, port, body.model_dump_json(), mode, out)) for r in range(world)]
    for p in procs:
        p.start()
    results = sorted(out.get(timeout=900) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        if p.exitcode != 0:
            raise RuntimeError(f"{mode} rank exited with {p.exitcode}")
    return [{"rank": r, "peak_rss_above_start_mib": peak / 2**20, "seconds": s} for r, peak, s in results]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="a small model (seconds)")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--fsdp", type=int, default=2)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="hf-load-") as tmp:
        directory = Path(tmp) / "llama"
        params = write_model(directory, SHAPES["smoke" if args.smoke else "full"])
        body = JobSpecBody.model_validate({
            "model": {"from_pretrained": str(directory)},
            "data": {"paths": [str(directory / "config.json")], "tokenizer": "byte", "seq_len": 64},
            "parallelism": {"tp": args.tp, "dp_shard": args.fsdp},
            "resources": {"gpus": args.tp * args.fsdp, "device": "cpu"},
        })
        files = sorted(p.name for p in directory.glob("*.safetensors"))
        results = {mode: run(mode, body, 29500 + i) for i, mode in enumerate(("whole", "sharded"))}
    mean = {mode: sum(r["peak_rss_above_start_mib"] for r in rows) / len(rows) for mode, rows in results.items()}
    secs = {mode: max(r["seconds"] for r in rows) for mode, rows in results.items()}
    report = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "torch": torch.__version__, "parameters": params, "fp32_model_mib": params * 4 / 2**20,
        "layout": f"tp{args.tp} x fsdp{args.fsdp}", "safetensors_files": len(files), "per_rank": results,
        "mean_peak_mib": mean, "slowest_rank_seconds": secs,
        "peak_ratio_sharded_over_whole": mean["sharded"] / mean["whole"],
        "time_ratio_sharded_over_whole": secs["sharded"] / secs["whole"],
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")


if __name__ == "__main__":
    main()
