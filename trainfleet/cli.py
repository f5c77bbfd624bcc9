"""The `trainfleet` command.

    trainfleet demo            the main job on this machine (see README)
    trainfleet validate        sam validate --lint and statelint on what users deploy
"""

import argparse
import sys


def _demo(args: argparse.Namespace) -> int:
    from trainer.demo import main as trainer_demo

    return trainer_demo(args.rest)


def _validate(args: argparse.Namespace) -> int:
    from trainfleet.validate import validate

    return validate()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trainfleet", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="run the demo on this machine")
    demo.add_argument("rest", nargs=argparse.REMAINDER)
    demo.set_defaults(func=_demo)
    validate = commands.add_parser("validate", help="check template.yaml and the state machine")
    validate.set_defaults(func=_validate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
