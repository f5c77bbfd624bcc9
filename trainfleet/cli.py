"""The `trainfleet` command.

    trainfleet demo            a training run on the local cloud: a node lost, replaced, resumed
    trainfleet demo --trainer-only   the trainer alone: pp=2 under torchrun on this machine
    trainfleet validate        sam validate --lint and statelint on what users deploy
    trainfleet local up        run the embedded local cloud in the foreground (Ctrl-C stops it)
    trainfleet local deploy    deploy template.yaml into a running local cloud, as `sam deploy` would
"""

import argparse
import os
import sys
from pathlib import Path


def _demo(args: argparse.Namespace) -> int:
    if args.trainer_only:
        from trainer.demo import main as trainer_demo

        return trainer_demo(args.rest)
    from localcloud.demo import main as local_cloud_demo

    return local_cloud_demo(args.rest)


def _validate(args: argparse.Namespace) -> int:
    from trainfleet.validate import validate

    return validate()


def _local_up(args: argparse.Namespace) -> int:
    import signal

    from localcloud import LocalCloud
    from localcloud.imds import serve_fleet

    def stop_on_sigterm(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop_on_sigterm)
    # `trainfleet local deploy` attaches AWS managed policies to SAM's roles, as IAM has them;
    # moto's IAM knows them only when this is set before it starts.
    os.environ.setdefault("MOTO_IAM_LOAD_MANAGED_POLICIES", "true")
    try:
        cloud = LocalCloud(port=args.port, region=args.region, time_scale=args.time_scale).start()
    except (ValueError, OSError) as error:
        print(f"trainfleet local up: {error}", file=sys.stderr)
        return 2
    metadata = serve_fleet(cloud)  # instances booted here find their IMDSv2, as on EC2
    try:
        print(f"local cloud running at {cloud.endpoint}", flush=True)
        print("  " + " ".join(f"{name}={value}" for name, value in cloud.env().items()), flush=True)
        print(f"  instance metadata on port {metadata.port}; instance folders in {cloud.workdir}",
              flush=True)
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        # A second Ctrl-C must not cut the shutdown short and orphan instance processes.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        cloud.stop()
        metadata.stop()
    print("local cloud stopped", flush=True)
    return 0


def _add_local_up(local_commands: argparse._SubParsersAction) -> None:
    up = local_commands.add_parser("up", help="run the local cloud in the foreground until Ctrl-C")
    up.add_argument("--port", type=int, default=4566, help="0 picks a free port (default: 4566)")
    up.add_argument("--region", default=os.environ.get("AWS_REGION", "us-east-1"),
                    help="default: $AWS_REGION or us-east-1")
    up.add_argument("--time-scale", type=float, default=1.0,
                    help="real seconds per nominal second for waits, retries, boot (default: 1)")
    up.set_defaults(func=_local_up)


def _local_deploy(args: argparse.Namespace) -> int:
    from localcloud.deploy import DeployError, DeployRequest, TemplateError, deploy, format_stack

    if not args.endpoint:
        print("trainfleet local deploy: no endpoint: pass --endpoint URL or set AWS_ENDPOINT_URL", file=sys.stderr)
        return 2
    request = DeployRequest(template=args.template, endpoint=args.endpoint, stack_name=args.stack_name,
                            region=args.region, parameters=dict(args.param))
    try:
        stack = deploy(request)
    except (DeployError, TemplateError) as error:
        print(f"trainfleet local deploy: {error}", file=sys.stderr)
        return 1
    print(format_stack(stack))
    return 0


def _parameter(text: str) -> tuple[str, str]:
    name, equals, value = text.partition("=")
    if not equals or not name:
        raise argparse.ArgumentTypeError(f"expected Name=Value, got {text!r}")
    return name, value


def _add_local_deploy(local_commands: argparse._SubParsersAction) -> None:
    deploy = local_commands.add_parser("deploy", help="deploy a SAM template into a running local cloud")
    deploy.add_argument("--template", type=Path, default=Path("template.yaml"), help="default: template.yaml")
    deploy.add_argument("--endpoint", default=os.environ.get("AWS_ENDPOINT_URL"),
                        help="the local cloud's URL (default: $AWS_ENDPOINT_URL)")
    deploy.add_argument("--param", type=_parameter, action="append", default=[], metavar="NAME=VALUE",
                        help="parameter override; repeat for several")
    deploy.add_argument("--stack-name", default="trainfleet", help="default: trainfleet")
    deploy.add_argument("--region", default=os.environ.get("AWS_REGION", "us-east-1"),
                        help="default: $AWS_REGION or us-east-1")
    deploy.set_defaults(func=_local_deploy)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trainfleet", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="a training run on the local cloud, a node lost and replaced")
    demo.add_argument("--trainer-only", action="store_true",
                      help="only the trainer: pp=2 under torchrun on this machine, no cloud")
    demo.add_argument("rest", nargs=argparse.REMAINDER,
                      help="after --: the local run's --run-spec/--workdir/--timeout, or with --trainer-only the trainer's overrides")
    demo.set_defaults(func=_demo)
    validate = commands.add_parser("validate", help="check template.yaml and the state machine")
    validate.set_defaults(func=_validate)
    local = commands.add_parser("local", help="the embedded local cloud")
    local_commands = local.add_subparsers(dest="local_command", required=True)
    _add_local_up(local_commands)
    _add_local_deploy(local_commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
