"""The `spec.command` section: a command job's program, its arguments, working directory and
environment (docs/command-jobs.md)."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import Field, field_validator

from trainctl.spec.bounds import (
    MAX_COMMAND_ARG_LENGTH,
    MAX_COMMAND_ARGS,
    MAX_ENV_BYTES,
    MAX_ENV_VARS,
    MAX_STEP_TIMEOUT_SECONDS,
)
from trainctl.spec.strict_model import PathText, StrictModel

ENV_NAME_PATTERN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
RESERVED_ENV = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
    "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID", "CUDA_VISIBLE_DEVICES",
)
"""Variables a command job's ranks get from trainctl (docs/command-jobs.md); `spec.command.env` may not
set them, nor any ``TRAINCTL_*`` one."""
RESERVED_ENV_PREFIX = "TRAINCTL_"

EnvName = Annotated[str, Field(min_length=1, max_length=256)]


class CommandSpec(StrictModel):
    """A command job: the user's own program, run on every rank with the environment `torchrun` gives
    (docs/command-jobs.md). Excludes the built-in engine's `model`, `data`, `training`, `init_from`
    and `lora`; `parallelism` is only declared, for placement."""

    program: PathText
    """The program each rank runs: a path, or a name looked up on the rank's PATH; `python` and
    `python3` mean the rank worker's own interpreter."""
    args: list[Annotated[str, Field(max_length=MAX_COMMAND_ARG_LENGTH)]] = Field(
        default_factory=list, max_length=MAX_COMMAND_ARGS
    )
    """Arguments passed to the program, as given (no shell; at most 1024 of 16 KiB each)."""
    working_dir: PathText | None = None
    """Directory the program runs in, subject to the service's path policy (under a data root when the
    service has some); None: the job's run directory."""
    env: dict[EnvName, Annotated[str, Field(max_length=MAX_ENV_BYTES)]] = Field(
        default_factory=dict, max_length=MAX_ENV_VARS
    )
    """Extra environment variables (at most 256, 64 KiB of names and values in all); the variables
    trainctl sets (RANK, MASTER_ADDR, ..., TRAINCTL_*) cannot be overridden."""
    no_progress_timeout_seconds: float | None = Field(default=None, gt=0, le=MAX_STEP_TIMEOUT_SECONDS)
    """A program that has not reported a step (`trainctl.report`) and printed no line for this long
    counts as hung (its group restarts); None: no such limit. Once it reports steps,
    `scheduling.step_timeout_seconds` applies as for built-in jobs."""

    @field_validator("program")
    @classmethod
    def _program_named(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must name the program to run, not be empty")
        return value

    @field_validator("env")
    @classmethod
    def _env_names(cls, value: dict[str, str]) -> dict[str, str]:
        for name in value:
            if not ENV_NAME_PATTERN.match(name):
                raise ValueError(f"{name[:64]!r} is not an environment variable name (letters, digits, '_')")
            if name in RESERVED_ENV or name.startswith(RESERVED_ENV_PREFIX):
                raise ValueError(f"{name} is set by trainctl on every rank and cannot be overridden")
        size = sum(len(k.encode()) + len(v.encode()) for k, v in value.items())
        if size > MAX_ENV_BYTES:
            raise ValueError(f"env holds {size} bytes of names and values; at most {MAX_ENV_BYTES}")
        return value
