"""Record data formats end to end through the service, over real gRPC on loopback, on an embedded 2-node
Ray (4 simulated GPUs per node: test_e2e_layouts.py's shape, so the two modules share one cluster): a
2-rank job on a Parquet column trains to completion through the CLI's `submit --watch` with the losses
one process computes on the same data (JSONL text, Arrow and chat JSONL train through the service,
killed and resumed, in tests/reliability/test_data_resume.py); bad input only a rank can find (a JSONL
line deep in a file, a chat role, a value in a later Parquet file, a truncated safetensors file, a
wrongly shaped tensor of a Hugging Face model) fails its job at once with the file and line / record /
tensor named, while the service keeps serving and a job beside it runs on undisturbed."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml
from data_sources import build_tokenizer, conversations, documents, format_data, write_jsonl, write_parquet
from safetensors.torch import load_file, save_file
from small_jobs import single_process_losses, small_job
from test_e2e import leftovers, states_of

from trainctl.cli.client import TrainctlClient
from trainctl.cli.main import main
from trainctl.parallelism.data.chat_render import conversation_budget
from trainctl.spec.job import TrainingJob
from trainctl.v1 import training_pb2 as pb
from trainctl.workers.embedded import EmbeddedRay

pytestmark = [pytest.mark.timeout(480), pytest.mark.cluster(nodes=2, gpus_per_node=4)]

STEPS = 6


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def job(name: str, data: dict, *, gpus: int = 2, steps: int = STEPS, model: dict | None = None) -> TrainingJob:
    return small_job(name, gpus=gpus, steps=steps, labels={"suite": "data-formats"}, data={**data, "seq_len": 32, "seed": 4},
                     training={"lr": 0.005}, **({"model": model} if model else {}))


def hf_model(directory: Path) -> Path:
    """A tiny random Llama written by `transformers`' own `save_pretrained`."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    transformers.LlamaForCausalLM(config).save_pretrained(str(directory))
    return directory


def assert_trained_as_one_process(client: TrainctlClient, job_id: str, spec: TrainingJob) -> None:
    final = client.get_job(job_id, full=True)
    assert final.status.state == pb.SUCCEEDED and final.status.restarts == 0, final.status.reason
    assert [m.step for m in final.metrics] == list(range(1, STEPS + 1))
    assert [m.loss for m in final.metrics] == pytest.approx(single_process_losses(spec), rel=1e-4)
    assert final.status.last_loss < final.status.first_loss


def test_submit_watch_trains_a_parquet_column(client: TrainctlClient, tokenizer: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    spec = job("parquet", format_data("parquet", tmp_path / "data", tokenizer))
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec.model_dump(mode="json", exclude_unset=True)))
    assert main(["--server", client.target, "submit", str(path), "--watch"]) == 0
    out = capsys.readouterr().out
    job_id = out.split()[1]
    assert f"job {job_id} SUCCEEDED" in out and f"over {STEPS} steps" in out, out
    assert_trained_as_one_process(client, job_id, spec)


def nothing_left(cluster: EmbeddedRay, job_id: str) -> bool:
    """Whether the job's actors and placement groups are gone (they are removed just after its last event)."""
    deadline = time.monotonic() + 30
    while any(leftovers(cluster, job_id)) and time.monotonic() < deadline:
        time.sleep(0.25)
    return leftovers(cluster, job_id) == ([], [])


def bad_inputs(root: Path, tokenizer: Path) -> dict[str, tuple[dict, str]]:
    """Data sections (with a `model` entry: the model section) that pass every submit-time check but
    not the ranks' reading, and what the job's reason must say."""
    root.mkdir()
    lines = write_jsonl(root / "deep.jsonl", [{"text": d} for d in documents(40)]).read_text().splitlines(keepends=True)
    lines[36] = "{not json\n"
    (root / "deep.jsonl").write_text("".join(lines))
    convs = conversations(30)
    convs[20][0] = {"role": "narrator", "content": "once upon a time"}
    write_jsonl(root / "chat.jsonl", [{"messages": c} for c in convs])
    exploding = build_tokenizer(root / "exploding")  # the hostile-tenant review's template: gigabytes per record
    (exploding / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content * 100000000 }}{% endfor %}")
    first = conversations(30)[0]
    explosion = len(first[0]["content"]) * 100_000_000
    write_parquet(root / "a.parquet", [{"text": d} for d in documents(20)])
    write_parquet(root / "b.parquet", [{"text": d} for d in documents(10)] + [{"text": None}])
    truncated = hf_model(root / "truncated") / "model.safetensors"
    truncated.write_bytes(truncated.read_bytes()[: truncated.stat().st_size // 2])
    reshaped = hf_model(root / "reshaped") / "model.safetensors"
    weights = load_file(str(reshaped))
    weights["model.layers.1.mlp.down_proj.weight"] = weights["model.layers.1.mlp.down_proj.weight"][:, :-1].contiguous()
    save_file(weights, str(reshaped), metadata={"format": "pt"})
    byte_text = {"paths": [str(root / "a.parquet")], "format": "parquet", "tokenizer": "byte"}
    return {
        "weights-truncated": (
            {**byte_text, "model": {"from_pretrained": str(truncated.parent)}},
            f"spec.model.from_pretrained: {truncated}: not a readable safetensors file (truncated or corrupt?)",
        ),
        "weights-shape": (
            {**byte_text, "model": {"from_pretrained": str(reshaped.parent)}},
            f"spec.model.from_pretrained: {reshaped}: tensor 'model.layers.1.mlp.down_proj.weight' has shape (32, 63)",
        ),
        "jsonl-line": (
            {"paths": [str(root / "deep.jsonl")], "format": "jsonl"},
            f"spec.data.paths: {root / 'deep.jsonl'} line 37 is not JSON",
        ),
        "chat-role": (
            {"paths": [str(root / "chat.jsonl")], "format": "jsonl", "messages_field": "messages", "tokenizer": str(tokenizer)},
            f"spec.data.messages_field: {root / 'chat.jsonl'} line 21: message 0 has unknown role 'narrator'",
        ),
        "chat-template": (
            {"paths": [str(root / "chat.jsonl")], "format": "jsonl", "messages_field": "messages", "tokenizer": str(exploding)},
            f"spec.data.tokenizer: {root / 'chat.jsonl'} line 1: the chat template's `*` would make {explosion:,} characters, "
            f"over its limit of {conversation_budget(first, '').chars:,} per rendering",
        ),
        "parquet-value": (
            {"paths": [str(root / "*.parquet")], "format": "parquet"},
            f"spec.data.text_field: {root / 'b.parquet'} record 10: field 'text' is NoneType, not text",
        ),
    }


def test_bad_records_fail_their_job_at_once_beside_a_running_job(
    client: TrainctlClient, cluster: EmbeddedRay, tokenizer: Path, tmp_path: Path
) -> None:
    neighbour = client.create_job(job("neighbour", format_data("jsonl", tmp_path / "good", tokenizer), gpus=1, steps=100_000))
    cases = bad_inputs(tmp_path / "bad", tokenizer)  # written while the neighbour's rank starts
    stream = client.watch(neighbour.id)
    seen: list[pb.JobEvent] = []
    for event in stream:
        seen.append(event)
        if event.WhichOneof("payload") == "step":
            break
    # One rank each (what a rank finds fails any layout alike), so all six run at once beside the neighbour.
    # "chat-template" is the hostile tenant: its template is refused before it takes the node's memory.
    submitted = {name: client.create_job(job(name, {k: v for k, v in data.items() if k != "model"}, gpus=1,
                                             model=data.get("model")))
                 for name, (data, _) in cases.items()}
    for name, created in submitted.items():
        events = list(client.watch(created.id))
        status = client.get_job(created.id).status
        assert states_of(events) == [pb.QUEUED, pb.SCHEDULED, pb.RUNNING, pb.FAILED], (name, status.reason)
        assert status.restarts == 0
        assert status.reason.startswith("configuration error on rank "), (name, status.reason)
        assert cases[name][1] in status.reason, (name, status.reason)
        assert status.reason.endswith("not restarted (a restart cannot fix it)"), (name, status.reason)
        assert nothing_left(cluster, created.id)

    assert {j.id for j in client.list_jobs(labels={"suite": "data-formats"})} >= {neighbour.id, *(j.id for j in submitted.values())}
    steps_before = client.get_job(neighbour.id).status.steps_done
    for event in stream:  # the neighbour still trains
        seen.append(event)
        if event.WhichOneof("payload") == "step" and event.step.step > steps_before:
            break
    status = client.get_job(neighbour.id).status
    assert status.state == pb.RUNNING and status.restarts == 0, status.reason
    assert states_of(seen) == [pb.QUEUED, pb.SCHEDULED, pb.RUNNING]
    steps = [e.step.step for e in seen if e.WhichOneof("payload") == "step"]
    assert steps == list(range(1, len(steps) + 1)), "every step once, none re-run"
    client.cancel_job(neighbour.id)
    assert states_of(list(stream))[-1] == pb.CANCELLED
