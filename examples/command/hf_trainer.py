"""A Hugging Face `transformers.Trainer` script: a tiny Llama built from a config, trained on random
token sequences with DDP over the ranks torchrun (or trainctl) started, on CPU with gloo. A five-line
callback sends each logged loss to trainctl (`trainctl.report`); the Trainer's own checkpoints go to
TRAINCTL_CHECKPOINT_DIR and a restarted run resumes from the newest.

    python hf_trainer.py [--steps N]
"""

from __future__ import annotations

import argparse
import gc
import os

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

import trainctl

SEQ_LEN = 32
BATCH = 2


class ReportToTrainctl(TrainerCallback):
    """Every logged training loss becomes a trainctl step report."""

    def on_log(self, args, state, control, logs=None, **kwargs):  # noqa: ANN001, ANN201 - the TrainerCallback signature
        if logs and "loss" in logs:
            trainctl.report(step=state.global_step, loss=logs["loss"], tokens=SEQ_LEN * BATCH * args.world_size,
                            lr=logs.get("learning_rate"), grad_norm=logs.get("grad_norm"))


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, size: int, vocab: int) -> None:
        self.ids = torch.randint(0, vocab, (size, SEQ_LEN), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ_LEN)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    output_dir = os.environ.get("TRAINCTL_CHECKPOINT_DIR", "hf-trainer-output")
    training_args = TrainingArguments(
        output_dir=output_dir, max_steps=args.steps, per_device_train_batch_size=BATCH, learning_rate=1e-3,
        logging_steps=1, save_steps=2, use_cpu=True, ddp_backend="gloo", report_to=[], dataloader_num_workers=0,
    )
    trainer = Trainer(model=model, args=training_args, train_dataset=RandomTokens(64, config.vocab_size),
                      callbacks=[ReportToTrainctl()])
    print(f"process {training_args.process_index} of {training_args.world_size} ({training_args.parallel_mode.value})",
          flush=True)
    last = get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None
    trainer.train(resume_from_checkpoint=last)
    if torch.distributed.is_initialized():  # here, not in the interpreter's teardown, where gloo's threads may abort it
        torch.distributed.barrier()  # every rank past its last collective first: destroying early hung the other
        # Free the DDP model before the group: its gradient reducer holds the group, and a gloo group whose last
        # reference goes with the reducer (at exit) is destroyed holding the GIL while gloo's worker thread needs
        # it to free its last work, a deadlock (pytorch/pytorch#56297); destroy_process_group releases the GIL.
        del trainer, model
        gc.collect()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
