"""`FileRule`: where a job's files may lie, index entries, and bounded reads (trainctl.spec.files)."""

from __future__ import annotations

import json

import pytest

from trainctl.spec.files import (
    MAX_JSON_DEPTH,
    MAX_JSON_TOKENS,
    FileRule,
    FileRuleError,
    json_shape_problem,
    loads_bounded,
)

SECRET = "SECRET-VALUE-FROM-OUTSIDE"


@pytest.fixture
def tree(tmp_path):
    """A data root, a file outside it holding a secret, and a runs directory with two jobs."""
    root, outside, runs = tmp_path / "root", tmp_path / "outside", tmp_path / "runs"
    for d in (root, outside, runs / "mine", runs / "theirs"):
        d.mkdir(parents=True)
    (outside / "secret.json").write_text(json.dumps({"model_type": SECRET}))
    (runs / "theirs" / "weights").write_text(SECRET)
    (root / "ok.json").write_text('{"a": 1}')
    rule = FileRule((str(root),), str(runs), frozenset({"mine"}))
    return root, outside, runs, rule


def test_files_under_the_roots_pass_and_symlinks_out_are_refused_naming_the_field(tree):
    root, outside, _runs, rule = tree
    assert rule.check(root / "ok.json", "spec.x") == root / "ok.json"
    (root / "link.json").symlink_to(outside / "secret.json")
    with pytest.raises(FileRuleError) as err:
        rule.read_json(root / "link.json", "spec.model.from_pretrained")
    assert err.value.field == "spec.model.from_pretrained"
    assert "outside the data roots" in str(err.value) and SECRET not in str(err.value)


def test_run_directories_of_other_jobs_are_refused_even_without_roots(tree):
    root, _outside, runs, rule = tree
    (root / "into-theirs").symlink_to(runs / "theirs" / "weights")
    with pytest.raises(FileRuleError, match="resolves through a symlink outside the data roots") as err:
        rule.check(root / "into-theirs", "spec.data.paths[0]")
    assert "theirs" not in str(err.value).replace(str(root / "into-theirs"), "")  # the target is not revealed
    unconfined = FileRule((), str(runs), frozenset({"mine"}))
    with pytest.raises(FileRuleError, match="run directory"):
        unconfined.read_bytes(runs / "theirs" / "weights", "spec.init_from", 100)
    (runs / "mine" / "ckpt").write_text("x")
    assert unconfined.read_bytes(runs / "mine" / "ckpt", "spec.init_from", 100) == b"x"


@pytest.mark.parametrize("name", ["/etc/passwd", "../../outside/secret.json", "a/../../x", "~/x", "", None, 3])
def test_index_entries_that_leave_their_directory_are_refused_by_name(tree, name):
    root, _outside, _runs, _rule = tree
    with pytest.raises(FileRuleError, match="model.safetensors.index.json names"):
        FileRule().member(root, name, "spec.model.from_pretrained", "model.safetensors.index.json")


def test_an_index_entry_that_is_a_symlink_out_of_its_directory_is_refused(tree):
    root, outside, _runs, _rule = tree
    model = root / "model"
    model.mkdir()
    (model / "shard.safetensors").symlink_to(outside / "secret.json")
    with pytest.raises(FileRuleError, match="through a symlink"):
        FileRule().member(model, "shard.safetensors", "spec.model.from_pretrained", "index")
    (model / "real.safetensors").write_text("")
    assert FileRule().member(model, "real.safetensors", "f", "index") == model / "real.safetensors"


def test_check_tree_refuses_any_entry_that_resolves_outside(tree):
    root, outside, _runs, rule = tree
    tok = root / "tok"
    (tok / "sub").mkdir(parents=True)
    (tok / "tokenizer.json").write_text("{}")
    assert rule.check_tree(tok, "spec.data.tokenizer") == tok
    (tok / "sub" / "chat_template.jinja").symlink_to(outside / "secret.json")
    with pytest.raises(FileRuleError, match="outside the data roots"):
        rule.check_tree(tok, "spec.data.tokenizer")


def test_reads_are_bounded_and_refused_unread_past_the_limit(tree):
    root, _outside, _runs, rule = tree
    big = root / "big.jsonl"
    with open(big, "wb") as f:
        f.truncate(64 << 20)  # a sparse file: no newline in 64 MiB
    with pytest.raises(FileRuleError, match="larger than 1024 bytes"):
        rule.read_bytes(big, "spec.data.paths", 1024)
    with pytest.raises(FileRuleError, match="no complete record in its first 4096 bytes"):
        rule.first_line(big, "spec.data.paths", limit=4096)
    blank = root / "blank.jsonl"
    blank.write_bytes(b"\n" * 10_000)
    with pytest.raises(FileRuleError, match="first 4096 bytes"):
        rule.first_line(blank, "spec.data.paths", limit=4096)
    good = root / "good.jsonl"
    good.write_bytes(b"\n\n{\"text\": 1}\nmore\n")
    assert rule.first_line(good, "f") == (3, b'{"text": 1}\n')
    assert rule.first_line(root / "ok.json", "f", skip_blank=False) == (1, b'{"a": 1}')
    (root / "empty").write_bytes(b"")
    assert rule.first_line(root / "empty", "f") is None


def test_deep_json_is_refused_without_recursion():
    deep = "[" * 50_000 + "]" * 50_000
    assert json_shape_problem(deep) == f"nested deeper than {MAX_JSON_DEPTH} levels"
    with pytest.raises(FileRuleError, match="nested deeper"):
        loads_bounded(deep, "config.json", "spec.model.from_pretrained")
    quoted = json.dumps({"s": "[" * 10_000})  # brackets inside a string do not nest
    assert json_shape_problem(quoted) is None
    assert loads_bounded(quoted, "x", "f") == {"s": "[" * 10_000}
    escaped = json.dumps({"s": 'a"\\[[['})
    assert loads_bounded(escaped, "x", "f") == {"s": 'a"\\[[['}
    with pytest.raises(FileRuleError, match="not valid JSON"):
        loads_bounded(b"{nope", "x", "f")
    wide = "[" + "[]," * MAX_JSON_TOKENS + "[]]"  # shallow, but decodes to more lists than any real file holds
    assert json_shape_problem(wide) == f"made of more than {MAX_JSON_TOKENS} tokens"
    assert json_shape_problem(json.dumps({"text": ',:[{"' * MAX_JSON_TOKENS})) is None  # inside a string: one token
    assert json_shape_problem('{"a": "unterminated') is None  # not JSON: the decoder says so
    with pytest.raises(FileRuleError, match="not valid JSON"):
        loads_bounded('{"a": "unterminated \\"', "x", "f")


def test_the_rule_travels_as_json(tree):
    _root, _outside, _runs, rule = tree
    assert FileRule.from_json(rule.to_json()) == rule
    assert FileRule.from_json(FileRule().to_json()) == FileRule()


def test_an_unreadable_file_is_an_error_naming_it(tree):
    root, _outside, _runs, rule = tree
    with pytest.raises(FileRuleError, match="cannot read"):
        rule.read_bytes(root / "missing.json", "f", 10)
