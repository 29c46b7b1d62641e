"""Weights on disk: sharded DCP checkpoints, trained weights out of them, and Hugging Face export."""
