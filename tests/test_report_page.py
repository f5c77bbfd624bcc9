"""The run report's page and plots (trainfleet/report/page.py), from a recorded history and from
made-up ones at the edges: no steps at all, NaN losses, a live run, weeks of many steps."""

import html
import io
import json
import math
import os
import re
import shutil
import subprocess
import xml.etree.ElementTree as ET
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from PIL import Image

from trainfleet.core.records import FailureClass, RecoveryKind, RunState, ScalingCheckFigures
from trainfleet.core.run_history import AttemptProgress, FailureMark, Phase, RunHistory
from trainfleet.report.page import render_html, render_pngs, report_charts

EXAMPLE = Path(__file__).parent / "data" / "run-history-kill.json"
T0 = datetime(2026, 12, 1, 9, 0, tzinfo=timezone.utc)


@pytest.fixture(scope="module")
def example() -> RunHistory:
    return RunHistory.model_validate_json(EXAMPLE.read_text())


@pytest.fixture(scope="module")
def page(example) -> ET.Element:
    return ET.fromstring(render_html(example))


def made_up_run(seconds: float, steps: int, state: RunState = RunState.SUCCEEDED) -> RunHistory:
    """A run of `seconds` and `steps` steps: attempt 0 trains from 5% to 44% of the time and
    hangs at 40% of the steps; attempt 1 resumes a tenth of the steps back and trains to the end."""
    def at(fraction: float) -> datetime:
        return T0 + timedelta(seconds=seconds * fraction)

    hung_at, resume = steps * 2 // 5, steps * 3 // 10

    def attempt(number: int, first: int, last: int, start: float, end: float) -> AttemptProgress:
        count = last - first + 1
        return AttemptProgress(attempt=number, resume_step=resume if number else None, samples=[
            {"step": step, "loss": 8 / (1 + step / 300), "tokens_per_second": 1e5 * (1 + 0.1 * math.sin(step / 40)),
             "step_seconds": seconds / steps, "at": at(start + (end - start) * (step - first + 1) / count)}
            for step in range(first, last + 1)])

    spans = [("validate", 0, 0, .001), ("allocate", 0, .001, .01), ("await_nodes", 0, .01, .05),
             ("train", 0, .05, .45), ("recover", 0, .45, .46), ("backoff", 1, .46, .47), ("await_nodes", 1, .47, .5),
             ("train", 1, .5, .97), ("teardown", 1, .97, .99), ("report", 1, .99, 1)]
    hang = FailureMark(attempt=0, failure_class=FailureClass.HANG, onset_at=at(.44), decided_at=at(.45),
                       detection_seconds=seconds * .01, last_step=hung_at, resume_step=resume,
                       steps_lost=hung_at - resume, instance_ids=["i-0123456789abcdef0"],
                       message="no progress for 600 s")
    return RunHistory(
        run_name="made-up", state=state, error=None, instance_type="p5.48xlarge", node_count=16, spare_count=2,
        target_steps=steps, created_at=T0, until=at(1),
        attempts=[attempt(0, 1, hung_at, .05, .44), attempt(1, resume + 1, steps, .5, .97)],
        phases=[Phase(name=name, attempt=number, started_at=at(start), ended_at=at(end))
                for name, number, start, end in spans],
        failures=[hang], productive_seconds=seconds * .8,
        lost_by_cause={"startup": seconds * .05, "redone:HANG": seconds * .04, "restart:HANG": seconds * .08,
                       "finishing": seconds * .03},
        goodput=.8, cost_usd=seconds / 3600 * 18 * 98.32, node_seconds=seconds * 18, steps_lost=hung_at - resume,
        last_step=steps, fleet_check=None, scaling_check=None)


def figure(page: ET.Element, name: str) -> ET.Element:
    (found,) = [element for element in page.iter("figure") if element.get("id") == f"{name}-chart"]
    return found


def texts(element: ET.Element) -> list[str]:
    return ["".join(text.itertext()) for text in element.iter("text")]


def parts(element: ET.Element, kind: str) -> list[ET.Element]:
    """A chart's drawn parts of a kind (series, mark, span, bar, legend), by their SVG ids."""
    return [group for group in element.iter("g") if re.fullmatch(rf"\w+-{kind}(-\d+)?", group.get("id", ""))]


def x_tick_labels(element: ET.Element) -> list[str]:
    return ["".join(group.itertext()).strip() for group in element.iter("g") if group.get("id", "").startswith("xtick_")]


def header_summary(page: ET.Element) -> dict[str, str]:
    return {"".join(entry.find("dt").itertext()): "".join(entry.find("dd").itertext())
            for entry in page.iter("div") if entry.find("dt") is not None}


def all_text(element: ET.Element) -> str:
    return " ".join("".join(element.itertext()).split())


# -- The page is whole, and fetches nothing ---------------------------------------------------

def test_the_page_is_well_formed_and_holds_one_svg_per_chart(example):
    page = ET.fromstring(render_html(example))  # strict XML: every tag closed, every entity known
    assert page.tag == "html"
    assert [element.get("id") for element in page.iter("figure")] == [
        "loss-chart", "throughput-chart", "timeline-chart", "goodput-chart"]
    assert all(len(list(element.iter("svg"))) == 1 for element in page.iter("figure"))


RESOURCE_TAGS = {"script", "link", "img", "iframe", "object", "embed", "source", "video", "audio", "image",
                 "base", "frame"}
FRAGMENT = re.compile(r"#[\w-]+")
"""A reference within the page (an SVG <use> of a shape the chart defined once): nothing fetched."""


def test_the_page_fetches_nothing(example):
    html = render_html(example)
    page = ET.fromstring(html)
    assert not [element.tag for element in page.iter() if element.tag in RESOURCE_TAGS]
    for element in page.iter():
        for name, value in element.attrib.items():
            assert not re.search(r"https?:|//|url\((?!#[\w-]+\))", value, re.IGNORECASE), f"<{element.tag} {name}={value!r}>"
            # A link is followed by a reader, never fetched: only to a page beside this one.
            followed = element.tag == "a" and name == "href" and value.startswith("../")
            assert not name.lower().endswith(("src", "href")) or FRAGMENT.fullmatch(value) or followed, (
                f"<{element.tag} {name}>")
    styles = " ".join(" ".join(style.itertext()) for style in page.iter("style"))
    assert "url(" not in styles and "@import" not in styles and "@font-face" not in styles
    assert not re.search(r"https?:", html), "nothing on the page names a network address"


def test_a_resumed_run_links_the_report_of_the_run_it_resumed_and_names_the_step(example):
    first = example.attempts[0].model_copy(update={"resume_step": 1200})
    page = ET.fromstring(render_html(example.model_copy(update={"resumed_from": "ended-run",
                                                                "attempts": [first, *example.attempts[1:]]})))
    (resumed,) = [element for element in page.iter("p") if element.get("class") == "resumed"]
    assert all_text(resumed) == "Resumed from run ended-run at its step 1,200."
    assert resumed.find("a").get("href") == "../ended-run/report.html"
    assert not [element for element in ET.fromstring(render_html(example)).iter("p")
                if element.get("class") == "resumed"]


def test_text_from_the_run_is_escaped(example):
    name = "<script>alert('x')</script> & co"
    failure = example.failures[0].model_copy(update={"message": 'EC2 says "<b>gone</b>" & more'})
    page = ET.fromstring(render_html(example.model_copy(update={"run_name": name, "failures": [failure],
                                                                "error": "States.TaskFailed: <oops>"})))
    assert not list(page.iter("script")) and not list(page.iter("b"))
    assert name in all_text(page.find("body/header/h1")) and name in page.find("head/title").text
    assert 'EC2 says "<b>gone</b>" & more' in all_text(page) and "States.TaskFailed: <oops>" in all_text(page)


# -- It shows what happened -------------------------------------------------------------------

def test_the_loss_chart_marks_the_failure_and_the_resume_where_they_happened(page):
    loss = figure(page, "loss")
    labels = texts(loss)
    assert "INSTANCE_LOST after step 26" in labels and "resume from step 20" in labels
    assert {"attempt 0", "attempt 1", "steps trained again after a failure"} <= set(labels)
    assert len(parts(loss, "mark")) == 2 and len(parts(loss, "span")) == 1 and len(parts(loss, "series")) == 2


def test_steps_trained_and_never_reported_are_shaded_saying_which_and_why(example):
    first, *rest = example.attempts
    (failure,) = example.failures
    lost = failure.instance_ids[0]
    cut = first.model_copy(update={"samples": first.samples[:10], "unknown_steps": (11, first.samples[-1].step),
                                   "reporter": lost, "reporter_lost": True})
    loss = figure(ET.fromstring(render_html(example.model_copy(update={"attempts": [cut, *rest]}))), "loss")
    assert f"losses of steps 11-26: lost with {lost}, which reports them" in texts(loss)
    survived = cut.model_copy(update={"reporter": "i-0fffffffffffffff0", "reporter_lost": False})
    loss = figure(ET.fromstring(render_html(example.model_copy(update={"attempts": [survived, *rest]}))), "loss")
    assert "losses of steps 11-26: never reported by i-0fffffffffffffff0" in texts(loss)
    assert not [text for text in texts(figure(ET.fromstring(render_html(example)), "loss")) if "losses of" in text]


def test_a_pause_in_an_attempts_training_breaks_its_throughput_line(example):
    """No line drawn across time in which nothing trained: here 12 s of a 76 s run inside attempt 1."""
    first, second = example.attempts
    paused = [sample.model_copy(update={"at": sample.at + timedelta(seconds=12)}) if sample.step > 40 else sample
              for sample in second.samples]
    history = example.model_copy(update={"attempts": [first, second.model_copy(update={"samples": paused})]})
    _, line = report_charts(history)["throughput"].series
    gaps = [index for index, (_, tokens) in enumerate(line.points) if math.isnan(tokens)]
    assert len(gaps) == 1 and line.points[gaps[0] - 1][0] < line.points[gaps[0]][0] < line.points[gaps[0] + 1][0]
    assert all(not math.isnan(tokens) for _, tokens in report_charts(example)["throughput"].series[1].points)


def test_marks_at_one_place_take_turns_so_none_hides_another(example):
    """A repair from memory resumes from the step the failure came after: both marks at one x."""
    (failure,) = example.failures
    second = example.attempts[1].model_copy(update={"resume_step": failure.last_step})
    loss = figure(ET.fromstring(render_html(example.model_copy(update={"attempts": [example.attempts[0], second]}))),
                  "loss")
    marks = [ET.tostring(mark, encoding="unicode") for mark in parts(loss, "mark")]
    dashes = [(re.search(r"stroke-dasharray: ([\d.,]+)", mark)[1], re.search(r"stroke-dashoffset: ([\d.]+)", mark)[1])
              for mark in marks]
    (dash, gap), = {tuple(map(float, pattern.split(","))) for pattern, _ in dashes}
    assert len(marks) == 2 and dash == gap and sorted(float(offset) for _, offset in dashes) == [0, dash], dashes


def test_the_throughput_chart_runs_on_the_runs_clock_with_a_gap_between_attempts(page, example):
    throughput = figure(page, "throughput")
    assert "time since the run's creation (s)" in texts(throughput) and "INSTANCE_LOST" in texts(throughput)
    assert len(parts(throughput, "series")) == 2 and len(parts(throughput, "mark")) == 1
    first, second = (series.points for series in report_charts(example)["throughput"].series)
    assert max(x for x, _ in first) < min(x for x, _ in second), "attempt 1 starts after attempt 0 ends"


def test_the_timeline_shows_each_phase_and_the_failures_detection_replacement_and_resume(page, example):
    labels = texts(figure(page, "timeline"))
    assert {"attempt 0", "attempt 1", "recovery"} <= set(labels)
    for phase in {phase.name for phase in example.phases}:
        assert any(label.startswith(phase) for label in labels), phase
    assert {"INSTANCE_LOST (detected in 1.6 s)", "replace 1 node", "detection (onset to decision)",
            "resume from step 20"} <= set(labels)


def test_goodput_shows_each_cause_steps_lost_and_cost(page, example):
    labels = texts(figure(page, "goodput"))
    for cause, seconds in example.lost_by_cause.items():
        assert cause in labels
    assert "productive" in labels and "44 s (55%)" in labels and "16 s (20%)" in labels
    assert "Goodput 55%: 6 steps lost, cost $0.0038 (0.0444 node-hours)" in labels
    summary = header_summary(page)
    assert summary["steps lost"] == "6" and summary["cost"].startswith("$0.0038")
    assert summary["fleet"] == "2 × c5.large" and summary["steps"] == "60 of 60" and summary["goodput"] == "55%"
    assert summary["attempts"] == "2 (1 failure)" and summary["ended"] == "2026-12-03 09:01:10 UTC (1 min 10 s)"


def test_the_failures_table_and_the_world_checks(page, example):
    (row,) = page.find("body/table/tbody")
    assert ["".join(cell.itertext()) for cell in row] == [
        "0", "INSTANCE_LOST", "2026-12-03 09:00:27 UTC", "1.6 s", "26", "unknown", "20", "6", "i-0a1b2c3d4e5f60718",
        "EC2 reports i-0a1b2c3d4e5f60718 shutting-down"]  # recorded before the recovery's kind was kept
    assert f"fleet check: passed (attempt 1): {example.fleet_check.describe()}" in all_text(page)
    (failure,) = example.failures
    repaired = example.model_copy(update={"failures": [failure.model_copy(update={"recovery": RecoveryKind.REPAIRED})]})
    (row,) = ET.fromstring(render_html(repaired)).find("body/table/tbody")
    assert "".join(row[5].itertext()) == "repaired in place"


def test_a_failed_scaling_check_says_so_with_its_figures(example):
    check = ScalingCheckFigures(
        attempt=0, passed=False, efficiency=0.41, efficiency_floor=0.7, step_seconds=1.2, expected_step_seconds=0.49,
        tokens_per_second=13_600, expected_tokens_per_second=33_400, steps=5, slowest_stages=[1],
        slowest_stage_seconds=0.3, slowest_stage_instance_ids=["i-0b2"], slowest_rank=3,
        slowest_rank_instance_id="i-0b2", slowest_rank_seconds=0.31)
    page = ET.fromstring(render_html(example.model_copy(update={"scaling_check": check})))
    assert f"scaling check: FAILED (attempt 0): {check.describe()}" in all_text(page)


def test_the_pngs_are_pictures_of_the_plots(example):
    pngs = render_pngs(example)
    assert set(pngs) == {"loss.png", "throughput.png", "timeline.png", "goodput.png"}
    for name, body in pngs.items():
        image = Image.open(io.BytesIO(body))
        assert image.format == "PNG" and image.width == 1920 and 300 < image.height < 1200, name
        assert len(body) < 100_000, name
        assert len(image.convert("RGB").getcolors(maxcolors=1 << 16)) > 20, f"{name} draws something"
    loss = Image.open(io.BytesIO(pngs["loss.png"])).convert("RGB")
    assert any(_close(colour, (0xD5, 0x5E, 0x00)) for _, colour in loss.getcolors(1 << 16)), "the failure mark"


def _close(rgb, expected) -> bool:
    return all(abs(a - b) < 12 for a, b in zip(rgb, expected))


# -- The edges --------------------------------------------------------------------------------

def test_a_run_that_never_trained(example):
    validate, allocate = example.phases[:2]
    ended = allocate.ended_at + timedelta(seconds=3)
    failed = example.model_copy(update={
        "state": RunState.FAILED, "error": "CapacityUnavailable: no p5.48xlarge in us-east-1a", "until": ended,
        "phases": [validate, allocate, Phase(name="teardown", attempt=0, started_at=allocate.ended_at, ended_at=ended)],
        "attempts": [], "failures": [], "productive_seconds": 0.0, "lost_by_cause": {"startup": 4.5}, "goodput": 0.0,
        "steps_lost": 0, "last_step": None, "fleet_check": None})
    page = ET.fromstring(render_html(failed))
    for name in ("loss", "throughput"):
        assert "no steps reported" in texts(figure(page, name)), name
    assert "CapacityUnavailable: no p5.48xlarge in us-east-1a" in all_text(page.find("body/header"))
    assert header_summary(page)["attempts"] == "1 (0 failures)" and header_summary(page)["steps"] == "none yet"
    assert "None: no attempt failed." in all_text(page) and "None measured." in all_text(page)
    assert all(Image.open(io.BytesIO(body)).format == "PNG" for body in render_pngs(failed).values())
    nothing = failed.model_copy(update={"phases": [], "lost_by_cause": {}})
    assert "no state entered yet" in texts(figure(ET.fromstring(render_html(nothing)), "timeline"))
    assert "no time booked yet" in texts(figure(ET.fromstring(render_html(nothing)), "goodput"))


def test_losses_that_are_not_finite_are_left_out_of_the_curve(example):
    diverged = [attempt.model_copy(update={"samples": [
        sample.model_copy(update={"loss": math.nan if sample.step % 7 == 0 else math.inf if sample.step == 60
                                  else sample.loss}) for sample in attempt.samples]}) for attempt in example.attempts]
    history = example.model_copy(update={"attempts": diverged})
    loss = figure(ET.fromstring(render_html(history)), "loss")
    drawn = " ".join(path.get("d") for series in parts(loss, "series") for path in series.iter("path"))
    assert drawn and not re.search(r"nan|inf", drawn, re.IGNORECASE)
    # A point left out breaks its line: each attempt is drawn in as many pieces as runs of finite losses.
    pieces = sum(1 + sum(1 for before, after in zip(attempt.samples, attempt.samples[1:])
                         if not math.isfinite(before.loss) and math.isfinite(after.loss))
                 - (not math.isfinite(attempt.samples[0].loss)) for attempt in history.attempts)
    assert drawn.count("M") == pieces
    render_pngs(history)


def test_one_attempt_without_failures_has_no_marks():
    history = made_up_run(3600, 500).model_copy(update={"failures": [], "steps_lost": 0})
    history = history.model_copy(update={"attempts": history.attempts[:1], "phases": history.phases[:4]})
    page = ET.fromstring(render_html(history))
    for name in ("loss", "throughput", "timeline"):
        assert not parts(figure(page, name), "mark"), name
    assert "recovery" not in texts(figure(page, "timeline"))
    assert "None: no attempt failed." in all_text(page)


def test_a_live_run_is_shown_as_of_now():
    live = made_up_run(7200, 400, state=RunState.TRAINING)
    page = ET.fromstring(render_html(live))
    assert "TRAINING" in all_text(page.find("body/header/h1"))
    summary = header_summary(page)
    assert summary["running"] == "2 h so far, as of 2026-12-01 11:00:00 UTC" and "ended" not in summary
    assert summary["goodput"] == "80% so far"


def test_weeks_of_ten_thousand_steps_stay_small_and_count_in_days():
    history = made_up_run(21 * 86400, 10_000)
    assert len(history.samples) > 10_000
    html = render_html(history)
    assert len(html) < 150_000
    page = ET.fromstring(html)
    for name in ("throughput", "timeline"):
        assert "time since the run's creation (d)" in texts(figure(page, name)), name
    assert x_tick_labels(figure(page, "throughput"))[:4] == ["0", "7", "14", "21"]
    assert header_summary(page)["cost"] == "$891,959.04 (9,072 node-hours)"
    assert {"HANG after step 4,000", "resume from step 3,000"} <= set(texts(figure(page, "loss")))
    assert all(len(body) < 150_000 for body in render_pngs(history).values())


def test_a_run_of_seconds_and_one_of_hours_count_in_their_units():
    assert "time since the run's creation (s)" in texts(_timeline(made_up_run(20, 10)))
    assert "time since the run's creation (min)" in texts(_timeline(made_up_run(5400, 10)))
    assert "time since the run's creation (h)" in texts(_timeline(made_up_run(30 * 3600, 10)))


def _timeline(history: RunHistory) -> ET.Element:
    return figure(ET.fromstring(render_html(history)), "timeline")


def test_the_charts_are_data_for_other_renderers(example):
    charts = report_charts(example)
    assert list(charts) == ["loss", "throughput", "timeline", "goodput"]
    assert [series.name for series in charts["loss"].series] == ["attempt 0", "attempt 1"]
    assert len(charts["loss"].series[1].points) == 40


# -- In a real browser ------------------------------------------------------------------------

BROWSER = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome", "firefox"))), None)


WINDOW_WIDTH = 1280
MEASURE = """
const measured = {height: document.documentElement.scrollHeight, width: document.documentElement.scrollWidth,
                  figures: {}};
const rect = (element) => { const r = element.getBoundingClientRect(); return [r.left, r.top, r.right, r.bottom]; };
for (const figure of document.querySelectorAll("figure")) {
  const svg = figure.querySelector("svg"), name = figure.id.replace(/-chart$/, "");
  measured.figures[name] = {
    box: rect(svg),
    texts: [...svg.querySelectorAll("text")].map((text) => [text.textContent.trim(), rect(text)]),
    legend: [...svg.querySelectorAll(`g[id="${name}-legend"] text`)].map(rect),
    parts: Object.fromEntries([...svg.querySelectorAll(`g[id^="${name}-"]`)].map((g) => [g.id, rect(g)])),
  };
}
const out = document.createElement("pre");
out.id = "measured";
out.textContent = JSON.stringify(measured);
document.body.append(out);
"""
"""Where the browser laid out each chart and its parts, in CSS pixels: the test's copy of the page
runs it (the page itself has no script) and the DOM is dumped with its answer."""


def chromium(*arguments: str, profile: Path) -> str:
    """Headless Chromium with nothing reaching out (this machine's network is closed, and a page
    that fetches nothing needs none); its stdout."""
    done = subprocess.run([BROWSER, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                           "--force-device-scale-factor=1", "--disable-background-networking",
                           "--disable-component-update", "--disable-sync", "--no-first-run",
                           f"--user-data-dir={profile}", *arguments],
                          capture_output=True, text=True, timeout=120, env=os.environ | {"HOME": str(profile)})
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def overlap(a: list[float], b: list[float]) -> bool:
    return a[0] < b[2] - 0.5 and b[0] < a[2] - 0.5 and a[1] < b[3] - 0.5 and b[1] < a[3] - 0.5


def inside(inner: list[float], outer: list[float]) -> bool:
    return (inner[0] >= outer[0] - 0.5 and inner[1] >= outer[1] - 0.5 and inner[2] <= outer[2] + 0.5
            and inner[3] <= outer[3] + 0.5)


def pixels_of(image: Image.Image, box: list[float], colour: tuple[int, int, int]) -> int:
    left, top, right, bottom = (round(value) for value in box)
    region = image.crop((left - 3, top, right + 3, bottom))
    return sum(count for count, found in region.getcolors(maxcolors=1 << 20) if _close(found, colour))


@pytest.mark.skipif(BROWSER is None or BROWSER.endswith("firefox"),
                    reason="no Chromium on PATH (chromium, chromium-browser, google-chrome): `make test` installs "
                           "Debian's where apt-get can")
def test_a_browser_shows_the_four_charts_their_marks_and_legends_with_no_label_clipped(example, tmp_path):
    page = render_html(example)
    measuring = tmp_path / "measuring.html"
    measuring.write_text(page.replace("</body>", f"<script>{MEASURE}</script>\n</body>"))
    # Laid out at the width the screenshot is taken at, so that the places measured are those shown.
    dom = chromium("--virtual-time-budget=5000", f"--window-size={WINDOW_WIDTH},2000", "--dump-dom",
                   measuring.as_uri(), profile=tmp_path / "profile")
    laid_out = json.loads(html.unescape(re.search(r'<pre id="measured">(.*?)</pre>', dom, re.DOTALL)[1]))
    assert list(laid_out["figures"]) == ["loss", "throughput", "timeline", "goodput"]
    assert laid_out["width"] <= WINDOW_WIDTH, "nothing wider than the window"
    for name, figure_laid_out in laid_out["figures"].items():
        box = figure_laid_out["box"]
        assert box[2] - box[0] > 600 and box[3] - box[1] > 150, (name, box)
        clipped = [text for text, where in figure_laid_out["texts"] if not inside(where, box)]
        assert not clipped, f"{name}: labels outside the chart: {clipped}"
        legend = figure_laid_out["legend"]
        assert not [(a, b) for i, a in enumerate(legend) for b in legend[i + 1:] if overlap(a, b)], name
    loss = laid_out["figures"]["loss"]["parts"]
    assert {"loss-series-0", "loss-series-1", "loss-mark-0", "loss-mark-1", "loss-span-0", "loss-legend"} <= set(loss)

    shown, shot = tmp_path / "report.html", tmp_path / "report.png"
    shown.write_text(page)
    chromium(f"--screenshot={shot}", f"--window-size={WINDOW_WIDTH},{laid_out['height']}", shown.as_uri(),
             profile=tmp_path / "profile")
    image = Image.open(shot).convert("RGB")
    # The kill, and the resume in attempt 1's colour, drawn where the browser put their lines.
    assert pixels_of(image, loss["loss-mark-0"], (0xD5, 0x5E, 0x00)) > 50, "the kill's mark"
    assert pixels_of(image, loss["loss-mark-1"], (0x00, 0x9E, 0x73)) > 50, "the resume's mark"
    for name in ("loss", "throughput", "timeline"):  # goodput's bars are named on their rows
        legend = laid_out["figures"][name]["parts"][f"{name}-legend"]
        ink = image.crop(tuple(round(value) for value in legend)).convert("L").getextrema()
        assert ink[0] < 100, f"{name}: the legend is drawn"
    timeline = laid_out["figures"]["timeline"]["parts"]
    assert pixels_of(image, timeline["timeline-mark-0"], (0xD5, 0x5E, 0x00)) > 20, "the kill on the timeline"


