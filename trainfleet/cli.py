"""The `trainfleet` command.

    trainfleet demo            a training run on the local cloud: a node lost, replaced, resumed
    trainfleet demo --trainer-only   the trainer alone: pp=2 under torchrun on this machine
    trainfleet validate        sam validate --lint and statelint on what users deploy
    trainfleet plan --model trainer/configs/jurassic-1-jumbo.toml --instance-type p4d.24xlarge --nodes 32
                               memory per GPU of a layout; the smallest fleet and layout that fit
    trainfleet local up        run the embedded local cloud in the foreground (Ctrl-C stops it)
    trainfleet local deploy    deploy template.yaml into a running local cloud, as `sam deploy` would
    trainfleet chaos hang RUN INSTANCE      inject a fault into a running local cloud: kill, freeze
    trainfleet chaos throttle RUN dynamodb --seconds 30   (instance) or hang, crash (one trainer
                               rank), spot, rebalance, health; throttle, error (a service)
    trainfleet run start|list|status|watch|logs|stop|report ...
                               the runs of a deployed stack, on AWS or the local cloud
                               (trainfleet/run_command.py)
    trainfleet checkpoint list|export RUN ...   a run's checkpoints; its model as safetensors
    trainfleet sample --from DIR|RUN --prompt TEXT   text the trained model writes
                               (trainfleet/checkpoint_command.py)
"""

import argparse
import os
import sys
from pathlib import Path


def _demo(args: argparse.Namespace) -> int:
    if args.trainer_only:
        from trainer.demo import main as trainer_demo

        return trainer_demo(args.rest)
    from localcloud.cloud import exit_after_local_cloud
    from localcloud.demo import main as local_cloud_demo

    exit_after_local_cloud(local_cloud_demo(args.rest))


def _validate(args: argparse.Namespace) -> int:
    from trainfleet.validate import validate

    return validate()


LAYOUT_OPTIONS = ("pp", "dp", "tp", "dp_shard", "microbatches", "activation_checkpoint")
"""Layout fields `trainfleet plan` takes on the command line; those given are kept, the others chosen."""


def _plan(args: argparse.Namespace) -> int:
    from dataclasses import asdict, replace

    from trainer.config import ConfigError, load_config
    from trainfleet import memory_plan as mp
    from trainfleet.catalogue import UnknownInstanceType, instance_facts

    try:
        facts = instance_facts(args.instance_type)
        config = load_config(["--config", str(args.model)])
    except (UnknownInstanceType, ConfigError) as error:
        print(f"trainfleet plan: {error}", file=sys.stderr)
        return 2
    given = {name: getattr(args, name) for name in LAYOUT_OPTIONS if getattr(args, name) is not None}
    if args.schedule is not None:
        given["schedule"] = args.schedule
    gpu = facts.accelerator != "none"
    workload = mp.Workload.from_sections(asdict(config), mixed_precision=gpu, accelerator=facts.accelerator)
    workload = replace(workload, layout=replace(workload.layout, **given))
    shape, rpn = workload.shape, facts.ranks_per_node
    print(f"model {args.model}: {mp.parameter_count(shape) / 1e9:.2f} B parameters ({shape.n_layers} layers, "
          f"d_model {shape.d_model}, {shape.n_heads} heads, vocab {shape.vocab_size}, seq {shape.seq_len}); "
          f"global batch {workload.layout.batch_size} sequences")
    print(f"fleet: {args.nodes} x {facts.name} ({rpn} ranks per node"
          + (f", {facts.memory_per_rank_gib:g} GiB of {facts.accelerator} each)" if gpu else ", CPU)"))
    # The config file's own layout is checked as it is when it fills the fleet and the command
    # line names none of pp, dp, tp; otherwise the planner chooses what the command line left free.
    as_configured = workload.layout.world_size == args.nodes * rpn and not {"pp", "dp", "tp"} & set(given)
    fixed = frozenset(LAYOUT_OPTIONS + ("schedule",)) if as_configured else frozenset(given)
    if not gpu:
        candidate = next(mp.plan_layouts(workload, args.nodes, rpn, fixed), None)
        if candidate is None:
            print(f"trainfleet plan: no layout of this config runs on {args.nodes * rpn} ranks", file=sys.stderr)
            return 1
        print(f"layout: {candidate.workload.layout.describe()}")
        print(mp.format_memory(candidate.memory, None))
        print(f"{facts.name} has no accelerator: local runs use host memory, which is not checked")
        return 0
    memory_gib = facts.memory_per_rank_gib
    candidates = list(mp.plan_layouts(workload, args.nodes, rpn, fixed))
    if not candidates:
        print(f"trainfleet plan: no layout of this config runs on {args.nodes} x {rpn} GPUs "
              f"(keeping {', '.join(sorted(fixed)) or 'nothing'})", file=sys.stderr)
        return 1
    fitting = [c for c in candidates if c.memory.total <= memory_gib * mp.GIB]
    shown = fitting[0] if fitting else min(candidates, key=lambda c: c.memory.total)
    origin = "as configured" if as_configured else "planned"
    print(f"layout ({origin}): {shown.workload.layout.describe()}")
    print(mp.format_memory(shown.memory, memory_gib))
    if fitting:
        print(f"fits: {shown.memory.total / mp.GIB:.2f} of {memory_gib} GiB on the fullest GPU")
        return 0
    print(f"DOES NOT FIT: {shown.memory.total / mp.GIB:.2f} GiB needed on the fullest GPU, {memory_gib} GiB there"
          + ("" if as_configured else f" (the least of {len(candidates)} layouts on {args.nodes} nodes)"))
    # dp follows from the fleet's size, so the proposal frees it; what else was given stays.
    smallest = mp.smallest_fleet(workload, rpn, memory_gib, args.max_nodes, frozenset(given) - {"dp"})
    if smallest is None:
        print(f"no layout fits on up to {args.max_nodes} nodes of {facts.name}")
    else:
        print(f"smallest fleet that fits: {smallest.nodes} x {facts.name}, "
              f"{smallest.workload.layout.describe()}")
        print(mp.format_memory(smallest.memory, memory_gib))
    return 1


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _add_plan(commands: argparse._SubParsersAction) -> None:
    plan = commands.add_parser(
        "plan", help="memory per GPU of a model and layout; the smallest fleet and layout that fit",
        description="Per-GPU memory of a trainer config on a fleet, by component. Layout fields given here "
                    "are kept; the others are chosen (fewest nodes, then the least activation recompute, then "
                    "the smallest tp, then the smallest pp, then the most microbatches). The config file's own "
                    "layout is checked as is when it fills the fleet and none of --pp/--dp/--tp is given. "
                    "Exits 1 when the layout does not fit.")
    plan.add_argument("--model", type=Path, required=True, help="a trainer config file (.toml, .yaml)")
    plan.add_argument("--instance-type", required=True, help="e.g. p4d.24xlarge, p5.48xlarge")
    plan.add_argument("--nodes", type=_positive, required=True, help="instances in the fleet")
    plan.add_argument("--max-nodes", type=_positive, default=512, help="largest fleet to propose (default: 512)")
    for name in ("pp", "dp", "tp", "microbatches"):
        plan.add_argument(f"--{name.replace('_', '-')}", dest=name, type=_positive)
    plan.add_argument("--dp-shard", type=int, help="0 = all of dp")
    plan.add_argument("--activation-checkpoint", choices=("none", "selective", "full"))
    from trainfleet.contracts import SCHEDULES

    plan.add_argument("--schedule", choices=sorted(SCHEDULES), help="pipeline schedule (default: the config's)")
    plan.set_defaults(func=_plan)


def _local_up(args: argparse.Namespace) -> int:
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
        print(f"local cloud running at {cloud.endpoint}", flush=True)
        print("  " + " ".join(f"{name}={value}" for name, value in cloud.env().items()), flush=True)
        print(f"  instance metadata on port {metadata.port}; instance folders in {cloud.workdir}",
              flush=True)
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


def _chaos(args: argparse.Namespace) -> int:
    import json
    import urllib.error
    import urllib.request

    from trainfleet.chaos import CHAOS_PATH, SERVICE_FAULTS

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
    from trainfleet.chaos import INSTANCE_FAULTS, SERVICE_FAULTS

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
    _add_plan(commands)
    local = commands.add_parser("local", help="the embedded local cloud")
    local_commands = local.add_subparsers(dest="local_command", required=True)
    _add_local_up(local_commands)
    _add_local_deploy(local_commands)
    _add_chaos(commands)
    from trainfleet.checkpoint_command import add_checkpoint_commands
    from trainfleet.run_command import add_run_commands

    add_run_commands(commands)
    add_checkpoint_commands(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
