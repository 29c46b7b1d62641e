"""Stand-ins for the files a user points the fine-tuning examples at, so tests validate and plan those
examples as written, with only their placeholder paths replaced.

`PLACEHOLDERS` are the example paths that stand for the user's files (and, for the command job, the
directory of their training code). `write_user_files(root)` writes a
stand-in for each under `root`: a Hugging Face Llama model directory (config.json of a tiny model and a
`tokenizers` WordLevel tokenizer.json with a chat template in tokenizer_config.json, and an empty
model.safetensors: validation checks that weights exist, neither it nor planning reads them) and one
JSONL file each of conversations and of text records.
`localized(example, files)` is the example's YAML with each placeholder replaced by its stand-in.
No torch or transformers: the spec tests run without the engine.
"""

from __future__ import annotations

import json
from pathlib import Path

MODEL = "/path/to/your-hf-model"
CHAT = "/path/to/chat/*.jsonl"
TEXT = "/path/to/text/*.jsonl"
CODE = "/path/to/your/training-code"
PLACEHOLDERS = (MODEL, CHAT, TEXT, CODE)

CONFIG = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 512, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "hidden_act": "silu",
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}"
    " <|end|>{% endgeneration %}{% else %}{{ m['content'] }} <|end|>{% endif %} {% endfor %}"
)
EMPTY_SAFETENSORS = (2).to_bytes(8, "little") + b"{}"
"""A safetensors file holding no tensor (its header's length, then the header)."""
WORDS = ["<unk>", "<|end|>", "<|user|>", "<|assistant|>", "hello", "how", "are", "you", "fine", "thanks"]


def _tokenizer_files(directory: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>", "eos_token": "<|end|>",
        "chat_template": CHAT_TEMPLATE,
    }))


def write_user_files(root: Path) -> dict[str, str]:
    """Stand-ins under `root` (created) for every placeholder: {placeholder: path or glob}."""
    model = root / "model"
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps(CONFIG))
    (model / "model.safetensors").write_bytes(EMPTY_SAFETENSORS)
    _tokenizer_files(model)
    turns = [{"role": "user", "content": "hello how are you"}, {"role": "assistant", "content": "fine thanks"}]
    (root / "chat").mkdir()
    (root / "chat" / "train.jsonl").write_text("".join(json.dumps({"messages": turns}) + "\n" for _ in range(64)))
    (root / "text").mkdir()
    (root / "text" / "train.jsonl").write_text("".join(json.dumps({"text": "hello how are you"}) + "\n" for _ in range(64)))
    (root / "code").mkdir()
    return {
        MODEL: str(model), CHAT: str(root / "chat" / "*.jsonl"), TEXT: str(root / "text" / "*.jsonl"), CODE: str(root / "code")
    }


def needs_user_files(example: Path) -> bool:
    """Whether the example names a placeholder (a file the user brings)."""
    return any(placeholder in example.read_text() for placeholder in PLACEHOLDERS)


def localized(example: Path, files: dict[str, str]) -> str:
    """The example's YAML text with every placeholder replaced by its stand-in from `files`."""
    text = example.read_text()
    for placeholder, path in files.items():
        text = text.replace(placeholder, path)
    return text
