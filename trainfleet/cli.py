"""The `trainfleet` command.

    trainfleet demo            a training run on the local cloud: a node lost, replaced, resumed
    trainfleet demo --trainer-only   the trainer alone: pp=2 under torchrun on this machine
    trainfleet validate        sam validate --lint and statelint on what users deploy
    trainfleet plan --model trainer/configs/jurassic-1-jumbo.toml --instance-type p4d.24xlarge --nodes 64
                               the fastest layouts that fit a fleet: predicted step, MFU, memory per GPU
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
    trainfleet checkpoint list|export RUN ...   a run's checkpoints; its model as Hugging Face's
    trainfleet checkpoint import SOURCE --to LOCATION --config FILE   and a Hugging Face model in
    trainfleet sample --from DIR|RUN --prompt TEXT [--greedy]   text the trained model writes
                               (trainfleet/operator/checkpoint_command.py)
    trainfleet data prepare INPUT... --tokenizer FILE --to DEST [--on-stack]
                               token shards from JSON Lines, Parquet or text, on this machine's
                               cores or the stack's DataPrep state machine
                               (trainfleet/operator/data_command.py)
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


LAYOUT_OPTIONS = ("pp", "dp", "tp", "dp_shard", "microbatches", "activation_checkpoint", "schedule")
"""Layout fields `trainfleet plan` takes on the command line; those given are kept, the others chosen."""

RANKED = 3
"""How many of the fastest layouts that fit `trainfleet plan` shows."""


def _plan(args: argparse.Namespace) -> int:
    from dataclasses import asdict, replace

    from trainer.config import ConfigError, load_config
    from trainfleet.core import memory_plan as mp
    from trainfleet.core.catalogue import UnknownInstanceType, instance_facts
    from trainfleet.core.hardware import UnmodelledInstanceType, ec2_cluster

    try:
        facts = instance_facts(args.instance_type)
        config = load_config(["--config", str(args.model)])
    except (UnknownInstanceType, ConfigError) as error:
        print(f"trainfleet plan: {error}", file=sys.stderr)
        return 2
    given = {name: getattr(args, name) for name in LAYOUT_OPTIONS if getattr(args, name) is not None}
    gpu = facts.accelerator != "none"
    workload = mp.Workload.from_sections(asdict(config), mixed_precision=gpu, accelerator=facts.accelerator)
    workload = replace(workload, layout=replace(workload.layout, **given))
    shape, rpn = workload.shape, facts.ranks_per_node
    kv = f" sharing {shape.n_kv_heads} key/value heads" if shape.n_kv_heads not in (0, shape.n_heads) else ""
    print(f"model {args.model}: {mp.parameter_count(shape) / 1e9:.2f} B parameters ({shape.architecture}: "
          f"{shape.n_layers} layers, d_model {shape.d_model}, {shape.n_heads} heads{kv}, MLP {shape.hidden}, "
          f"vocab {shape.vocab_size}, seq {shape.seq_len}); global batch {workload.layout.batch_size} sequences")
    print(f"fleet: {args.nodes} x {facts.name} ({rpn} ranks per node"
          + (f", {facts.memory_per_rank_gib:g} GiB of {facts.accelerator} each)" if gpu else ", CPU)"))
    # The config file's own layout is checked as it is when it fills the fleet and the command
    # line names none of pp, dp, tp, and then compared with the fastest; a layout given in full is
    # checked as given; otherwise the planner chooses what the command line left free.
    as_configured = workload.layout.world_size == args.nodes * rpn and not {"pp", "dp", "tp"} & set(given)
    fixed = frozenset(LAYOUT_OPTIONS) if as_configured else frozenset(given)
    if not gpu:
        candidate = next(mp.plan_layouts(workload, args.nodes, rpn, fixed), None)
        if candidate is None:
            print(f"trainfleet plan: no layout of this config runs on {args.nodes * rpn} ranks", file=sys.stderr)
            return 1
        print(f"layout: {candidate.workload.layout.describe()}")
        print(mp.format_memory(candidate.memory, None))
        print(f"{facts.name} has no accelerator: local runs use host memory, which is not checked")
        return 0
    # Said where the figures are read: what they rest on (README, "What has been proven").
    print("estimates: the GPU constants (CUDA's usable memory, NCCL's buffers, the kernels' rates) are "
          "published figures, not yet measured on a GPU (bench/gpu.py, docs/BENCHMARKS.md)")
    try:
        cluster = ec2_cluster(facts)
    except UnmodelledInstanceType as error:
        print(f"{error}: layouts are planned by memory alone")
        return _check_layout(args, facts, workload, given, fixed, None, "planned")
    if as_configured or fixed == frozenset(LAYOUT_OPTIONS):
        code = _check_layout(args, facts, workload, given, fixed, cluster,
                             "as configured" if as_configured else "as given")
        if code or not as_configured:
            return code
    return _rank_layouts(args, facts, workload, given, frozenset() if as_configured else fixed, cluster,
                         show_memory=not as_configured)


def _check_layout(args: argparse.Namespace, facts, workload, given: dict, fixed: frozenset[str], cluster,
                  origin: str) -> int:
    """The first layout the memory planner takes, its memory and, with a cluster, its predicted step."""
    from trainfleet.core import memory_plan as mp
    from trainfleet.core import step_time as st

    memory_gib = facts.memory_per_rank_gib
    candidates = list(mp.plan_layouts(workload, args.nodes, facts.ranks_per_node, fixed))
    if not candidates:
        print(f"trainfleet plan: no layout of this config runs on {args.nodes} x {facts.ranks_per_node} GPUs "
              f"(keeping {', '.join(sorted(fixed)) or 'nothing'})", file=sys.stderr)
        return 1
    fitting = [c for c in candidates if c.memory.total <= memory_gib * mp.GIB]
    shown = fitting[0] if fitting else min(candidates, key=lambda c: c.memory.total)
    print(f"layout ({origin}): {shown.workload.layout.describe()}")
    print(mp.format_memory(shown.memory, memory_gib))
    if cluster is not None:
        print(f"predicted step on {_cluster_line(cluster, args.nodes)}:")
        print(st.format_step_time(st.predict(shown.workload, cluster)))
    if not fitting:
        return _does_not_fit(args, facts, workload, shown, given, origin == "as configured", len(candidates))
    print(f"fits: {shown.memory.total / mp.GIB:.2f} of {memory_gib} GiB on the fullest GPU")
    return 0


def _rank_layouts(args: argparse.Namespace, facts, workload, given: dict, fixed: frozenset[str], cluster,
                  show_memory: bool) -> int:
    """The fastest layouts that fit, each with its predicted step (and the fastest one's memory)."""
    from trainfleet.core import memory_plan as mp
    from trainfleet.core import step_time as st

    memory_gib = facts.memory_per_rank_gib
    ranked, runnable = st.fastest_layouts(workload, cluster, args.nodes, memory_gib, fixed, RANKED)
    if not runnable:
        print(f"trainfleet plan: no layout of this config runs on {args.nodes} x {facts.ranks_per_node} GPUs "
              f"(keeping {', '.join(sorted(fixed)) or 'nothing'})", file=sys.stderr)
        return 1
    if not ranked:
        least = min((mp.Candidate(args.nodes, w, mp.fullest_rank(w))
                     for w in st.layouts(workload, args.nodes, facts.ranks_per_node, fixed)),
                    key=lambda c: c.memory.total)
        print(f"layout (planned, the least memory): {least.workload.layout.describe()}")
        print(mp.format_memory(least.memory, memory_gib))
        return _does_not_fit(args, facts, workload, least, given, False, runnable)
    print(f"fastest layouts that fit on {_cluster_line(cluster, args.nodes)} ({len(ranked)} of {runnable:,} "
          f"that run there):")
    for place, best in enumerate(ranked, 1):
        print(f"{place}. {best.candidate.workload.layout.describe()}: {best.candidate.memory.total / mp.GIB:.2f} "
              f"of {memory_gib} GiB")
        print(st.format_step_time(best.step))
    if show_memory:
        print("the fastest, on its fullest GPU:")
        print(mp.format_memory(ranked[0].candidate.memory, memory_gib))
    return 0


def _cluster_line(cluster, nodes: int) -> str:
    return (f"{nodes} x {cluster.name} ({cluster.gpus_per_node} x {cluster.gpu.name}, "
            f"{cluster.network_gbits_per_s:,.0f} Gb/s a node)")


def _does_not_fit(args: argparse.Namespace, facts, workload, shown, given: dict, as_configured: bool,
                  runnable: int) -> int:
    """Says so, with the smallest fleet that fits instead; exits 1."""
    from trainfleet.core import memory_plan as mp

    memory_gib = facts.memory_per_rank_gib
    print(f"DOES NOT FIT: {shown.memory.total / mp.GIB:.2f} GiB needed on the fullest GPU, {memory_gib} GiB there"
          + ("" if as_configured else f" (the least of {runnable} layouts on {args.nodes} nodes)"))
    # dp follows from the fleet's size, so the proposal frees it; what else was given stays.
    smallest = mp.smallest_fleet(workload, facts.ranks_per_node, memory_gib, args.max_nodes, frozenset(given) - {"dp"})
    if smallest is None:
        print(f"no layout fits on up to {args.max_nodes} nodes of {facts.name}")
    else:
        print(f"smallest fleet that fits: {smallest.nodes} x {facts.name}, {smallest.workload.layout.describe()}")
        print(mp.format_memory(smallest.memory, memory_gib))
    return 1


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _add_plan(commands: argparse._SubParsersAction) -> None:
    plan = commands.add_parser(
        "plan", help="the fastest layouts of a model that fit a fleet: predicted step, MFU and memory per GPU",
        description="The layouts of a trainer config that fit in the GPUs' memory on --nodes nodes, ranked by "
                    "the tokens a second the step-time model predicts (trainfleet/core/step_time.py): the "
                    f"{RANKED} fastest with their step time, MFU and each term, and the fastest one's memory by "
                    "component. Layout fields given here are kept, the others chosen; a layout given in full "
                    "(--pp --tp --dp --dp-shard --microbatches --activation-checkpoint --schedule) is checked "
                    "and predicted as given. The config file's own layout is checked as is, and then compared "
                    "with the fastest, when it fills the fleet and none of --pp/--dp/--tp is given. "
                    "Exits 1 when no layout fits, with the smallest fleet on which one does.")
    plan.add_argument("--model", type=Path, required=True, help="a trainer config file (.toml, .yaml)")
    plan.add_argument("--instance-type", required=True, help="e.g. p4d.24xlarge, p5.48xlarge")
    plan.add_argument("--nodes", type=_positive, required=True, help="instances in the fleet")
    plan.add_argument("--max-nodes", type=_positive, default=512, help="largest fleet to propose (default: 512)")
    for name in ("pp", "dp", "tp", "microbatches"):
        plan.add_argument(f"--{name.replace('_', '-')}", dest=name, type=_positive)
    plan.add_argument("--dp-shard", type=int, help="0 = all of dp")
    plan.add_argument("--activation-checkpoint", choices=("none", "selective", "full"))
    from trainer.schedules import SCHEDULES

    plan.add_argument("--schedule", choices=sorted(SCHEDULES), help="pipeline schedule (default: the fastest)")
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
    from trainfleet.operator.data_command import add_data_commands
    from trainfleet.operator.run_command import add_run_commands

    add_local_commands(commands)
    add_run_commands(commands)
    add_checkpoint_commands(commands)
    add_data_commands(commands)
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
