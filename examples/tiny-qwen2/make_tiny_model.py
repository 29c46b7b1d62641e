"""Write the tiny Qwen2 model and the two small datasets the fine-tuning examples train on as shipped.

    .venv/bin/python examples/tiny-qwen2/make_tiny_model.py [--examples DIR]

writes, beside this script (examples/tiny-qwen2/; DIR/tiny-qwen2/ with --examples), a Hugging Face model directory as `save_pretrained`
writes one: config.json (Qwen2: hidden 64, 2 layers, 4 heads, 2 key/value heads, q/k/v biases, tied
embeddings, 512 positions), model.safetensors (random weights from a fixed seed, bfloat16),
generation_config.json, and a byte-level BPE tokenizer trained on the datasets' text (tokenizer.json,
tokenizer_config.json, chat_template.jinja: the ChatML template of Qwen2 with `{% generation %}` marks
around the assistant's turns, `<|im_end|>` ending each turn and the sequence). And under
examples/data/ (DIR/data/): tiny-chat.jsonl (48 short conversations, `{"messages": [...]}`) and tiny-text.jsonl (48
short documents, `{"text": ...}`), generated from the small fact tables below. Running it again writes
the same files. The model is about 100,000 parameters: it learns the datasets' patterns in a few steps on
a CPU and knows nothing else; a real fine-tune points `spec.model.from_pretrained` at a real model.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EXAMPLES = Path(__file__).resolve().parents[1]
SEED = 0
VOCAB = 384
"""256 byte symbols, 3 special tokens and the BPE merges of the datasets' text."""
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}"
    "{{ '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""Qwen2's ChatML, with the assistant's text and its end-of-turn token inside `{% generation %}`."""
SHAPE = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
         "tie_word_embeddings": True, "rope_theta": 10000.0, "rms_norm_eps": 1e-6}

CAPITALS = [("France", "Paris"), ("Japan", "Tokyo"), ("Italy", "Rome"), ("Spain", "Madrid"),
            ("Egypt", "Cairo"), ("Kenya", "Nairobi"), ("Peru", "Lima"), ("Canada", "Ottawa"),
            ("Norway", "Oslo"), ("Chile", "Santiago"), ("India", "New Delhi"), ("Greece", "Athens")]
COLOURS = [("grass", "green"), ("the sky", "blue"), ("snow", "white"), ("a banana", "yellow"),
           ("coal", "black"), ("a tomato", "red"), ("an orange", "orange"), ("a plum", "purple"),
           ("milk", "white"), ("a lemon", "yellow"), ("the sea", "blue"), ("a leaf", "green")]
NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
           "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen"]
SUMS = [(a, b) for a in range(1, 10, 2) for b in range(2, 10, 3)][:12]
OPPOSITES = [("hot", "cold"), ("up", "down"), ("big", "small"), ("fast", "slow"), ("old", "new"),
             ("light", "dark"), ("open", "closed"), ("early", "late"), ("full", "empty"),
             ("soft", "hard"), ("wet", "dry"), ("near", "far")]


def facts() -> list[tuple[str, str, str]]:
    """(question, answer, the same fact as a sentence) for each of the 48 facts."""
    out = [(f"What is the capital of {country}?", f"The capital of {country} is {city}.",
            f"{city} is the capital of {country}.") for country, city in CAPITALS]
    out += [(f"What colour is {thing}?", f"{thing[0].upper() + thing[1:]} is {colour}.",
             f"The colour of {thing} is {colour}.") for thing, colour in COLOURS]
    out += [(f"What is {NUMBERS[a]} plus {NUMBERS[b]}?", f"{NUMBERS[a].capitalize()} plus {NUMBERS[b]} is {NUMBERS[a + b]}.",
             f"Adding {NUMBERS[a]} and {NUMBERS[b]} gives {NUMBERS[a + b]}.") for a, b in SUMS]
    out += [(f"What is the opposite of {word}?", f"The opposite of {word} is {other}.",
             f"{word.capitalize()} and {other} are opposites.") for word, other in OPPOSITES]
    return out


def conversations() -> list[dict]:
    """One record per fact; every fourth opens with a system message, every third asks a second question."""
    table = facts()
    records = []
    for i, (question, answer, _) in enumerate(table):
        messages = [{"role": "system", "content": "You answer in one short sentence."}] if i % 4 == 0 else []
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        if i % 3 == 0:
            follow_question, follow_answer, _ = table[(i + 7) % len(table)]
            messages += [{"role": "user", "content": follow_question}, {"role": "assistant", "content": follow_answer}]
        records.append({"messages": messages})
    return records


def documents() -> list[dict]:
    """One short document per fact: its sentence, then its question and answer."""
    return [{"text": f"{sentence} {question} {answer}"} for question, answer, sentence in facts()]


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(record) + "\n" for record in records))


def train_tokenizer(texts: list[str]) -> transformers.PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer of VOCAB entries trained on `texts`, with the chat template."""
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    core.train_from_iterator(texts, trainer)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE,
        model_max_length=SHAPE["max_position_embeddings"],
    )


def build_model(tokenizer: transformers.PreTrainedTokenizerFast) -> transformers.Qwen2ForCausalLM:
    config = transformers.Qwen2Config(**SHAPE, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                                      bos_token_id=None)
    torch.manual_seed(SEED)
    return transformers.Qwen2ForCausalLM(config).to(torch.bfloat16)


def write_all(examples: Path) -> None:
    """The model under `examples`/tiny-qwen2 and the datasets under `examples`/data."""
    model_dir, data_dir = examples / "tiny-qwen2", examples / "data"
    chat, text = conversations(), documents()
    write_jsonl(data_dir / "tiny-chat.jsonl", chat)
    write_jsonl(data_dir / "tiny-text.jsonl", text)
    tokenizer = train_tokenizer([m["content"] for r in chat for m in r["messages"]] + [d["text"] for d in text])
    assert len(tokenizer) <= VOCAB, f"the tokenizer has {len(tokenizer)} entries, the model {VOCAB}"
    model = build_model(tokenizer)
    model.generation_config = transformers.GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, do_sample=False, max_new_tokens=32
    )
    model.save_pretrained(str(model_dir))
    tokenizer.save_pretrained(str(model_dir))
    (model_dir / "model.safetensors").chmod(0o644)  # save_pretrained writes it owner-only
    print(f"wrote {model_dir} ({sum(p.numel() for p in model.parameters()):,} parameters, vocabulary {len(tokenizer)}) "
          f"and {data_dir}/tiny-chat.jsonl, tiny-text.jsonl ({len(chat)} conversations, {len(text)} documents)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--examples", type=Path, default=EXAMPLES, help="write under DIR/tiny-qwen2 and DIR/data")
    write_all(parser.parse_args().examples)


if __name__ == "__main__":
    main()
