"""The Dockerfile against the project: COPY sources exist, the install matches the Makefile's, the
Ray base matches requirements.txt, it runs as non-root, and its entrypoint is a working CLI command."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

from deploy_support import DEPLOY, REPO

DOCKERFILE = DEPLOY / "docker" / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n", " ", "\n".join(
        line for line in DOCKERFILE.read_text().splitlines() if not line.lstrip().startswith("#")))
    return [(m.group(1).upper(), m.group(2).strip()) for m in re.finditer(r"^\s*(\w+)\s+(.*)$", text, re.M)]


def pip_installs(commands: list[str]) -> list[list[str]]:
    """The argument lists of every `pip install` in shell command lines, minus -q and pip upgrades."""
    found = []
    for command in commands:
        for part in re.split(r"&&|;", command):
            words = shlex.split(part)
            if len(words) > 2 and Path(words[0]).name == "pip" and words[1] == "install":
                args = [w for w in words[2:] if w != "-q"]
                if args != ["--upgrade", "pip"]:
                    found.append(args)
    return found


def test_copy_sources_exist() -> None:
    copies = [args for op, args in instructions() if op == "COPY"]
    assert copies
    for args in copies:
        words = [w for w in args.split() if not w.startswith("--")]
        for source in words[:-1]:
            assert (REPO / source).exists(), f"COPY source {source} does not exist in the repository"


def test_install_matches_the_makefile() -> None:
    make_lines = [line.replace("$(PIP)", "pip") for line in (REPO / "Makefile").read_text().splitlines()
                  if "$(PIP) install" in line]
    make = pip_installs(make_lines)
    docker = pip_installs([args for op, args in instructions() if op == "RUN"])
    make_reqs = [a for args in make for a in args if a.endswith(".txt")]
    runtime = [r for r in make_reqs if r != "requirements-dev.txt"]
    assert runtime == ["requirements.txt"] and "requirements-dev.txt" in make_reqs
    assert docker[0] == [x for r in runtime for x in ("-r", r)], "the image installs exactly requirements.txt"
    make_pkg = next(args for args in make if "--no-deps" in args)
    assert docker[1] == [a for a in make_pkg if a != "-e"], "the package goes in with --no-deps, like make"
    assert len(docker) == 2


def test_base_image_is_the_pinned_ray() -> None:
    pin = re.search(r"^ray\[[^\]]*\]==(\S+)$", (REPO / "requirements.txt").read_text(), re.M).group(1)
    args = dict(a.split("=", 1) for op, a in instructions() if op == "ARG" and "=" in a)
    image = args["RAY_IMAGE"]
    assert image.startswith(f"rayproject/ray:{pin}-py{sys.version_info.major}{sys.version_info.minor}"), image
    assert [a for op, a in instructions() if op == "FROM"] == ["${RAY_IMAGE}"]


def test_runs_as_non_root() -> None:
    users = [a for op, a in instructions() if op == "USER"]
    assert users and users[-1].split(":")[0] not in {"root", "0"}


def test_entrypoint_is_a_working_cli_command() -> None:
    ops = dict(instructions())
    entrypoint, cmd = json.loads(ops["ENTRYPOINT"]), json.loads(ops["CMD"])
    assert entrypoint == ["trainctl"]
    env_path = next(a for op, a in instructions() if op == "ENV" and a.startswith("PATH="))
    venv = re.search(r"VENV=(\S+)", next(a for op, a in instructions() if op == "ENV" and "VENV=" in a)).group(1)
    assert env_path.startswith(f"PATH={venv}/bin:"), "the venv's trainctl and ray come first on PATH"
    # The same console script, installed the same way by `make install`, run with the image's CMD.
    out = subprocess.run([str(REPO / ".venv" / "bin" / entrypoint[0]), *cmd], capture_output=True, text=True,
                         timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    assert "serve" in out.stdout and "submit" in out.stdout
