"""The run report: its files, the same whoever writes them.

    files = report_files(run, nodes, history)     name -> ReportFile (body, content type)

The Report function writes them under s3://BUCKET/runs/RUN/ at the end of a run (the reaper too,
for an execution that ended without it); `trainfleet run report RUN` writes them to a folder at
any time. report.json is the document for tooling (outcome, attempts, failures, each attempt's
steps, checkpoint, goodput, lost time by cause, nodes, the world checks); report.html the page for people, with the
plots (trainfleet/report/page.py), which are also PNG files of their own (report-loss.png, ...).
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any, NamedTuple

from trainfleet.core.lifecycle import unaccounted_seconds
from trainfleet.core.records import NodeRecord, RunRecord
from trainfleet.core.run_history import RunHistory
from trainfleet.report.page import render_html, render_pngs

__all__ = ["ReportFile", "build_report", "report_files", "REPORT_JSON", "REPORT_HTML"]

REPORT_JSON = "report.json"
REPORT_HTML = "report.html"


class ReportFile(NamedTuple):
    body: bytes
    content_type: str


def build_report(run: RunRecord, nodes: list[NodeRecord], history: RunHistory) -> dict[str, Any]:
    """The report document: what happened, for people and for tooling."""
    return {
        "run_name": run.run_name,
        "execution_arn": run.execution_arn,
        "state": run.state.value,
        "error": run.error,
        "attempts": run.attempt + 1,
        "restarts": run.restarts,
        "resumed_from": history.resumed_from,  # the ended run whose newest commit attempt 0 started from
        # As the history has them: each with its first sign, detection, last step and steps lost.
        "failures": [failure.model_dump(mode="json") for failure in history.failures],
        "earlier_failures": run.earlier_failures,  # no longer kept in the record (Recover logged each)
        "steps_lost": history.steps_lost,
        # Each attempt's reported steps, as the loss chart draws them.
        "progress": [{"attempt": progress.attempt, "resume_step": progress.resume_step,
                      "steps": [progress.samples[0].step, progress.samples[-1].step] if progress.samples else None,
                      "from": progress.samples[0].at.isoformat() if progress.samples else None,
                      "to": progress.samples[-1].at.isoformat() if progress.samples else None,
                      "unknown_steps": progress.unknown_steps, "reporter": progress.reporter,
                      "reporter_lost": progress.reporter_lost} for progress in history.attempts],
        "plan": run.plan.model_dump() if run.plan else None,
        "latest_checkpoint": run.latest_checkpoint.model_dump(mode="json") if run.latest_checkpoint else None,
        "last_step": run.last_step,
        "goodput": run.ledger.goodput,
        "ledger": run.ledger.model_dump(mode="json"),
        # Creation to the last booking less what the books hold: ~0 when every second is booked once.
        "unaccounted_seconds": unaccounted_seconds(run) if run.created_at else None,
        "fleet_check": run.fleet_check.model_dump(mode="json") if run.fleet_check else None,
        "scaling_check": run.scaling_check.model_dump(mode="json") if run.scaling_check else None,
        "nodes": {
            "launched": len(nodes),
            "by_state": dict(Counter(node.state.value for node in nodes)),
            "replaced": sorted(node.instance_id for node in nodes if node.failure_class is not None),
        },
        "created_at": run.created_at.isoformat() if run.created_at else None,
        "updated_at": run.updated_at.isoformat() if run.updated_at else None,
    }


def report_files(run: RunRecord, nodes: list[NodeRecord], history: RunHistory) -> dict[str, ReportFile]:
    """Every file of the report, by name."""
    document = json.dumps(build_report(run, nodes, history), indent=2).encode()
    return {REPORT_JSON: ReportFile(document, "application/json"),
            REPORT_HTML: ReportFile(render_html(history).encode(), "text/html; charset=utf-8"),
            **{f"report-{name}": ReportFile(png, "image/png") for name, png in render_pngs(history).items()}}
