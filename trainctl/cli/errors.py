"""The `trainctl` command's exit statuses and the failure its commands raise to end with one.

Exit status: 0 success, 1 an API or runtime error (a server that cannot be reached included, or a
watched job or sweep that did not succeed), 2 an invalid spec or usage.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # `trainctl --help` loads this module and nothing it need not
    from trainctl.spec.violations import FieldViolation

EXIT_OK, EXIT_ERROR, EXIT_INVALID = 0, 1, 2


class CliError(Exception):
    """A failure to report as `error: ...` (and one `  field: problem` line per violation) with an exit status."""

    def __init__(self, message: str, status: int = EXIT_ERROR, violations: Sequence[FieldViolation] = ()):
        super().__init__(message)
        self.status = status
        self.violations = list(violations)
