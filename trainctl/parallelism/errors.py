"""The engine's configuration error: a job that cannot run as configured, however often it is started.

Raised for problems of the spec or of what it names: a sequence longer than the data can fill, data
that is missing or unreadable, a tokenizer that cannot be loaded, an `init_from` that names no complete
checkpoint or one of another model shape, a layout this build cannot run. A lost node, a killed process or a failed collective is not
one. The supervisor (trainctl.workers.supervisor) fails a job whose rank raised it at once, without
spending restarts: a restart cannot fix a configuration error.
"""

from __future__ import annotations


class ConfigurationError(ValueError):
    """The job's configuration or the files it names make it impossible to run; the message names the
    spec field (`spec.data.seq_len: ...`)."""
