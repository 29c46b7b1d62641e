"""The training loop and what it runs on: process groups, optimizers, the loss, step reports, efficiency knobs."""
