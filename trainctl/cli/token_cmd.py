"""`trainctl token new|hash`: make a token and its access-file entry, or hash an existing token.

Tokens, their hash and the access file's entry are the wire's (`trainctl.wire.tokens`), shared with the
service that checks them; this module is only the command line around them, which loads them when it runs.
`python -m trainctl.cli.token_cmd` runs it alone.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from trainctl.cli.subcommand import run_alone


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from trainctl.wire.tokens import Role

    sub = parser.add_subparsers(dest="token_command", required=True)
    new = sub.add_parser("new", help="generate a token; print it once, and the access-file entry to add")
    new.add_argument("--name", required=True, help="who will hold the token")
    new.add_argument("--tenant", required=True, help="the holder's tenant (DNS-1123 label)")
    new.add_argument("--role", choices=[r.value for r in Role], default=Role.USER.value)
    sub.add_parser("hash", help="read a token from stdin and print its SHA-256 for the access file")


def run(args: argparse.Namespace) -> int:
    import yaml
    from pydantic import ValidationError

    from trainctl.spec.pydantic_violations import violations_from_pydantic
    from trainctl.wire.tokens import Role, TokenEntry, generate_token, hash_token

    if args.token_command == "hash":
        token = sys.stdin.readline().strip()
        try:
            print(hash_token(token))
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        return 0

    token = generate_token()
    try:
        entry = TokenEntry(name=args.name, tenant=args.tenant, role=Role(args.role), sha256=hash_token(token))
    except ValidationError as exc:
        for violation in violations_from_pydantic(exc):
            print(f"error: --{violation}", file=sys.stderr)
        return 2
    print(f"token (shown once; give it to {entry.name}, store it as TRAINCTL_TOKEN): {token}", file=sys.stderr)
    print(yaml.safe_dump({"tokens": [entry.model_dump(mode="json")]}, sort_keys=False), end="")
    return 0


def token_main(argv: Sequence[str] | None = None) -> int:
    """`trainctl token new|hash`: make a token and its access-file entry, or hash an existing token."""
    return run_alone("token", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(token_main())
