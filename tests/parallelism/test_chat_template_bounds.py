"""A chat template renders under a size and time limit (trainctl.parallelism.data.chat_render): the
exploding template of the hostile-tenant review (``{{ m.content * 100000000 }}``, in chat_template.jinja or
in tokenizer_config.json) and the other ways a template can make a huge value are refused before the value
is made, with an error naming the limit; a template that loops forever is stopped at the time limit; a
real record of several MiB and real template features render exactly as `apply_chat_template` renders them."""

from __future__ import annotations

import json
import resource
import time
from pathlib import Path

import pytest
from data_sources import build_tokenizer, conversations, write_jsonl

from trainctl.parallelism.data import chat_render
from trainctl.parallelism.data.chat import check_messages, conversation_tokens
from trainctl.parallelism.data.chat_render import TemplateLimitExceeded, conversation_budget, render
from trainctl.parallelism.data.documents import token_stream
from trainctl.parallelism.data.tokenizer import load_tokenizer
from trainctl.parallelism.errors import ConfigurationError
from trainctl.spec.job import DataSpec

EXPLODING = "{% for m in messages %}{{ m.content * 100000000 }}{% endfor %}"
MESSAGES = [{"role": "user", "content": "hello the model"}, {"role": "assistant", "content": "yes"}]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tokenizer(tmp_path_factory.mktemp("tokenizer") / "tok", markers=False)


@pytest.fixture
def hf(tokenizer_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


def _peak_rss_mib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024


@pytest.mark.parametrize("where", ["chat_template.jinja", "tokenizer_config.json"])
def test_the_exploding_template_fails_the_token_stream_at_once_naming_the_limit(tmp_path: Path, where: str) -> None:
    directory = build_tokenizer(tmp_path / "tok", markers=False)
    if where == "chat_template.jinja":
        (directory / "chat_template.jinja").write_text(EXPLODING)
    else:
        (directory / "chat_template.jinja").unlink()
        config = json.loads((directory / "tokenizer_config.json").read_text())
        (directory / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": EXPLODING}))
    data = write_jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in conversations(3)])
    spec = DataSpec(paths=[str(data)], format="jsonl", messages_field="messages", tokenizer=str(directory))
    before, started = _peak_rss_mib(), time.monotonic()
    with pytest.raises(ConfigurationError) as raised:
        next(token_stream(spec, load_tokenizer(str(directory)), [data]))
    assert isinstance(raised.value, TemplateLimitExceeded)
    message = str(raised.value)
    assert message.startswith(f"spec.data.tokenizer: {data} line 1: the chat template's `*` would make "), message
    assert "over its limit of " in message and "per rendering" in message
    assert time.monotonic() - started < 5.0
    assert _peak_rss_mib() - before < 100, "refused before the string was made"


ATTACKS = {
    "power": "{{ 10 ** 100000000 }}",
    "namespace-doubling": "{% set ns = namespace(x='ab') %}{% for i in range(60) %}{% set ns.x = ns.x ~ ns.x %}{% endfor %}",
    "macro-doubling": "{% macro f(x, n) %}{% if n %}{{ f(x ~ x, n - 1) }}{% endif %}{% endmacro %}{{ f('ab', 60) }}",
    "center-filter": "{{ 'x' | center(1000000000) }}",
    "ljust-method": "{{ 'x'.ljust(1000000000) }}",
    "replace-method": "{% set s = messages[0].content * 1000 %}{{ s.replace('e', s) }}",
    "format-width": "{{ '{:>1000000000}'.format('x') }}",
    "percent-width": "{{ '%1000000000s' % 'x' }}",
    "indent-filter": "{{ ('a\n' * 100000) | indent(100000) }}",
    "join-filter": "{% set l = ['abcdefghij'] * 100000 %}{{ l | join(l | join('')) }}",
    "output": "{% for i in range(100000) %}{% for j in range(100000) %}xxxxxxxxxx{% endfor %}{% endfor %}",
    "block": "{% set y %}{% for i in range(100000) %}{{ messages[0].content * 10 }}{% endfor %}{% endset %}{{ y }}",
}


@pytest.mark.parametrize("template", list(ATTACKS.values()), ids=list(ATTACKS))
def test_every_way_to_make_a_huge_value_is_refused(hf, template: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each is refused by the size bound. The time bound is lifted so it cannot answer first: the `block`
    loop is checked when its buffer is used, which on a loaded 2-core machine took past the 10 s once."""
    monkeypatch.setattr(chat_render, "SECONDS", 600.0)
    hf.chat_template = template
    before = _peak_rss_mib()
    with pytest.raises(TemplateLimitExceeded, match=r"over its limit of [\d,]+ per rendering"):
        conversation_tokens(hf, check_messages(MESSAGES, "chat.jsonl line 1"), "chat.jsonl line 1")
    assert _peak_rss_mib() - before < 100


def test_a_template_that_loops_without_end_is_stopped_at_the_time_limit(hf, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(chat_render, "SECONDS", 0.5)
    hf.chat_template = "{% for i in range(100000) %}{% for j in range(100000) %}{% set y = i %}{% endfor %}{% endfor %}"
    started = time.monotonic()
    with pytest.raises(TemplateLimitExceeded, match=r"chat\.jsonl line 4: the chat template ran past its time limit of 0\.5 s"):
        conversation_tokens(hf, check_messages(MESSAGES, "chat.jsonl line 4"), "chat.jsonl line 4")
    assert time.monotonic() - started < 3.0


def test_the_limit_grows_with_the_record_so_a_long_real_record_renders(hf) -> None:
    long = " ".join(["the model trains on text"] * 120_000)  # about 3 MiB, over the 1 MiB base
    messages = [{"role": "user", "content": long}, {"role": "assistant", "content": "yes"}]
    budget = conversation_budget(messages, "x")
    text = sum(len(key) + len(value) for message in messages for key, value in message.items())
    assert budget.chars == chat_render.BASE_CHARS + chat_render.CONTENT_FACTOR * text
    ids, mask = conversation_tokens(hf, check_messages(messages, "x"), "x")
    assert len(ids) > 600_000 and mask.sum() == 2  # "yes <|end|>"


RICH = (
    "{%- set ns = namespace(n=0) -%}{{ bos_token }}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
    "{%- if m.role == 'system' %}{{ '<|system|> ' + m.content | trim }}{% else %}<|{{ m['role'] }}|> "
    "{{ m.content | replace('\n', ' ') | center(40) }}{% endif %} <|end|> {% endfor %}"
    "{{ {'turns': ns.n, 'roles': messages | map(attribute='role') | list} | tojson }}"
    "{{ '%-6s|' % 'x' }}{{ '{:>5}'.format(ns.n) }}{{ (['a', 'b'] * 2) | join(',') }}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


@pytest.mark.parametrize("generation_prompt", [False, True])
def test_real_template_features_render_as_apply_chat_template_renders_them(hf, generation_prompt: bool) -> None:
    hf.chat_template = RICH
    for messages in [[{"role": "system", "content": " be brief "}, *conversations(1)[0]], *conversations(4, seed=3)]:
        ours = render(hf, messages, generation_prompt=generation_prompt, budget=conversation_budget(messages, "x"))
        assert ours == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
