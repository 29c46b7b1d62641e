"""Where the `trainctl` command finds the service: --server, else $TRAINCTL_SERVER, else the default.

Its own module, free of gRPC, so the parser's help can name them without loading the client.
"""

from __future__ import annotations

import os

DEFAULT_SERVER = "127.0.0.1:50051"
SERVER_ENV = "TRAINCTL_SERVER"


class AddressError(ValueError):
    """A server list with no address in it."""


def server_addresses(target: str | None) -> list[str]:
    """The service addresses in `target`, else $TRAINCTL_SERVER, else the default: comma-separated, in
    the order they are tried."""
    text = target or os.environ.get(SERVER_ENV) or DEFAULT_SERVER
    addresses = [part.strip() for part in text.split(",") if part.strip()]
    if not addresses:
        raise AddressError(f"no service address in {text!r} (expected HOST:PORT[,HOST:PORT...])")
    return addresses
