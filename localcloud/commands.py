"""The local cloud's commands, and the `trainfleet` command's one way into the local cloud
(trainfleet/cli.py imports nothing else of it):

    add_local_commands(commands)   `trainfleet local up`, `trainfleet local deploy`, `trainfleet chaos`
    demo(argv)                     `trainfleet demo`: a run on the local cloud (localcloud/demo.py)

Importing this module imports neither moto nor boto3: each command imports what it runs, so the
`trainfleet` command starts as fast without a local cloud installed (an operator's machine with
only the `cli` extra) as with one.
"""

import argparse
import os
import sys
from pathlib import Path

__all__ = ["add_local_commands", "demo"]


def demo(argv: list[str]) -> int:
    """The local cloud's demo; the process then ends without finalizing the interpreter
    (localcloud.cloud.exit_after_local_cloud)."""
    from localcloud.cloud import exit_after_local_cloud
    from localcloud.demo import main

    exit_after_local_cloud(main(argv))


def _local_up(args: argparse.Namespace) -> int:
    import shlex
    import signal

    from localcloud import LocalCloud
    from localcloud.imds import serve_fleet
    from localcloud.node_boot import boot_as_nodes

    def stop_on_sigterm(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop_on_sigterm)
    # A process started in the background of a script inherits SIGINT ignored, and Python then
    # leaves it so: a `kill -INT` would go unheard. Ctrl-C stops the cloud however it was started.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # `trainfleet local deploy` attaches AWS managed policies to SAM's roles, as IAM has them;
    # moto's IAM knows them only when this is set before it starts.
    os.environ.setdefault("MOTO_IAM_LOAD_MANAGED_POLICIES", "true")
    try:
        cloud = LocalCloud(port=args.port, region=args.region, time_scale=args.time_scale).start()
    except (ValueError, OSError) as error:
        print(f"trainfleet local up: {error}", file=sys.stderr)
        return 2
    metadata = serve_fleet(cloud)  # instances booted here find their IMDSv2, as on EC2
    boot_as_nodes(cloud)  # a run's instances boot as its nodes, from their user data's settings
    try:
        # The variables that point the AWS CLI and SDKs (and `trainfleet`) at it, as a shell takes them.
        print(f"local cloud running at {cloud.endpoint}", flush=True)
        for name, value in cloud.env().items():
            print(f"export {name}={shlex.quote(value)}", flush=True)
        print(f"# instance metadata on port {metadata.port}; instance folders in {cloud.workdir}", flush=True)
        _wait_for_a_signal()
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


def _wait_for_a_signal() -> None:
    """Block until a signal's handler ran (Ctrl-C's raises KeyboardInterrupt). Not signal.pause():
    that returns only for a signal delivered to the main thread, and the kernel may hand a
    process's signal to any of its threads (the local cloud's servers), leaving it waiting."""
    import select
    import signal
    import socket

    reader, writer = socket.socketpair()
    writer.setblocking(False)
    signal.set_wakeup_fd(writer.fileno())  # whichever thread takes the signal writes here
    try:
        while True:
            select.select([reader], [], [])
            reader.recv(64)  # the main thread runs the handler before its next instruction
    finally:
        signal.set_wakeup_fd(-1)
        reader.close()
        writer.close()


def _add_local_up(local_commands: argparse._SubParsersAction) -> None:
    up = local_commands.add_parser(
        "up", help="run the local cloud in the foreground until Ctrl-C",
        description="Run the local cloud in the foreground until Ctrl-C. It prints its endpoint, then the "
                    "`export` lines that point the AWS CLI, the SDKs and `trainfleet` at it: paste them into "
                    "the shell you run the other commands in. A run's instances boot here as its nodes.")
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
    request = DeployRequest(template=args.template, endpoint=args.endpoint, stack_name=args.stack,
                            region=args.region, parameters=dict(args.param))
    try:
        stack = deploy(request)
    except (DeployError, TemplateError) as error:
        print(f"trainfleet local deploy: {error}", file=sys.stderr)
        return 1
    if "CheckpointBucketName" in stack.outputs:  # trainfleet's stack: what its nodes install, as `make artifacts`
        import boto3
        from botocore.exceptions import BotoCoreError, ClientError

        from localcloud.node_boot import publish_artifacts

        try:
            publish_artifacts(boto3.client("s3", endpoint_url=args.endpoint, region_name=request.region),
                              stack.outputs["CheckpointBucketName"])
        except (BotoCoreError, ClientError) as error:
            print(f"trainfleet local deploy: deployed, but the nodes' artifacts were not published "
                  f"(the credentials `trainfleet local up` prints must be set): {error}", file=sys.stderr)
            return 1
    print(format_stack(stack, as_json=args.json))
    return 0


def _parameter(text: str) -> tuple[str, str]:
    name, equals, value = text.partition("=")
    if not equals or not name:
        raise argparse.ArgumentTypeError(f"expected Name=Value, got {text!r}")
    return name, value


def _add_local_deploy(local_commands: argparse._SubParsersAction) -> None:
    from trainfleet.operator.stack_option import stack_option

    what = "deploy a SAM template into a running local cloud, as `sam deploy` would"
    deploy = local_commands.add_parser("deploy", help=what, description=what,
                                       parents=[stack_option("the stack to create")])
    deploy.add_argument("--template", type=Path, default=Path("template.yaml"), help="default: template.yaml")
    deploy.add_argument("--endpoint", default=os.environ.get("AWS_ENDPOINT_URL"),
                        help="the local cloud's URL (default: $AWS_ENDPOINT_URL)")
    deploy.add_argument("--param", type=_parameter, action="append", default=[], metavar="NAME=VALUE",
                        help="parameter override; repeat for several")
    deploy.add_argument("--region", default=os.environ.get("AWS_REGION", "us-east-1"),
                        help="default: $AWS_REGION or us-east-1")
    deploy.add_argument("--json", action="store_true",
                        help="every resource made, as JSON (default: a summary and the stack's outputs)")
    deploy.set_defaults(func=_local_deploy)


def _chaos(args: argparse.Namespace) -> int:
    import json
    import urllib.error
    import urllib.request

    from localcloud.chaos_route import CHAOS_PATH, SERVICE_FAULTS

    if not args.endpoint:
        print("trainfleet chaos: no endpoint: pass --endpoint URL or set AWS_ENDPOINT_URL", file=sys.stderr)
        return 2
    if args.fault in SERVICE_FAULTS and args.seconds is None:
        print(f"trainfleet chaos: {args.fault} needs --seconds N", file=sys.stderr)
        return 2
    request = urllib.request.Request(
        args.endpoint.rstrip("/") + CHAOS_PATH, method="POST",
        headers={"Content-Type": "application/json"},
        data=json.dumps({"fault": args.fault, "run": args.run, "target": args.target,
                         "seconds": args.seconds}).encode())
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            print(response.read().decode())
        return 0
    except urllib.error.HTTPError as error:
        body = error.read().decode()
        try:
            message = json.loads(body)["error"]
        except (ValueError, KeyError, TypeError):
            message = f"{error.code} {error.reason}: {body[:500]}"
        print(f"trainfleet chaos: {message}", file=sys.stderr)
    except urllib.error.URLError as error:
        print(f"trainfleet chaos: no local cloud at {args.endpoint}: {error.reason}", file=sys.stderr)
    return 2


def _add_chaos(commands: argparse._SubParsersAction) -> None:
    from localcloud.chaos_route import INSTANCE_FAULTS, SERVICE_FAULTS

    chaos = commands.add_parser(
        "chaos", help="inject a fault into a running local cloud (trainfleet local up)",
        description="kill: the instance dies; freeze: all its processes stop; hang / crash: one "
                    "trainer rank stops / is killed; spot, rebalance, health: the EC2 notice or "
                    "AWS Health event for the instance; throttle / error: every request to a "
                    "service answers its throttling error / its 500 for --seconds")
    chaos.add_argument("fault", choices=INSTANCE_FAULTS + SERVICE_FAULTS)
    chaos.add_argument("run", help="the run's name")
    chaos.add_argument("target", help="an instance id of the run, or for throttle and error a service: "
                                      "dynamodb, s3, events, lambda, ec2, states")
    chaos.add_argument("--seconds", type=float, help="how long throttle or error last")
    chaos.add_argument("--endpoint", default=os.environ.get("AWS_ENDPOINT_URL"),
                       help="the local cloud's URL (default: $AWS_ENDPOINT_URL)")
    chaos.set_defaults(func=_chaos)


def add_local_commands(commands: argparse._SubParsersAction) -> None:
    local = commands.add_parser("local", help="the embedded local cloud")
    local_commands = local.add_subparsers(dest="local_command", required=True)
    _add_local_up(local_commands)
    _add_local_deploy(local_commands)
    _add_chaos(commands)
