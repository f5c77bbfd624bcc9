"""The chart kit (trainfleet/charts.py): ticks, time units, thinning, label places, both backends."""

import io
import math
import random
import xml.etree.ElementTree as ET

import pytest
from PIL import Image

from trainfleet.charts import (BLUE, GREEN, VERMILLION, Axis, Bar, Chart, Mark, Polyline, Series, Text, layout, tint,
                               to_png, to_svg)


def texts(drawing) -> list[Text]:
    return [item for item in drawing.items if isinstance(item, Text)]


def lines(drawing, colour: str) -> list[Polyline]:
    """The series' lines of that colour (the legend's swatch is thicker, a mark's line dashed)."""
    return [item for item in drawing.items
            if isinstance(item, Polyline) and item.colour == colour and item.width == 2 and not item.dashed]


def x_tick_labels(drawing) -> list[str]:
    """The labels under the plot, left to right (the x axis's ticks: centred, in the tick size)."""
    ticks = [text for text in texts(drawing) if text.anchor == "middle" and text.size == 11]
    return [text.text for text in sorted(ticks, key=lambda text: text.x)]


def line_chart(points, **chart) -> Chart:
    return Chart("a line", Axis("x", **chart.pop("x", {})), Axis("y", **chart.pop("y", {})),
                 series=[Series("s", points, BLUE)], **chart)


def test_ticks_fall_on_round_numbers_covering_the_data():
    drawing = layout(line_chart([(1, 7.3), (60, 2.4)]))
    assert x_tick_labels(drawing) == ["0", "10", "20", "30", "40", "50", "60"]
    y_ticks = [text.text for text in texts(drawing) if text.anchor == "end"]
    assert y_ticks == ["2", "4", "6", "8"]


def test_large_numbers_take_a_prefix_and_fractions_their_decimals():
    big = layout(line_chart([(0, 0), (1, 1_230_000)]))
    assert [text.text for text in texts(big) if text.anchor == "end"] == ["0", "0.5M", "1.0M", "1.5M"]
    quarters = layout(line_chart([(0, 0), (1, 11.5)]))
    assert [text.text for text in texts(quarters) if text.anchor == "end"] == ["0", "2.5", "5.0", "7.5", "10.0", "12.5"]


@pytest.mark.parametrize("seconds, unit, ticks", [
    (70, "s", ["0", "10", "20", "30", "40", "50", "60", "70"]),
    (2 * 3600, "min", ["0", "15", "30", "45", "60", "75", "90", "105", "120"]),
    (20 * 3600, "h", ["0", "3", "6", "9", "12", "15", "18", "21"]),
    (21 * 86400, "d", ["0", "7", "14", "21"]),
])
def test_a_time_axis_counts_in_the_unit_its_range_calls_for(seconds, unit, ticks):
    drawing = layout(line_chart([(0, 1), (seconds, 2)], x={"seconds": True}))
    assert f"x ({unit})" in [text.text for text in texts(drawing)]
    assert x_tick_labels(drawing) == ticks


def test_a_long_series_is_thinned_to_its_envelope():
    noise = random.Random(7)
    points = [(step, 5 + noise.gauss(0, 1)) for step in range(10_000)]
    points[4321], points[8765] = (4321, 20.0), (8765, -10.0)  # a spike and a dip must survive the thinning
    drawing = layout(line_chart(points))
    (line,) = lines(drawing, BLUE)
    assert len(line.points) <= 2 * drawing.width
    tick_y = {text.text: text.y - 4 for text in texts(drawing) if text.anchor == "end"}  # label baselines: 4 below
    assert min(y for _, y in line.points) == pytest.approx(tick_y["20"])
    assert max(y for _, y in line.points) == pytest.approx(tick_y["-10"])
    assert len(to_svg(drawing)) < 40_000


def test_points_that_are_not_finite_are_left_out():
    drawing = layout(line_chart([(0, 1.0), (10, math.nan), (20, math.inf), (30, 2.0), (40, -math.inf)]))
    (line,) = lines(drawing, BLUE)
    assert len(line.points) == 2
    assert x_tick_labels(drawing)[-1] == "40", "the x range still holds the points left out"
    assert "nan" not in to_svg(drawing) and "inf" not in to_svg(drawing)
    nothing = layout(line_chart([(0, math.nan)], empty_note="nothing yet"))
    assert not lines(nothing, BLUE) and "nothing yet" in [text.text for text in texts(nothing)]


def test_mark_labels_crowded_together_neither_overlap_nor_lie_across_a_mark():
    marks = [Mark(x, f"FAILURE {x}", VERMILLION) for x in range(40, 46)] + [Mark(99, "AT THE EDGE", GREEN)]
    drawing = layout(line_chart([(0, 1), (100, 2)], marks=marks))
    dashed = [line for line in drawing.items if isinstance(line, Polyline) and line.dashed]
    assert len(dashed) == len(marks), "every mark keeps its line"
    labels = [text for text in texts(drawing) if text.text.startswith(("FAILURE", "AT THE"))]
    assert {text.text for text in labels} == {mark.label for mark in marks}

    def extent(text):  # no narrower than any sans-serif writes these capitals
        width = 0.6 * text.size * len(text.text)
        return (text.x, text.x + width) if text.anchor == "start" else (text.x - width, text.x)

    for one in labels:
        assert extent(one)[1] <= drawing.width, "labels stay on the picture"
        for other in labels:
            if other is not one and other.y == one.y:
                assert extent(one)[1] < extent(other)[0] or extent(other)[1] < extent(one)[0]
        for line in dashed:
            (x, top), (_, bottom) = line.points
            assert not (extent(one)[0] < x < extent(one)[1] and top < one.y < bottom), f"{one.text} crosses a line"


def test_marks_too_many_to_name_keep_their_lines():
    marks = [Mark(x, f"FAILURE {x}", VERMILLION) for x in range(40, 70)]
    drawing = layout(line_chart([(0, 1), (100, 2)], marks=marks))
    assert len([line for line in drawing.items if isinstance(line, Polyline) and line.dashed]) == len(marks)
    levels = {text.y for text in texts(drawing) if text.text.startswith("FAILURE")}
    assert 1 < len(levels) <= 6, "labels stack a few levels high, no more"


def test_a_bar_label_goes_on_the_bar_after_it_or_nowhere():
    chart = Chart("bars", Axis("x"), bars=[
        Bar("wide", 0, 80, BLUE, "on the bar"), Bar("narrow", 0, 2, BLUE, "after"),
        Bar("squeezed", 0, 2, BLUE, "no room before the next"), Bar("squeezed", 3, 100, GREEN)])
    drawing = layout(chart)
    placed = {text.text: text for text in texts(drawing)}
    assert placed["on the bar"].anchor == "middle" and placed["on the bar"].colour == "#FFFFFF", "white on blue"
    assert placed["after"].anchor == "start"
    assert "no room before the next" not in placed
    assert [text.text for text in texts(drawing) if text.anchor == "end"] == ["wide", "narrow", "squeezed"], "rows"


def test_a_chart_is_either_on_rows_or_a_line_chart():
    with pytest.raises(ValueError):
        Chart("mixed", Axis("x"), series=[Series("s", [(0, 1)], BLUE)])
    with pytest.raises(ValueError):
        Chart("mixed", Axis("x"), Axis("y"), bars=[Bar("r", 0, 1, BLUE)])


def test_the_svg_parses_and_escapes_its_text():
    drawing = layout(line_chart([(0, 1), (1, 2)], marks=[Mark(0.5, "<b>&amp'\"", VERMILLION)]))
    svg = ET.fromstring(to_svg(drawing))
    assert svg.tag == "svg" and "<b>&amp'\"" in [element.text for element in svg.iter("text")]


def test_the_png_draws_the_same_picture():
    drawing = layout(line_chart([(0, 1), (10, 2)]))
    image = Image.open(io.BytesIO(to_png(drawing)))
    assert image.format == "PNG" and image.size == (2 * drawing.width, 2 * drawing.height)
    pixels = image.convert("RGB")
    (line,) = lines(drawing, BLUE)
    (x0, y0), (x1, y1) = line.points
    middle = (round(x0 + x1), round(y0 + y1))  # the line's midpoint, at 2 pixels a unit
    assert _close(pixels.getpixel(middle), BLUE), "the series' colour where the SVG draws its line"
    assert _close(pixels.getpixel((2, 2)), "#FFFFFF")


def _close(rgb, colour: str) -> bool:
    return all(abs(a - int(colour[i:i + 2], 16)) < 40 for a, i in zip(rgb, (1, 3, 5)))


def test_a_tint_mixes_with_white():
    assert tint(VERMILLION, 1) == VERMILLION and tint(VERMILLION, 0) == "#FFFFFF"
    assert tint("#000000", 0.5) == "#808080"
