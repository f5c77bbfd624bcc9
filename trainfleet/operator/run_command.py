"""`trainfleet run`: start, follow and inspect the training runs of a deployed stack.

    trainfleet run start events/example-run.json [--watch] [--run-name NAME] [--resume-from RUN]
    trainfleet run list
    trainfleet run status RUN          the live view, once
    trainfleet run watch RUN           the live view until the run ends
    trainfleet run logs RUN [--node INSTANCE_ID|NODE_RANK] [--json]
    trainfleet run stop RUN            StopExecution; returns once every instance is terminated
    trainfleet run report RUN [--out DIR]

AWS or the local cloud, one code path: the endpoint, region and credentials come from the
environment as the AWS CLI takes them (`trainfleet local up` prints the lines that point them at
it); --stack after the command (or TRAINFLEET_STACK) names the deployed stack. A command that
cannot be done says why in one line and exits 1, having changed nothing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from botocore.exceptions import BotoCoreError, ClientError

__all__ = ["add_run_commands"]

STOP_WAIT_S = 600.0
"""How long `stop` waits for the teardown by default."""


def _start(stack, args: argparse.Namespace, console) -> int:
    from trainfleet.operator.runs import load_run_spec

    spec = load_run_spec(args.run_spec, stack, run_name=args.run_name, resume_from=args.resume_from)
    arn = stack.start(spec)
    console.print(f"started run {spec['run_name']}: {arn}")
    return _watch(stack, argparse.Namespace(run=spec["run_name"]), console) if args.watch else 0


def _list(stack, args: argparse.Namespace, console) -> int:
    from rich.table import Table

    table = Table("run", "execution", "started (UTC)", "state", "attempt", "step", "goodput", box=None)
    for run in stack.runs():
        table.add_row(run.run_name, run.execution_status, run.started_at.strftime("%Y-%m-%d %H:%M:%S"),
                      run.state.value if run.state else "-", _or_dash(run.attempt), _or_dash(run.last_step),
                      f"{run.goodput:.0%}" if run.goodput is not None else "-")
    console.print(table if table.row_count else f"no runs in stack {stack.name}")
    return 0


def _status(stack, args: argparse.Namespace, console) -> int:
    from trainfleet.operator.live_view import view

    console.print(view(stack.status(args.run)))
    return 0


def _watch(stack, args: argparse.Namespace, console) -> int:
    from trainfleet.operator.live_view import watch

    final = watch(stack, args.run, console)
    return 0 if final.execution_status == "SUCCEEDED" else 1


def _logs(stack, args: argparse.Namespace, console) -> int:
    text = (stack.node_log(args.run, args.node, raw=args.json) if args.node is not None
            else "\n".join(stack.logs(args.run, raw=args.json)))
    sys.stdout.write(text + ("" if text.endswith("\n") or not text else "\n"))
    return 0


def _stop(stack, args: argparse.Namespace, console) -> int:
    from trainfleet.operator.live_view import view

    stack.stop(args.run)
    console.print(f"stopped run {args.run}" + ("" if args.no_wait else "; waiting for its teardown"))
    status, left = stack.wait_for_teardown(args.run, 0.0 if args.no_wait else args.timeout)
    console.print(view(status))
    if args.no_wait:
        return 0
    if left:
        console.print(f"not torn down after {args.timeout:.0f} s: {len(left)} instance(s) not terminated yet "
                      f"({', '.join(left)}); `trainfleet run status {args.run}` follows it")
        return 1
    console.print(f"run {args.run} torn down: every instance terminated")
    return 0


def _report(stack, args: argparse.Namespace, console) -> int:
    page = stack.report(args.run, args.out or Path("reports") / args.run)
    console.print(f"report written: {page}")
    return 0


def _or_dash(value: object) -> str:
    return "-" if value is None else str(value)


def _run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from trainfleet.operator.runs import OperatorError, Stack, failure_line

    console = Console()
    try:
        return args.run_func(Stack.find(args.stack), args, console)
    except (OperatorError, ClientError, BotoCoreError) as error:
        print(f"trainfleet run {args.run_command}: {failure_line(error)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def add_run_commands(commands: argparse._SubParsersAction) -> None:
    from trainfleet.operator.stack_option import stack_option

    run = commands.add_parser(
        "run", help="start, follow and inspect training runs (AWS, or the local cloud with AWS_ENDPOINT_URL)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    run.set_defaults(func=_run)
    sub = run.add_subparsers(dest="run_command", required=True)
    stack = stack_option()

    def command(name: str, func, help: str, with_run: bool = True) -> argparse.ArgumentParser:
        parser = sub.add_parser(name, help=help, description=help, parents=[stack])
        if with_run:
            parser.add_argument("run", help="the run's name")
        parser.set_defaults(run_func=func)
        return parser

    start = command("start", _start, "start a run from a RunSpec file", with_run=False)
    start.add_argument("run_spec", type=Path, help="a RunSpec JSON file (events/example-run.json is one)")
    start.add_argument("--watch", action="store_true", help="follow it with the live view")
    start.add_argument("--run-name", help="the run's name, instead of the RunSpec's run_name")
    start.add_argument("--resume-from", metavar="RUN",
                       help="an ended run of the stack to start from: its newest checkpoint, read, never changed "
                            "(RunSpec resume_from)")
    command("list", _list, "the stack's runs, newest first", with_run=False)
    command("status", _status, "where a run is: state, attempt, nodes, step, loss, goodput, cost")
    command("watch", _watch, "the live view, until the run ends (Ctrl-C stops watching, not the run)")
    logs = command("logs", _logs, "the control plane's log lines about the run (time, source, level, message), "
                                  "or a node's: its agent's and its trainer's")
    logs.add_argument("--node", help="an instance id, or a node rank of the current world: that node's log")
    logs.add_argument("--json", action="store_true",
                      help="the log events as CloudWatch Logs holds them, one JSON object a line")
    stop = command("stop", _stop, "stop a running run; returns once every instance of it is terminated")
    stop.add_argument("--no-wait", action="store_true", help="return at once, without waiting for the teardown")
    stop.add_argument("--timeout", type=float, default=STOP_WAIT_S,
                      help=f"seconds to wait for the teardown (default: {STOP_WAIT_S:.0f})")
    report = command("report", _report, "write the run report (HTML page, PNG plots, JSON) to a folder")
    report.add_argument("--out", type=Path, help="the folder (default: reports/RUN)")
