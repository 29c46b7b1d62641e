"""A resolved job: a job's spec body with its rank grid and its model shape, derived once and handed down.

Every layer above the spec needs the same two derivations of a spec (`RankGrid.from_spec` and
`trainctl.spec.presets.resolve_model`, which for `spec.model.from_pretrained` reads config.json). They
happen here only: `ResolvedJob.resolve` builds one per job per process (at submit, at admission, on the
rank, in the offline plan), and `with_spec` derives the variant of another parallelism or spec body
(the layout search's candidates, the estimator's `micro_batch_size: auto -> 1` body) reusing the model,
reading nothing. Placement, planning, sizing and the trainer take the resolved job (or its grid / model).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from trainctl.parallelism.layouts.grid import RankGrid
from trainctl.spec.files import FileRule
from trainctl.spec.job import JobSpecBody, ParallelismSpec
from trainctl.spec.presets import ModelConfig, resolve_model


@dataclass(frozen=True)
class ResolvedJob:
    """A job's spec body, its rank grid and its resolved model (None for a command job: no model to resolve)."""

    spec: JobSpecBody
    grid: RankGrid
    model: ModelConfig | None

    @classmethod
    def resolve(cls, spec: JobSpecBody, files: FileRule = FileRule(), *, model: ModelConfig | None = None) -> ResolvedJob:
        """`spec` resolved: its grid and (unless it runs a command) its model, read under `files`, or `model`
        when the caller already resolved it (validation). Raises `LayoutError` for an impossible layout,
        `UnknownPresetError` or `PretrainedConfigError` for a model that cannot be resolved."""
        if spec.command is None and model is None:
            model = resolve_model(spec.model, files)
        return cls(spec=spec, grid=_grid(spec.parallelism), model=None if spec.command is not None else model)

    def with_spec(self, spec: JobSpecBody) -> ResolvedJob:
        """The same job with another spec body of the same model (another layout, batch or training
        settings): the grid derived again when the parallelism differs, the model reused."""
        grid = self.grid if spec.parallelism == self.spec.parallelism else _grid(spec.parallelism)
        return replace(self, spec=spec, grid=grid)

    @property
    def config(self) -> ModelConfig:
        """The model shape of a training job (ValueError for a command job, which has none)."""
        if self.model is None:
            raise ValueError("a command job runs its own program: it has no model shape")
        return self.model


def _grid(parallelism: ParallelismSpec) -> RankGrid:
    return RankGrid.from_spec(parallelism)
