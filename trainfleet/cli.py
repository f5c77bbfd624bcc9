"""The `trainfleet` command.

    trainfleet demo            the main job on this machine (see README)
"""

import argparse
import sys


def _demo(args: argparse.Namespace) -> int:
    from trainer.demo import main as trainer_demo

    return trainer_demo(args.rest)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trainfleet", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="run the demo on this machine")
    demo.add_argument("rest", nargs=argparse.REMAINDER)
    demo.set_defaults(func=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
