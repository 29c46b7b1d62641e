"""The model, free of parallelism: the Llama-style decoder, MoE, LoRA adapters, and sampling."""
