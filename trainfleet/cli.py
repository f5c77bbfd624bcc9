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
                               (these three, and the demo's run, are the local cloud's own:
                               localcloud/commands.py, the one module of it this command imports)
    trainfleet run start|list|status|watch|logs|stop|report ...
                               the runs of a deployed stack, on AWS or the local cloud
                               (trainfleet/operator/run_command.py)
    trainfleet checkpoint list|export RUN ...   a run's checkpoints; its model as safetensors
    trainfleet sample --from DIR|RUN --prompt TEXT   text the trained model writes
                               (trainfleet/operator/checkpoint_command.py)
"""

import argparse
import sys
from pathlib import Path


def _demo(args: argparse.Namespace) -> int:
    if args.trainer_only:
        from trainer.demo import main as trainer_demo

        return trainer_demo(args.rest)
    from localcloud.commands import demo

    return demo(args.rest)


def _validate(args: argparse.Namespace) -> int:
    from trainfleet.operator.validate import validate

    return validate()


LAYOUT_OPTIONS = ("pp", "dp", "tp", "dp_shard", "microbatches", "activation_checkpoint")
"""Layout fields `trainfleet plan` takes on the command line; those given are kept, the others chosen."""


def _plan(args: argparse.Namespace) -> int:
    from dataclasses import asdict, replace

    from trainer.config import ConfigError, load_config
    from trainfleet.core import memory_plan as mp
    from trainfleet.core.catalogue import UnknownInstanceType, instance_facts

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
    # Said where the figures are read: what they rest on (README, "What has been proven").
    print("estimates: the GPU constants (CUDA's usable memory, NCCL's buffers) are published figures, "
          "not yet measured on a GPU (bench/gpu.py, docs/BENCHMARKS.md)")
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
    from trainer.schedules import SCHEDULES

    plan.add_argument("--schedule", choices=sorted(SCHEDULES), help="pipeline schedule (default: the config's)")
    plan.set_defaults(func=_plan)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trainfleet", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    what = "a training run on the local cloud, a node lost and replaced"
    demo = commands.add_parser("demo", help=what, description=what)
    demo.add_argument("--trainer-only", action="store_true",
                      help="only the trainer: pp=2 under torchrun on this machine, no cloud")
    demo.add_argument("rest", nargs=argparse.REMAINDER,
                      help="after --: the local run's --run-spec/--workdir/--timeout, or with --trainer-only the trainer's overrides")
    demo.set_defaults(func=_demo)
    what = "check template.yaml and the state machine: sam validate --lint and statelint"
    validate = commands.add_parser("validate", help=what, description=what)
    validate.set_defaults(func=_validate)
    _add_plan(commands)
    from localcloud.commands import add_local_commands
    from trainfleet.operator.checkpoint_command import add_checkpoint_commands
    from trainfleet.operator.run_command import add_run_commands

    add_local_commands(commands)
    add_run_commands(commands)
    add_checkpoint_commands(commands)
    return parser


REFERENCE_PAGES = {"docs/RUNSPEC.md": "runspec", "docs/CLI.md": "cli"}
"""The reference pages made from the code (trainfleet/operator/reference.py), by path in the repository."""


def reference_pages() -> dict[str, str]:
    """Each reference page's text, by its path in the repository."""
    from trainfleet.operator.reference import cli_page, runspec_page

    made = {"runspec": runspec_page, "cli": lambda: cli_page(build_parser())}
    return {path: made[page]() for path, page in REFERENCE_PAGES.items()}


def write_reference_pages(root: Path = Path(__file__).resolve().parent.parent) -> None:
    """`make docs`: write the reference pages into the repository at `root`."""
    for path, text in reference_pages().items():
        (root / path).write_text(text)
        print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
