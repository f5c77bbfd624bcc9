"""The one way every command names the deployed stack it works on: `--stack NAME` after the
command, else $TRAINFLEET_STACK, else `trainfleet` (what `sam deploy` and `trainfleet local
deploy` name it by default).

    parser = commands.add_parser("status", parents=[stack_option()])

Light on purpose: the `trainfleet` command builds every parser at start.
"""

import argparse
import os

__all__ = ["stack_option", "STACK_ENV", "DEFAULT_STACK"]

STACK_ENV = "TRAINFLEET_STACK"
DEFAULT_STACK = "trainfleet"


def stack_option(what: str = "the deployed stack") -> argparse.ArgumentParser:
    """A parent parser with the --stack option; `what` says what the stack is to this command."""
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument("--stack", default=os.environ.get(STACK_ENV, DEFAULT_STACK), metavar="NAME",
                        help=f"{what} (default: ${STACK_ENV} or {DEFAULT_STACK})")
    return parent
