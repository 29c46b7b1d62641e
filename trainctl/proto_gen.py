"""Generate trainctl/v1 (messages, stubs, .pyi) from proto/ with grpc_tools.protoc.

`python -m trainctl.proto_gen` regenerates in place (`make proto`); `generate(out_dir)` writes to any
directory, which the staleness test compares with the committed files.
"""

from __future__ import annotations

import argparse
import sys
from importlib.resources import files
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
PROTO_ROOT = REPO_ROOT / "proto"
PROTO_FILES = ("trainctl/v1/training.proto",)
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


class ProtocError(RuntimeError):
    """protoc rejected the .proto files."""


def generate(out_dir: Path, proto_root: Path = PROTO_ROOT) -> list[Path]:
    """Run protoc on PROTO_FILES into `out_dir`; return the generated files."""
    from grpc_tools import protoc  # dev/build-time dependency, not needed at runtime

    out_dir.mkdir(parents=True, exist_ok=True)
    well_known = str(files("grpc_tools") / "_proto")
    args = [
        "grpc_tools.protoc",
        f"-I{proto_root}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *PROTO_FILES,
    ]
    if protoc.main(args) != 0:
        raise ProtocError(f"protoc failed: {' '.join(args)}")
    produced = []
    for proto in PROTO_FILES:
        stem = proto.removesuffix(".proto")
        produced.extend(out_dir / f"{stem}{suffix}" for suffix in GENERATED_SUFFIXES)
    return produced


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT, help="output root (default: the repository)")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path.relative_to(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
