"""A run as a person follows it in a terminal: `trainfleet run status` prints the view once,
`trainfleet run watch` (and `make demo`) keeps it live until the run ends.

    console.print(view(stack.status("my-run")))
    final = watch(stack, "my-run", console)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from datetime import datetime

from rich.console import Console, ConsoleOptions, RenderableType, RenderResult
from rich.live import Live
from rich.measure import Measurement
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from trainfleet.core.records import FailureRecord, RunState
from trainfleet.core.run_history import resumed_step
from trainfleet.operator.runs import RunStatus, Stack

__all__ = ["view", "watch", "Parts", "REFRESH_S"]

REFRESH_S = 2.0
"""How often `watch` reads the run: a few reads of DynamoDB and Step Functions each time."""

_STATE_STYLE = {"SUCCEEDED": "bold green", "FAILED": "bold red", "STOPPED": "bold yellow", "RECOVERING": "bold yellow",
                "TEARING_DOWN": "yellow", "TRAINING": "bold cyan"}


def view(status: RunStatus) -> RenderableType:
    """The run's state, attempt, progress, loss, throughput, checkpoint, nodes, goodput, cost,
    checks and failures: one field a line, its label on the left. A value breaks between its
    parts, never inside one, so the view reads at 80 columns as at 200."""
    rows = Table.grid(padding=(0, 2))
    rows.add_column(style="dim", justify="right", no_wrap=True)
    rows.add_column()
    for label, value in _fields(status):
        rows.add_row(label, value)
    return Panel(rows, title=_title(status), title_align="left", subtitle=_subtitle(status), subtitle_align="right")


class Parts:
    """A value made of parts, laid out in the width it is given: as many parts a line as fit,
    a line broken only between two parts (a part too long for a line of its own wraps at its
    words)."""

    def __init__(self, *parts: str | Text, separator: str = ", "):
        self.parts = [Text(part) if isinstance(part, str) else part for part in parts]
        self.separator = separator

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        line = Text()
        for part in self.parts:
            if line and line.cell_len + len(self.separator) + part.cell_len > options.max_width:
                yield line.append(self.separator.rstrip())
                line = Text()
            elif line:
                line.append(self.separator)
            line.append_text(part)
        yield line

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        whole = sum(part.cell_len for part in self.parts) + len(self.separator) * (len(self.parts) - 1)
        return Measurement(max((part.cell_len for part in self.parts), default=0), whole).clamp(
            max_width=options.max_width)


def _fields(status: RunStatus) -> Iterator[tuple[str, RenderableType]]:
    record, ledger = status.record, status.ledger
    if record is not None:
        yield "progress", _progress(status)
        if status.latest:
            attempt, sample = status.latest
            yield "loss", Parts(f"{sample.loss:.4f}", f"attempt {attempt} at {_clock(sample.at)}")
            yield "speed", Parts(f"{sample.tokens_per_second:,.0f} tokens/s", f"{sample.step_seconds:.2f} s/step")
        checkpoint = record.latest_checkpoint
        yield "checkpoint", (Parts(f"step {checkpoint.step}", *([f"committed {_clock(checkpoint.committed_at)}"]
                                                                 if checkpoint.committed_at else []))
                             if checkpoint else Text("none yet"))
        yield "nodes", Parts(*_nodes(status), separator="; ")
        lost = max(ledger.lost_by_cause.items(), key=lambda item: item[1], default=None)
        yield "goodput", Parts(f"{ledger.goodput:.0%}{' so far' if status.running else ''}",
                               f"{ledger.lost_seconds:,.0f} s lost",
                               *([f"most to {lost[0]}: {lost[1]:,.0f} s"] if lost else []))
        yield "cost", Parts(f"${ledger.cost_usd:,.2f}", f"{ledger.node_seconds / 3600:,.2f} node-hours")
        for name, figures in (("fleet check", status.fleet_check), ("scaling check", status.scaling_check)):
            if figures is not None:
                verdict = Text("passed" if figures.passed else "FAILED", style="green" if figures.passed else "bold red")
                yield name, Parts(Text.assemble(verdict, f" (attempt {figures.attempt})"), *figures.clauses(),
                                  separator="; ")
        for failure in status.failures:
            attempt = f"attempt {failure.attempt}" if failure.attempt is not None else "an attempt"
            yield "failure", Parts(Text.assemble((failure.failure_class.value, "yellow"), f" ended {attempt}"),
                                   *([f"detected after {failure.detection_seconds:,.1f} s"]
                                     if failure.detection_seconds is not None else []),
                                   *([failure.recovery.value] if failure.recovery is not None else []),
                                   _resumed_from(failure))
    if status.recent_states:
        yield "states", Parts(*(f"{entry.name} {_clock(entry.at)}" for entry in status.recent_states[-5:]),
                              separator=" → ")
    if status.error and status.state is RunState.STOPPED:  # on purpose: the stop's cause, not an error
        yield "stopped", Text(status.error)
    elif status.error:
        yield "error", Text(status.error, style="red")


def watch(stack: Stack, run_name: str, console: Console, refresh_s: float = REFRESH_S,
          on_look: Callable[[RunStatus], None] | None = None) -> RunStatus:
    """Keep the view live until the run's execution ends (Ctrl-C stops watching, not the run);
    `on_look` sees each status read (the demo acts on it, and may stop the watch by raising).
    The last status read."""
    try:
        return _follow(stack, run_name, console, refresh_s, on_look)
    finally:
        if not console.is_terminal:
            console.line()  # Live leaves its last render unterminated there


def _follow(stack: Stack, run_name: str, console: Console, refresh_s: float,
            on_look: Callable[[RunStatus], None] | None) -> RunStatus:
    status = stack.status(run_name)
    # Not redirected: a process that runs the local cloud has its stdout replaced by the Lambda
    # runtime's per-thread capture, and a second redirection would write into itself. What is
    # said while the view is live goes through `console`, which prints above it. Refreshed after
    # each read, since nothing changes between reads.
    with Live(view(status), console=console, auto_refresh=False, transient=False, redirect_stdout=False,
              redirect_stderr=False) as live:
        while True:
            if on_look is not None:
                on_look(status)
            if not status.running:
                return status
            time.sleep(refresh_s)
            status = stack.status(run_name)
            live.update(view(status), refresh=True)


def _title(status: RunStatus) -> Text:
    state = status.state.value if status.state else status.execution_status
    title = Text.assemble(("run ", "bold"), (status.run_name, "bold"), "  ", (state, _STATE_STYLE.get(state, "bold")))
    if status.record is not None:
        title.append(f"  attempt {status.record.attempt}, {status.record.restarts} restart"
                     f"{'s' if status.record.restarts != 1 else ''}")
    return title


def _subtitle(status: RunStatus) -> str:
    end = status.stopped_at or status.now
    return f"execution {status.execution_status}, {_duration((end - status.started_at).total_seconds())}"


def _progress(status: RunStatus) -> RenderableType:
    step = status.record.last_step if status.record else None
    target = status.target_steps
    line = Table.grid(padding=(0, 1))
    line.add_row(ProgressBar(total=target or 1, completed=min(step or 0, target or 1), width=24),
                 Text(f"step {step if step is not None else '-'}" + (f" of {target}" if target else "")
                      + ("" if status.latest else ", no step yet"), no_wrap=True))
    return line


def _nodes(status: RunStatus) -> list[str]:
    parts = []
    for role, states in status.nodes_by_state.items():
        live = {state: count for state, count in states.items() if state not in ("TERMINATED",)}
        if live:
            parts.append(f"{role.lower()}s " + ", ".join(f"{count} {state}" for state, count in sorted(live.items())))
    parts += [f"replaced {node.instance_id} ({node.failure_class.value})" for node in status.replaced]
    ended = sum(states.get("TERMINATED", 0) for states in status.nodes_by_state.values())
    if ended:
        parts.append(f"{ended} terminated")
    return parts or ["none"]


def _clock(moment: datetime) -> str:
    return moment.strftime("%H:%M:%S")


def _duration(seconds: float) -> str:
    minutes, seconds = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{seconds:02d}" if hours else f"{minutes}:{seconds:02d}"


def _resumed_from(failure: FailureRecord) -> str:
    step = resumed_step(failure)
    where = " (host memory)" if failure.restored is not None and failure.restored.source == "memory" else ""
    return f"resumed from step {step}{where}" if step is not None else "resumed from scratch"
