"""The catalogue of bad specs in tests/spec/bad/: each file says which field must be named.

Header lines: `# expect: <field path>` (required) and `# local-only: ...` for documents a client
cannot send over gRPC at all (YAML that does not parse into a job), which the CLI rejects itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

BAD_DIR = Path(__file__).resolve().parent / "bad"
POOL_GPUS = 8
"""Pool size the catalogue assumes (too-many-gpus.yaml exceeds it)."""


@dataclass(frozen=True)
class BadSpec:
    path: Path
    field: str
    local_only: bool

    @property
    def name(self) -> str:
        return self.path.stem


def catalogue() -> list[BadSpec]:
    out = []
    for path in sorted(BAD_DIR.glob("*.yaml")):
        header = [line for line in path.read_text().splitlines() if line.startswith("#")]
        expect = [line.split(":", 1)[1].strip() for line in header if line.startswith("# expect:")]
        if len(expect) != 1:
            raise ValueError(f"{path}: needs exactly one '# expect: <field>' line")
        out.append(BadSpec(path, expect[0], any(line.startswith("# local-only") for line in header)))
    return out
