"""The report's charts (trainfleet/report/charts.py) as matplotlib draws them: time units, tick labels,
long and broken lines, lines that coincide, labels on bars, and the SVG and PNG they save as."""

import io
import math
import random
import xml.etree.ElementTree as ET

import pytest
from PIL import Image

from trainfleet.report.charts import (BLUE, GREEN, VERMILLION, Axis, Bar, Chart, Mark, Series, Span, _number, figure,
                                      tint, to_png, to_svg)


def line_chart(*series: Series, **chart) -> Chart:
    return Chart("a line", Axis("x", **chart.pop("x", {})), Axis("y", **chart.pop("y", {})), series=series, **chart)


def plot(chart: Chart):
    fig = figure(chart)
    fig.draw_without_rendering()
    return fig.axes[0]


def tick_labels(ax) -> list[str]:
    low, high = ax.get_xlim()
    return [tick.get_text() for tick, at in zip(ax.get_xticklabels(), ax.get_xticks()) if low <= at <= high]


@pytest.mark.parametrize("seconds, unit, ticks", [
    (70, "s", ["0", "10", "20", "30", "40", "50", "60", "70"]),
    (2 * 3600, "min", ["0", "15", "30", "45", "60", "75", "90", "105", "120"]),
    (20 * 3600, "h", ["0", "3", "6", "9", "12", "15", "18"]),
    (21 * 86400, "d", ["0", "7", "14", "21"]),
])
def test_a_time_axis_counts_in_the_unit_its_range_calls_for(seconds, unit, ticks):
    ax = plot(line_chart(Series("s", [(0, 1), (seconds, 2)], BLUE), x={"seconds": True, "limits": (0, seconds)}))
    assert ax.get_xlabel() == f"x ({unit})"
    assert tick_labels(ax) == ticks


def test_tick_labels_are_plain_numbers_with_a_prefix_from_ten_thousand():
    assert [_number(value) for value in (0, 2.5, 0.25, 1500, 12_000, 1_230_000, 4.5e9, -20_000)] == [
        "0", "2.5", "0.25", "1,500", "12k", "1.23M", "4.5G", "-20k"]


def test_a_long_series_is_thinned_to_its_envelope():
    noise = random.Random(7)
    points = [(step, 5 + noise.gauss(0, 1)) for step in range(10_000)]
    points[4321], points[8765] = (4321, 20.0), (8765, -10.0)  # a spike and a dip must survive the thinning
    (line,) = plot(line_chart(Series("s", points, BLUE))).lines
    drawn = line.get_ydata()
    assert len(drawn) <= 2 * 960 and max(drawn) == 20.0 and min(drawn) == -10.0
    assert len(to_svg(line_chart(Series("s", points, BLUE)))) < 100_000


def test_points_that_are_not_finite_break_the_line_and_never_reach_the_svg():
    chart = line_chart(Series("s", [(0, 1.0), (10, math.nan), (20, math.inf), (30, 2.0), (40, -math.inf)], BLUE))
    ax = plot(chart)
    (line,) = ax.lines
    assert [y for y in line.get_ydata() if math.isfinite(y)] == [1.0, 2.0]
    assert ax.get_xlim()[1] >= 40, "the x range still holds the points left out"
    svg = to_svg(chart)
    assert "nan" not in svg.lower() and "inf" not in svg.lower()


def test_an_earlier_line_that_later_ones_overlap_lies_wider_beneath_them():
    first = Series("attempt 0", [(step, 10 - step) for step in range(1, 27)], BLUE)
    second = Series("attempt 1", [(step, 10 - step) for step in range(21, 61)], GREEN)  # the same losses from 21
    apart = Series("attempt 2", [(step, 1.0) for step in range(70, 80)], VERMILLION)
    lines = plot(line_chart(first, second, apart)).lines
    widths = [line.get_linewidth() for line in lines]
    assert widths[0] > widths[1] == widths[2], "only the line a later one overlaps is widened"
    assert [line.get_zorder() for line in lines] == [2, 2, 2] and lines[0].get_alpha() < 1
    assert lines[1].get_alpha() in (None, 1.0)


def test_a_label_goes_on_its_bar_after_it_or_nowhere_as_room_allows():
    chart = Chart("rows", Axis("time", seconds=True, limits=(0, 100)), bars=[
        Bar("a", 0, 60, GREEN, "fits on the bar", "train"),
        Bar("a", 60, 61, BLUE, "too long for a sliver", "allocate"),  # the next bar of its row is far off
        Bar("a", 90, 100, GREEN, "", "train"),
        Bar("b", 0, 1, BLUE, "no room after it either"),
        Bar("b", 2, 100, GREEN)])
    texts = {text.get_text().strip(): text for text in plot(chart).texts}
    assert texts["fits on the bar"].get_horizontalalignment() == "center"
    assert texts["too long for a sliver"].get_horizontalalignment() == "left"
    assert "no room after it either" not in texts
    legend = figure(chart).legends[0]
    assert [text.get_text() for text in legend.get_texts()] == ["train", "allocate"], "one entry per key"


def test_a_bar_that_starts_before_the_axis_is_labelled_by_its_part_within_it():
    """A state entered before the run was created (Validate records the run) starts left of 0."""
    chart = Chart("rows", Axis("time", seconds=True, limits=(0, 100)), bars=[
        Bar("a", -30, 1, BLUE, "validate"), Bar("a", 1, 100, GREEN, "train")])
    assert [text.get_text() for text in plot(chart).texts] == ["train"], "no label outside the axes"
    chart = Chart("rows", Axis("time", seconds=True, limits=(0, 100)), bars=[Bar("a", -30, 40, BLUE, "validate")])
    (label,) = plot(chart).texts
    assert label.get_position()[0] == pytest.approx(20), "centred on what is drawn"


def test_marks_and_spans_are_named_in_the_legend_and_carry_their_ids():
    chart = line_chart(Series("loss", [(0, 3), (60, 1)], BLUE), marks=[Mark(26, "INSTANCE_LOST after step 26", VERMILLION)],
                       spans=[Span(20, 26, tint(VERMILLION, 0.2), "steps trained again")])
    svg = ET.fromstring(to_svg(chart, "loss"))
    ids = {group.get("id") for group in svg.iter("g")}
    assert {"loss-series-0", "loss-mark-0", "loss-span-0", "loss-legend"} <= ids
    legend = [text for group in svg.iter("g") if group.get("id") == "loss-legend" for text in group.itertext()]
    assert {"loss", "INSTANCE_LOST after step 26", "steps trained again"} <= {text.strip() for text in legend}


def test_an_empty_chart_says_so():
    svg = ET.fromstring(to_svg(Chart("nothing", Axis("x"), Axis("y"), empty_note="no steps reported"), "e"))
    (note,) = [group for group in svg.iter("g") if group.get("id") == "e-note"]
    assert "".join(note.itertext()).strip() == "no steps reported"


def test_the_same_chart_gives_the_same_svg_and_a_png_of_its_size():
    chart = line_chart(Series("s", [(0, 1), (5, 3)], BLUE))
    assert to_svg(chart) == to_svg(chart)
    image = Image.open(io.BytesIO(to_png(chart)))
    assert image.format == "PNG" and image.width == 1920


def test_a_chart_on_rows_draws_no_series_and_a_line_chart_no_bars():
    with pytest.raises(ValueError, match="give it a y axis"):
        Chart("rows", Axis("x"), series=[Series("s", [(0, 1)], BLUE)])
    with pytest.raises(ValueError, match="leave out its y axis"):
        Chart("line", Axis("x"), Axis("y"), bars=[Bar("r", 0, 1, BLUE)])


def test_tint_mixes_with_white():
    assert tint("#000000", 1) == "#000000" and tint("#000000", 0) == "#FFFFFF" and tint("#0072B2", 0.5) == "#80B8D8"
