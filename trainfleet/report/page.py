"""The run report for people: one self-contained HTML page, and its plots as PNG files.

    charts = report_charts(history)    # "loss", "throughput", "timeline", "goodput": charts as data
    page = render_html(history)        # report.html: inline CSS and SVG, nothing fetched from anywhere
    pngs = render_pngs(history)        # {"loss.png": b"\\x89PNG...", ...}: the same plots

What the reader sees, without reading a log: a summary (state, fleet, attempts, steps, goodput,
cost); the loss by step, one line per attempt, each failure and resume marked, the steps that
were trained again shaded, and those known trained but never reported shaded apart, saying why
(lost with the node that reports them, or not reported); tokens/s over the run's time, each
attempt's line broken where it did not train; the lifecycle, phase by phase for each attempt, with each
failure's detection (onset to decision) and the replacement up to the resumed training; goodput
by cause; a table of the failures; the world checks' figures. Times are UTC.
"""

from __future__ import annotations

import math
from datetime import datetime, timezone
from html import escape

from trainfleet.core.events import ProgressSample
from trainfleet.core.run_history import AttemptProgress, FailureMark, PhaseName, RunHistory
from trainfleet.report.charts import (BLUE, GREEN, GREY, LIGHT_GREY, ORANGE, PURPLE, SERIES_COLOURS, SKY_BLUE,
                                      VERMILLION, YELLOW, Axis, Bar, Chart, Mark, Series, Span, tint, to_png, to_svg)

__all__ = ["report_charts", "render_html", "render_pngs"]

_PHASE_COLOURS: dict[PhaseName, str] = {
    "validate": LIGHT_GREY, "allocate": BLUE, "await_nodes": SKY_BLUE, "train": GREEN, "recover": ORANGE,
    "backoff": YELLOW, "teardown": PURPLE, "report": GREY}
_PHASE_KEYS: dict[PhaseName, str] = {"await_nodes": "await_nodes (boot, preflight)"}
_DETECTION, _REPLACEMENT = VERMILLION, "#555555"
# Lost causes by their kind (GoodputLedger's list): the part before ':' names it.
_CAUSE_COLOURS = {"startup": SKY_BLUE, "restart": ORANGE, "redone": VERMILLION, "give_up": PURPLE,
                  "finishing": BLUE}


def report_charts(history: RunHistory) -> dict[str, Chart]:
    """The report's four plots, by name."""
    return {"loss": _loss_chart(history), "throughput": _throughput_chart(history),
            "timeline": _timeline_chart(history), "goodput": _goodput_chart(history)}


def render_pngs(history: RunHistory) -> dict[str, bytes]:
    """Each plot as a PNG, by file name (loss.png, throughput.png, timeline.png, goodput.png)."""
    return {f"{name}.png": to_png(chart) for name, chart in report_charts(history).items()}


# -- The charts -------------------------------------------------------------------------------

def _attempt_colour(attempt: int) -> str:
    return SERIES_COLOURS[attempt % len(SERIES_COLOURS)]


def _since_creation(history: RunHistory, at: datetime) -> float:
    return (at - history.created_at).total_seconds()


def _loss_chart(history: RunHistory) -> Chart:
    trained = [progress for progress in history.attempts if progress.samples]
    series = [Series(f"attempt {progress.attempt}", [(sample.step, sample.loss) for sample in progress.samples],
                     _attempt_colour(progress.attempt)) for progress in trained]
    failed = [failure for failure in history.failures if failure.last_step is not None]
    marks = [Mark(failure.last_step, f"{failure.failure_class} after step {failure.last_step:,}", VERMILLION)
             for failure in failed]
    # Every attempt after the first follows a failure: it resumed from a checkpoint, or from scratch.
    marks += [Mark(progress.resume_step or 0, f"resume from step {progress.resume_step:,}"
                   if progress.resume_step is not None else "restart from scratch", _attempt_colour(progress.attempt))
              for progress in trained if progress.attempt > 0]
    redone = [Span(failure.last_step - failure.steps_lost, failure.last_step, tint(VERMILLION, 0.18),
                   "steps trained again after a failure") for failure in failed if failure.steps_lost]
    unknown = [Span(progress.unknown_steps[0] - 1, progress.unknown_steps[1], tint(GREY, 0.35), _unknown(progress))
               for progress in history.attempts if progress.unknown_steps]
    return Chart("Loss by step", Axis("step"), Axis("training loss"), series=series, marks=marks,
                 spans=unknown + redone, empty_note="no steps reported")


def _unknown(progress: AttemptProgress) -> str:
    """What the band of an attempt's unreported steps says: which steps, and why their losses are unknown."""
    first, last = progress.unknown_steps
    steps = f"losses of steps {first:,}-{last:,}"
    if progress.reporter_lost:
        return f"{steps}: lost with {progress.reporter}, which reports them"
    return f"{steps}: never reported by {progress.reporter}" if progress.reporter else f"{steps}: none reported"


def _throughput_chart(history: RunHistory) -> Chart:
    extent = max(_since_creation(history, history.until), 1.0)
    series = [Series(f"attempt {progress.attempt}", _with_gaps(history, progress.samples, extent),
                     _attempt_colour(progress.attempt)) for progress in history.attempts if progress.samples]
    marks = [Mark(_since_creation(history, failure.onset_at or failure.decided_at), str(failure.failure_class),
                  VERMILLION) for failure in history.failures]
    return Chart("Throughput over the run", Axis("time since the run's creation", seconds=True, limits=(0.0, extent)),
                 Axis("tokens/s (whole world)", from_zero=True), series=series, marks=marks,
                 empty_note="no steps reported")


def _with_gaps(history: RunHistory, samples: list[ProgressSample], extent: float) -> list[tuple[float, float]]:
    """An attempt's tokens/s over the run's time, the line broken where it did not train: where
    the time between two samples exceeds what the steps between them took (by their own step
    times) by more than a hundredth of the chart (a shorter pause would not show)."""
    points: list[tuple[float, float]] = []
    for before, sample in zip([None, *samples], samples):
        at = _since_creation(history, sample.at)
        if before is not None:
            idle = (sample.at - before.at).total_seconds() - (sample.step - before.step) * max(
                before.step_seconds, sample.step_seconds)
            if idle > extent / 100:
                points.append(((points[-1][0] + at) / 2, math.nan))
        points.append((at, sample.tokens_per_second))
    return points


def _recovery_end(history: RunHistory, failure: FailureMark) -> tuple[datetime | None, bool]:
    """When the recovery from `failure` ended, and whether it ended with training resumed: the
    next attempt's training, else the next failure (a replacement that failed in its turn), else
    now for a live run still recovering (None for a run that gave up)."""
    trains = [phase.started_at for phase in history.phases
              if phase.name == "train" and phase.attempt > failure.attempt and phase.started_at >= failure.decided_at]
    later = [other.onset_at or other.decided_at for other in history.failures
             if (other.onset_at or other.decided_at) > failure.decided_at]
    ends = sorted([(at, True) for at in trains] + [(at, False) for at in later])
    if ends:
        return ends[0]
    return (None, False) if history.state.is_final else (history.until, False)


def _timeline_chart(history: RunHistory) -> Chart:
    def since(at: datetime) -> float:
        return _since_creation(history, at)

    bars = [Bar(f"attempt {phase.attempt}", since(phase.started_at), since(phase.ended_at), _PHASE_COLOURS[phase.name],
                phase.name, _PHASE_KEYS.get(phase.name, phase.name))
            for phase in sorted(history.phases, key=lambda phase: (phase.attempt, phase.started_at))]
    marks = []
    for failure in history.failures:
        detected = (f"detected in {_duration(failure.detection_seconds)}" if failure.detection_seconds is not None
                    else "onset unseen")
        marks.append(Mark(since(failure.onset_at or failure.decided_at), f"{failure.failure_class} ({detected})",
                          VERMILLION))
        if failure.onset_at is not None:
            bars.append(Bar("recovery", since(failure.onset_at), since(failure.decided_at), _DETECTION,
                            "detect", "detection (onset to decision)"))
        ended_at, resumed = _recovery_end(history, failure)
        if ended_at is not None:
            replaced = failure.blamed
            bars.append(Bar("recovery", since(failure.decided_at), since(ended_at), _REPLACEMENT,
                            f"replace {replaced} node{'s' if replaced != 1 else ''}" if replaced else "restart",
                            "replacement and restart (decision to training)"))
        if resumed:
            resumed_from = (f"resume from step {failure.resume_step:,}{' (host memory)' if failure.from_memory else ''}"
                            if failure.resume_step is not None else "restart from scratch")
            marks.append(Mark(since(ended_at), resumed_from, _attempt_colour(failure.attempt + 1)))
    end = max(since(history.until), 1.0)
    return Chart("Lifecycle", Axis("time since the run's creation", seconds=True, limits=(0.0, end)),
                 bars=bars, marks=marks, empty_note="no state entered yet")


def _goodput_chart(history: RunHistory) -> Chart:
    causes = sorted(history.lost_by_cause.items(), key=lambda item: item[1], reverse=True)
    rows = [("productive", history.productive_seconds, GREEN)] + [
        (cause, seconds, _CAUSE_COLOURS.get(cause.split(":")[0], GREY)) for cause, seconds in causes]
    total = sum(seconds for _, seconds, _ in rows)
    bars = [Bar(name, 0.0, seconds, colour, f"{_duration(seconds)} ({seconds / total:.0%})")
            for name, seconds, colour in rows] if total > 0 else []
    title = (f"Goodput {history.goodput:.0%}: {history.steps_lost:,} steps lost, cost {_usd(history.cost_usd)} "
             f"({_node_hours(history.node_seconds)})")
    return Chart(title, Axis("wall-clock time, productive or lost by cause", seconds=True, from_zero=True),
                 bars=bars, empty_note="no time booked yet")


# -- Words and numbers ------------------------------------------------------------------------

def _utc(at: datetime) -> str:
    at = at.replace(tzinfo=timezone.utc) if at.tzinfo is None else at.astimezone(timezone.utc)
    return at.strftime("%Y-%m-%d %H:%M:%S UTC")


def _duration(seconds: float) -> str:
    """Two units at most: 1.6 s, 44 s, 1 min 10 s, 3 h 5 min, 12 d 4 h."""
    if seconds < 10:
        return f"{seconds:.1f} s"
    whole = round(seconds)
    for big, big_name, small, small_name in ((86400, "d", 3600, "h"), (3600, "h", 60, "min"), (60, "min", 1, "s")):
        if whole >= big:
            rest = (whole % big) // small
            return f"{whole // big} {big_name}" + (f" {rest} {small_name}" if rest else "")
    return f"{whole} s"


def _significant(value: float, digits: int) -> str:
    """`value` to `digits` significant digits, as a plain decimal (never 4.4e-05)."""
    if value == 0:
        return "0"
    return f"{value:,.{max(0, digits - 1 - math.floor(math.log10(abs(value))))}f}"


def _usd(amount: float) -> str:
    """Cents from a dollar up; two significant digits below it (a short local run costs $0.0038)."""
    return f"${amount:,.2f}" if amount >= 1 or amount == 0 else f"${_significant(amount, 2)}"


def _node_hours(node_seconds: float) -> str:
    return f"{_significant(node_seconds / 3600, 3)} node-hours"


def _attempt_count(history: RunHistory) -> int:
    seen = [item.attempt for item in [*history.phases, *history.attempts, *history.failures]]
    return max(seen, default=0) + 1


# -- The page ---------------------------------------------------------------------------------

_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif; color: #222;
       background: #fff; max-width: 1000px; margin: 0 auto; padding: 24px 16px 48px; line-height: 1.45; }
h1 { font-size: 1.5rem; margin: 0 0 8px; overflow-wrap: anywhere; }
h2 { font-size: 1.1rem; margin: 32px 0 8px; }
.state { font-size: .85rem; padding: 2px 8px; border-radius: 4px; vertical-align: middle; color: #fff;
         background: #0072B2; }
.state.SUCCEEDED { background: #007A5A; }
.state.FAILED { background: #B34E00; }
.state.STOPPED { background: #555555; }
.error { border-left: 4px solid #D55E00; background: #FBEEE6; padding: 8px 12px; white-space: pre-wrap;
         overflow-wrap: anywhere; }
dl.summary { display: grid; grid-template-columns: repeat(auto-fill, minmax(210px, 1fr)); gap: 10px 24px;
             margin: 16px 0 28px; }
dl.summary div { border-top: 1px solid #ddd; padding-top: 4px; }
dt { font-size: .8rem; color: #555; }
dd { margin: 0; font-weight: 600; }
figure { margin: 0 0 24px; }
figure svg { display: block; width: 100%; height: auto; }
table { border-collapse: collapse; width: 100%; font-size: .88rem; }
th, td { text-align: left; padding: 5px 8px; border-bottom: 1px solid #ddd; vertical-align: top; }
th { font-weight: 600; color: #555; border-bottom-color: #999; }
td.number { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
td.message { overflow-wrap: anywhere; }
.id { white-space: nowrap; }
.passed { color: #007A5A; font-weight: 600; }
.not-passed { color: #B34E00; font-weight: 600; }
footer { color: #666; font-size: .8rem; margin-top: 36px; }
"""


def render_html(history: RunHistory) -> str:
    """The whole page: nothing in it is fetched (no script, style sheet, font or image from
    anywhere), so it reads the same from S3, a local folder or an e-mail attachment."""
    figures = "\n".join(f'<figure id="{name}-chart">\n{to_svg(chart, name)}\n</figure>'
                        for name, chart in report_charts(history).items())
    state = history.state.value
    error = f'<p class="error">{escape(history.error)}</p>\n' if history.error else ""
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8"/>
<meta name="viewport" content="width=device-width, initial-scale=1"/>
<title>{escape(history.run_name)}: {state}</title>
<style>{_CSS}</style>
</head>
<body>
<header>
<h1>{escape(history.run_name)} <span class="state {state}">{state}</span></h1>
{_resumed(history)}{error}{_summary(history)}
</header>
{figures}
<h2>Failures</h2>
{_failures_table(history)}
<h2>World checks</h2>
{_checks(history)}
<footer>trainfleet run report, {"as of" if not history.state.is_final else "up to the run's end at"} \
{_utc(history.until)}</footer>
</body>
</html>
"""


def _resumed(history: RunHistory) -> str:
    """Where the run started from, when it resumed another: that run's report, beside this one
    (runs/RUN/report.html in the bucket, reports/RUN/ where `trainfleet run report` writes)."""
    if history.resumed_from is None:
        return ""
    name = escape(history.resumed_from)
    first = history.attempts[0].resume_step if history.attempts else None
    at = f" at its step {first:,}" if first is not None else ""
    return f'<p class="resumed">Resumed from run <a href="../{name}/report.html">{name}</a>{at}.</p>\n'


def _summary(history: RunHistory) -> str:
    spares = f" + {history.spare_count} spare{'s' if history.spare_count != 1 else ''}" if history.spare_count else ""
    target = f" of {history.target_steps:,}" if history.target_steps else " (the trainer's default target)"
    steps = f"{history.last_step:,}{target}" if history.last_step is not None else "none yet"
    failures = len(history.failures)
    elapsed = _duration(max(0.0, _since_creation(history, history.until)))
    entries = [
        ("fleet", f"{history.node_count} × {history.instance_type}{spares}"),
        ("attempts", f"{_attempt_count(history)} ({failures} failure{'s' if failures != 1 else ''})"),
        ("steps", steps),
        ("goodput", f"{history.goodput:.0%}" + ("" if history.state.is_final else " so far")),
        ("steps lost", f"{history.steps_lost:,}"),
        ("cost", f"{_usd(history.cost_usd)} ({_node_hours(history.node_seconds)})"),
        ("created", _utc(history.created_at)),
        ("ended", f"{_utc(history.until)} ({elapsed})") if history.state.is_final
        else ("running", f"{elapsed} so far, as of {_utc(history.until)}"),
    ]
    rows = "\n".join(f"<div><dt>{name}</dt><dd>{escape(value)}</dd></div>" for name, value in entries)
    return f'<dl class="summary">\n{rows}\n</dl>'


def _failures_table(history: RunHistory) -> str:
    if not history.failures:
        return "<p>None: no attempt failed.</p>"
    head = ("<tr><th>attempt</th><th>failure</th><th>onset</th><th>detected after</th><th>last step</th>"
            "<th>recovery</th><th>resumed from</th><th>steps lost</th><th>nodes replaced</th><th>message</th></tr>")
    rows = []
    for failure in history.failures:
        cells = [
            ("number", str(failure.attempt)),
            ("text", escape(failure.failure_class)),
            ("text", _utc(failure.onset_at) if failure.onset_at else "not seen"),
            ("number", _duration(failure.detection_seconds) if failure.detection_seconds is not None else "unknown"),
            ("number", f"{failure.last_step:,}" if failure.last_step is not None else "none"),
            ("text", escape(failure.recovery or "unknown")),
            ("number", (f"{failure.resume_step:,}{' (memory)' if failure.from_memory else ''}"
                        if failure.resume_step is not None else "scratch")),
            ("number", f"{failure.steps_lost:,}"),
            # An instance id breaks only between ids, never at its hyphen.
            ("text", ", ".join(f'<span class="id">{escape(node)}</span>' for node in failure.instance_ids) + (
                f" and {failure.blamed - len(failure.instance_ids)} more"
                if failure.blamed > len(failure.instance_ids) else "") or "none"),
            ("message", escape(failure.message)),
        ]
        rows.append("<tr>" + "".join(f'<td class="{kind}">{html}</td>' for kind, html in cells) + "</tr>")
    body = "\n".join(rows)
    return f"<table>\n<thead>{head}</thead>\n<tbody>\n{body}\n</tbody>\n</table>"


def _checks(history: RunHistory) -> str:
    checks = [("fleet check", history.fleet_check), ("scaling check", history.scaling_check)]
    lines = [f'<p><strong>{name}</strong>: <span class="{"passed" if figures.passed else "not-passed"}">'
             f'{"passed" if figures.passed else "FAILED"}</span> (attempt {figures.attempt}): '
             f"{escape(figures.describe())}</p>" for name, figures in checks if figures is not None]
    return "\n".join(lines) or "<p>None measured.</p>"
