"""A small chart kit: line charts with marks, and bar charts on rows (goodput bars, Gantt strips),
drawn as SVG text or as PNG.

A chart is plain data: a `Chart` of `Series` (lines), `Bar`s (on named rows), `Mark`s (vertical
lines with a label) and `Span`s (shaded ranges of x). `layout` turns it into drawing primitives
once (scales, "nice" ticks, time units, label places, thinning, the legend); `to_svg` and
`to_png` only draw those primitives, so the page and the image show the same picture.

    chart = Chart("Loss", Axis("step"), Axis("loss"), series=[Series("attempt 0", points, BLUE)])
    drawing = layout(chart)
    svg, png = to_svg(drawing), to_png(drawing)

Nothing here knows about training runs (trainfleet/report_page.py does).
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import cache
from html import escape
from itertools import groupby
from typing import Literal

from PIL import Image, ImageDraw, ImageFont

__all__ = ["Axis", "Series", "Bar", "Mark", "Span", "Chart", "Polyline", "Rect", "Text", "Drawing",
           "layout", "to_svg", "to_png", "tint", "SERIES_COLOURS", "BLACK", "ORANGE", "SKY_BLUE", "GREEN",
           "YELLOW", "BLUE", "VERMILLION", "PURPLE", "GREY", "LIGHT_GREY"]

# Okabe and Ito's palette: told apart with every common colour-vision deficiency.
BLACK, ORANGE, SKY_BLUE, GREEN = "#000000", "#E69F00", "#56B4E9", "#009E73"
YELLOW, BLUE, VERMILLION, PURPLE = "#F0E442", "#0072B2", "#D55E00", "#CC79A7"
GREY, LIGHT_GREY = "#999999", "#CCCCCC"
SERIES_COLOURS = (BLUE, GREEN, PURPLE, SKY_BLUE, ORANGE, BLACK)
"""Lines, in turn; vermillion is left out, for marks of what went wrong."""

_INK, _MUTED, _GRID, _AXIS = "#222222", "#555555", "#E6E6E6", "#888888"


def tint(colour: str, strength: float) -> str:
    """`colour` mixed with white: strength 1 is the colour, 0 white (no transparency needed)."""
    channels = (int(colour[i:i + 2], 16) for i in (1, 3, 5))
    return "#" + "".join(f"{round(255 - (255 - channel) * strength):02X}" for channel in channels)


# -- The chart, as data -----------------------------------------------------------------------

@dataclass(frozen=True)
class Axis:
    label: str
    seconds: bool = False
    """The values are seconds: ticks in s, min, h or d, whichever suits the range (named in the label)."""
    from_zero: bool = False
    """The range reaches 0 (a drop in throughput reads against the whole)."""
    limits: tuple[float, float] | None = None
    """A fixed range; the data's otherwise."""


@dataclass(frozen=True)
class Series:
    """A line. Points in x order; points whose y is NaN or infinite are left out of the line
    (their x still counts in the x range)."""

    name: str
    points: Sequence[tuple[float, float]]
    colour: str


@dataclass(frozen=True)
class Bar:
    """A bar on a row, from `start` to `end` along x."""

    row: str
    start: float
    end: float
    colour: str
    label: str = ""
    """Written on the bar where it fits, else just after it where there is room."""
    key: str = ""
    """Its legend entry (bars of one key share it); none when empty."""


@dataclass(frozen=True)
class Mark:
    """A dashed vertical line at `x`, its label above the plot."""

    x: float
    label: str
    colour: str


@dataclass(frozen=True)
class Span:
    """A shaded range of x behind the data, named in the legend."""

    start: float
    end: float
    colour: str
    key: str


@dataclass(frozen=True)
class Chart:
    """A line chart (`y_axis` given: series, marks, spans) or a chart on rows (`y_axis` None:
    bars, one row per distinct `Bar.row` in order of appearance, and marks)."""

    title: str
    x_axis: Axis
    y_axis: Axis | None = None
    series: Sequence[Series] = ()
    bars: Sequence[Bar] = ()
    marks: Sequence[Mark] = ()
    spans: Sequence[Span] = ()
    empty_note: str = "no data"
    """Written across the plot when there is nothing to draw."""
    width: int = 960

    def __post_init__(self):
        if self.y_axis is None and self.series:
            raise ValueError("a chart on rows draws bars, not series: give it a y axis")
        if self.y_axis is not None and self.bars:
            raise ValueError("a line chart draws series, not bars: leave out its y axis")


# -- Drawing primitives -----------------------------------------------------------------------

@dataclass(frozen=True)
class Polyline:
    points: tuple[tuple[float, float], ...]
    colour: str
    width: float = 1.0
    dashed: bool = False


@dataclass(frozen=True)
class Rect:
    x: float
    y: float
    w: float
    h: float
    fill: str


@dataclass(frozen=True)
class Text:
    """Text whose baseline starts, is centred or ends at (x, y)."""

    x: float
    y: float
    text: str
    size: int = 12
    colour: str = _INK
    anchor: Literal["start", "middle", "end"] = "start"
    bold: bool = False


@dataclass(frozen=True)
class Drawing:
    """A chart laid out: what either backend draws, in order, on a `width` x `height` picture."""

    title: str
    width: int
    height: int
    items: tuple[Polyline | Rect | Text, ...]


# -- Layout -----------------------------------------------------------------------------------

_TITLE_SIZE, _LABEL_SIZE, _TICK_SIZE = 15, 12, 11
_PAD = 12
_LINE = 17  # one line of 11-12 px text
_PLOT_HEIGHT = 240  # a line chart's plot
_ROW_HEIGHT, _BAR_HEIGHT = 28, 20
_MAX_MARK_LEVELS = 6
_DASH = (5, 3)


def _text_width(text: str, size: int) -> float:
    """An estimate on the wide side (the page's font is the browser's): DejaVu Sans's widths,
    roughly, which are wider than the PNG's font."""
    return size * sum(0.7 if char.isupper() or char in "_%" else 0.64 if char.isdigit()
                      else 0.34 if char in " .,:;'()[]|!ijlt" else 0.6 for char in text)


@dataclass(frozen=True)
class _Ticks:
    lo: float
    hi: float
    values: tuple[float, ...]
    labels: tuple[str, ...]
    unit: str  # "" unless the axis is in seconds


# Steps a tick may take in each unit of time, so that ticks fall on whole minutes, hours, days.
_TIME_UNITS = (("s", 1.0, (1, 2, 5, 10, 15, 30)), ("min", 60.0, (1, 2, 5, 10, 15, 30)),
               ("h", 3600.0, (1, 2, 3, 6, 12)), ("d", 86400.0, (1, 2, 7, 14)))


def _nice_step(raw: float, steps: Sequence[float] = ()) -> float:
    """The first of `steps` at least `raw`; outside their range 1, 2, 2.5 or 5 times a power of ten."""
    if steps and steps[0] / 2 < raw <= steps[-1]:
        return float(next(step for step in steps if raw <= step))
    magnitude = 10 ** math.floor(math.log10(raw))
    return next(factor * magnitude for factor in (1, 2, 2.5, 5, 10) if raw <= factor * magnitude * (1 + 1e-9))


def _ticks(lo: float, hi: float, axis: Axis, count: int) -> _Ticks:
    """About `count` ticks on round values covering [lo, hi]; the range widens to them."""
    unit, size, steps = "", 1.0, ()
    if axis.seconds:
        extent = max(abs(lo), abs(hi), hi - lo)
        unit, size, steps = next(choice for bound, choice in zip((180, 3 * 3600, 3 * 86400, math.inf), _TIME_UNITS)
                                 if extent < bound)
    lo, hi = lo / size, hi / size
    step = _nice_step((hi - lo) / max(count, 1), steps)
    first, last = math.floor(lo / step + 1e-9), math.ceil(hi / step - 1e-9)
    values = tuple(index * step for index in range(first, last + 1))
    return _Ticks(values[0] * size, values[-1] * size, tuple(value * size for value in values),
                  _number_labels(values, step), unit)


def _number_labels(values: Sequence[float], step: float) -> tuple[str, ...]:
    """Tick labels to the step's precision; from 10,000 up in k, M or G."""
    top = max(abs(value) for value in values)
    scale, suffix = next(((scale, suffix) for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k"))
                          if top >= max(scale, 1e4)), (1.0, ""))
    scaled = step / scale
    decimals = max(0, -math.floor(math.log10(scaled) + 1e-9))
    if abs(scaled * 10 ** decimals - round(scaled * 10 ** decimals)) > 1e-6:  # 2.5, 0.25, ...
        decimals += 1
    return tuple("0" if value == 0 else f"{value / scale:,.{decimals}f}{suffix}" for value in values)


def _finite(points: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    return [(x, y) for x, y in points if math.isfinite(x) and math.isfinite(y)]


def _range(values: Sequence[float], axis: Axis, pad: float) -> tuple[float, float]:
    """The axis's limits, or the values' range padded by `pad` of its width (never empty)."""
    if axis.limits is not None:
        return axis.limits
    lo, hi = (min(values), max(values)) if values else (0.0, 1.0)
    if axis.from_zero:
        lo, hi = min(lo, 0.0), max(hi, 0.0)
    if hi - lo <= 1e-12 * max(1.0, abs(hi)):
        return lo - max(1.0, abs(lo) * 0.1), hi + max(1.0, abs(hi) * 0.1)
    margin = (hi - lo) * pad
    # The padding never crosses zero: positive data gets no negative ticks.
    return (max(0.0, lo - margin) if lo >= 0 else lo - margin), (min(0.0, hi + margin) if hi <= 0 else hi + margin)


def _thin(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Per pixel column only its lowest and highest point, in their order: a line of any length
    draws the same envelope with at most two points a column."""
    thinned: list[tuple[float, float]] = []
    for _, group in groupby(points, key=lambda point: math.floor(point[0])):
        column = list(group)
        if len(column) > 2:
            by_y = sorted(range(len(column)), key=lambda i: column[i][1])
            column = [column[i] for i in sorted({by_y[0], by_y[-1]})]
        thinned.extend(column)
    return thinned


@dataclass(frozen=True)
class _Box:
    """Where the plot lies on the picture, and the scales that put values in it."""

    left: float
    right: float
    top: float
    bottom: float
    x_ticks: _Ticks
    y_ticks: _Ticks | None  # None on rows

    def x(self, value: float) -> float:
        return self.left + (value - self.x_ticks.lo) / (self.x_ticks.hi - self.x_ticks.lo) * (self.right - self.left)

    def y(self, value: float) -> float:
        return self.bottom - (value - self.y_ticks.lo) / (self.y_ticks.hi - self.y_ticks.lo) * (self.bottom - self.top)


@dataclass(frozen=True)
class _PlacedMark:
    mark: Mark
    x: float
    level: int | None  # None: no room for its label, the line alone is drawn
    anchor: Literal["start", "end"]


def _place_marks(marks: Sequence[Mark], x_of: Callable[[float], float], left: float,
                 right: float) -> list[_PlacedMark]:
    """Each label on the lowest level (0 is next to the plot) where it overlaps no other label and
    no line passing through. Taken right to left, labels written rightwards of their line never
    lie across the lines of marks placed later."""
    taken: dict[int, list[tuple[float, float]]] = {}  # level -> occupied x intervals

    def free(level: int, start: float, end: float) -> bool:
        return all(end + 6 < a or start - 6 > b for a, b in taken.get(level, ()))

    placed = []
    for mark in sorted(marks, key=lambda mark: mark.x, reverse=True):
        x = x_of(mark.x)
        width = _text_width(mark.label, _TICK_SIZE)
        anchor: Literal["start", "end"] = "start" if x + 4 + width <= right or x - 4 - width < left else "end"
        start = x + 4 if anchor == "start" else x - 4 - width
        level = next((level for level in range(_MAX_MARK_LEVELS) if free(level, start, start + width)
                      and all(free(below, x - 1, x + 1) for below in range(level))), None)
        if level is not None:
            taken.setdefault(level, []).append((start, start + width))
            for below in range(level):
                taken[below].append((x - 1, x + 1))
        placed.append(_PlacedMark(mark, x, level, anchor))
    return placed


def _legend(chart: Chart) -> list[tuple[str, str, bool]]:
    """(name, colour, drawn as a line) for each series, span key and bar key, once each."""
    entries = [(series.name, series.colour, True) for series in chart.series]
    entries += [(item.key, item.colour, False) for item in [*chart.spans, *chart.bars] if item.key]
    return list(dict.fromkeys(entries))


def _legend_rows(entries: list[tuple[str, str, bool]], width: float) -> list[list[tuple[float, str, str, bool]]]:
    """The entries flowed into rows of `width`: (offset, name, colour, line) each."""
    rows: list[list[tuple[float, str, str, bool]]] = [[]]
    offset = 0.0
    for name, colour, line in entries:
        size = 22 + _text_width(name, _TICK_SIZE) + 18
        if rows[-1] and offset + size > width:
            rows.append([])
            offset = 0.0
        rows[-1].append((offset, name, colour, line))
        offset += size
    return rows if rows[0] else []


def _ink_on(fill: str) -> str:
    """Dark text on light fills, white on dark ones."""
    red, green, blue = (int(fill[i:i + 2], 16) for i in (1, 3, 5))
    return _INK if 0.299 * red + 0.587 * green + 0.114 * blue > 150 else "#FFFFFF"


_Item = Polyline | Rect | Text


def layout(chart: Chart) -> Drawing:
    """The chart as primitives, in drawing order (later ones on top)."""
    on_rows = chart.y_axis is None
    series = [(line, _finite(line.points)) for line in chart.series]
    rows = list(dict.fromkeys(bar.row for bar in chart.bars))
    empty = not any(points for _, points in series) and not chart.bars

    # Scales and ticks. The x range holds every point, drawn or not: a line that stops short of
    # it says that its last values were not finite.
    xs = [x for line in chart.series for x, _ in line.points] + [mark.x for mark in chart.marks]
    xs += [end for item in [*chart.bars, *chart.spans] for end in (item.start, item.end)]
    x_ticks = _ticks(*_range([x for x in xs if math.isfinite(x)], chart.x_axis, 0.0), chart.x_axis,
                     max(2, chart.width // 110))
    y_ticks = None if on_rows else _ticks(*_range([y for _, points in series for _, y in points], chart.y_axis, 0.05),
                                          chart.y_axis, 5)

    # The box: room on the left for the row names or y ticks, above for the title, the y axis's
    # name and the marks' labels, below for the x ticks, the x axis's name and the legend.
    left_texts = [(text, _LABEL_SIZE) for text in rows] if on_rows else [(text, _TICK_SIZE) for text in y_ticks.labels]
    left = _PAD + max((_text_width(*text) for text in left_texts), default=0) + 10
    right = chart.width - max(_PAD, _text_width(x_ticks.labels[-1], _TICK_SIZE) / 2 + 4)
    x_of = _Box(left, right, 0, 1, x_ticks, None).x  # the marks' places decide how far down the plot begins
    marks = _place_marks(chart.marks, x_of, left, right)
    levels = max((placed.level + 1 for placed in marks if placed.level is not None), default=0)
    title_y = _PAD + _TITLE_SIZE
    top = title_y + 8 + (0 if on_rows else _LINE + 8) + levels * _LINE + (4 if levels else 0)
    box = _Box(left, right, top, top + (max(1, len(rows)) * _ROW_HEIGHT if on_rows else _PLOT_HEIGHT),
               x_ticks, y_ticks)
    legend = _legend_rows(_legend(chart), chart.width - 2 * _PAD)
    height = int(box.bottom + 2 * _LINE + len(legend) * _LINE + _PAD)

    items: list[_Item] = [Rect(0, 0, chart.width, height, "#FFFFFF"),
                          Text(_PAD, title_y, chart.title, _TITLE_SIZE, bold=True)]
    if not on_rows:  # the y axis's name above it, on a line of its own
        items.append(Text(_PAD, title_y + 8 + _LINE - 4, chart.y_axis.label, _LABEL_SIZE, _MUTED))
    for span in chart.spans:
        start, end = sorted((box.x(span.start), box.x(span.end)))
        items.append(Rect(start, box.top, max(end - start, 1.0), box.bottom - box.top, span.colour))
    items += _axes(chart, box, rows, empty)
    for bar in chart.bars:
        items += _bar(bar, chart.bars, box, box.top + rows.index(bar.row) * _ROW_HEIGHT)
    for line, points in series:
        pixels = _thin([(box.x(x), box.y(y)) for x, y in points])
        if len(pixels) == 1:  # a line of one point: a dot
            items.append(Rect(pixels[0][0] - 2, pixels[0][1] - 2, 4, 4, line.colour))
        elif pixels:
            items.append(Polyline(tuple(pixels), line.colour, 2.0))
    if empty:
        items.append(Text((box.left + box.right) / 2, (box.top + box.bottom) / 2, chart.empty_note, _LABEL_SIZE,
                          _MUTED, "middle"))
    items += _marks(marks, box, levels)
    items += _legend_items(legend, box.bottom + 15 + 2 * _LINE)
    return Drawing(chart.title, chart.width, height, tuple(items))


def _axes(chart: Chart, box: _Box, rows: list[str], empty: bool) -> list[_Item]:
    """Ticks and grid: vertical lines across a chart on rows, horizontal ones for a line chart's
    y; the row names; the x axis and its name (with its unit of time)."""
    on_rows = box.y_ticks is None
    items: list[_Item] = []
    for value, label in zip(box.x_ticks.values, box.x_ticks.labels):
        x = box.x(value)
        items.append(Polyline(((x, box.top), (x, box.bottom)), _GRID) if on_rows
                     else Polyline(((x, box.bottom), (x, box.bottom + 4)), _AXIS))
        items.append(Text(x, box.bottom + 15, label, _TICK_SIZE, _MUTED, "middle"))
    if not on_rows and not empty:  # an empty chart's y range would be made up
        for value, label in zip(box.y_ticks.values, box.y_ticks.labels):
            items.append(Polyline(((box.left, box.y(value)), (box.right, box.y(value))), _GRID))
            items.append(Text(box.left - 6, box.y(value) + 4, label, _TICK_SIZE, _MUTED, "end"))
    for index, row in enumerate(rows):
        items.append(Text(box.left - 8, box.top + (index + 0.5) * _ROW_HEIGHT + 4, row, _LABEL_SIZE, _INK, "end"))
    items.append(Polyline(((box.left, box.bottom), (box.right, box.bottom)), _AXIS))
    unit = box.x_ticks.unit
    items.append(Text((box.left + box.right) / 2, box.bottom + 15 + _LINE,
                      f"{chart.x_axis.label} ({unit})" if unit else chart.x_axis.label, _LABEL_SIZE, _MUTED, "middle"))
    return items


def _marks(marks: list[_PlacedMark], box: _Box, levels: int) -> list[_Item]:
    """Each mark's dashed line down through the plot, from its label where it has one."""
    items: list[_Item] = []
    for placed in marks:
        line_top = box.top
        if placed.level is not None:
            label_y = box.top - 8 - placed.level * _LINE
            line_top = label_y - _TICK_SIZE + 2
            x = placed.x + 4 if placed.anchor == "start" else placed.x - 4
            items.append(Text(x, label_y, placed.mark.label, _TICK_SIZE, placed.mark.colour, placed.anchor))
        items.append(Polyline(((placed.x, line_top), (placed.x, box.bottom)), placed.mark.colour, 1.5, dashed=True))
    return items


def _legend_items(rows: list[list[tuple[float, str, str, bool]]], first_baseline: float) -> list[_Item]:
    items: list[_Item] = []
    for number, row in enumerate(rows):
        y = first_baseline + number * _LINE
        for offset, name, colour, line in row:
            x = _PAD + offset
            items.append(Polyline(((x, y - 4), (x + 16, y - 4)), colour, 3.0) if line
                         else Rect(x + 2, y - 10, 12, 12, colour))
            items.append(Text(x + 22, y, name, _TICK_SIZE, _INK))
    return items


def _bar(bar: Bar, bars: Sequence[Bar], box: _Box, row_top: float) -> list[_Item]:
    """A bar at least a pixel wide, and its label on it or just after it, or nowhere."""
    start, end = sorted((box.x(bar.start), box.x(bar.end)))
    y = row_top + (_ROW_HEIGHT - _BAR_HEIGHT) / 2
    items: list[_Item] = [Rect(start, y, max(end - start, 1.0), _BAR_HEIGHT, bar.colour)]
    width = _text_width(bar.label, _TICK_SIZE)
    baseline = y + _BAR_HEIGHT / 2 + 4
    # After the bar, up to where the next bar on its row begins (or the plot's edge).
    room_end = min([box.x(other.start) for other in bars
                    if other is not bar and other.row == bar.row and box.x(other.start) >= end - 0.5] + [box.right])
    if bar.label and width + 8 <= end - start:
        items.append(Text((start + end) / 2, baseline, bar.label, _TICK_SIZE, _ink_on(bar.colour), "middle"))
    elif bar.label and end + 4 + width <= room_end:
        items.append(Text(end + 4, baseline, bar.label, _TICK_SIZE, _INK))
    return items


# -- Backends ---------------------------------------------------------------------------------

def _n(value: float) -> str:
    """A coordinate in SVG: a tenth of a pixel is enough, and keeps long lines short."""
    return f"{value:.1f}".removesuffix(".0")


def to_svg(drawing: Drawing) -> str:
    """An <svg> element to put inline in an HTML page (scales with its width)."""
    parts = [f'<svg viewBox="0 0 {drawing.width} {drawing.height}" width="{drawing.width}" '
             f'height="{drawing.height}" role="img" font-family="DejaVu Sans, Helvetica, Arial, sans-serif">',
             f"<title>{escape(drawing.title)}</title>"]
    for item in drawing.items:
        if isinstance(item, Rect):
            parts.append(f'<rect x="{_n(item.x)}" y="{_n(item.y)}" width="{_n(item.w)}" height="{_n(item.h)}" '
                         f'fill="{item.fill}"/>')
        elif isinstance(item, Polyline):
            points = " ".join(f"{_n(x)},{_n(y)}" for x, y in item.points)
            dash = f' stroke-dasharray="{_DASH[0]} {_DASH[1]}"' if item.dashed else ""
            parts.append(f'<polyline points="{points}" fill="none" stroke="{item.colour}" '
                         f'stroke-width="{_n(item.width)}"{dash} stroke-linejoin="round"/>')
        else:
            weight = ' font-weight="bold"' if item.bold else ""
            parts.append(f'<text x="{_n(item.x)}" y="{_n(item.y)}" font-size="{item.size}" fill="{item.colour}" '
                         f'text-anchor="{item.anchor}"{weight}>{escape(item.text)}</text>')
    parts.append("</svg>")
    return "\n".join(parts)


_PIL_ANCHOR = {"start": "ls", "middle": "ms", "end": "rs"}  # left/middle/right, on the baseline


@cache
def _font(size: int) -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
    return ImageFont.load_default(size=size)


def _dashes(start: tuple[float, float], end: tuple[float, float]) -> Iterable[tuple[tuple[float, float], ...]]:
    """The pieces of a dashed segment (Pillow draws only solid lines)."""
    length = math.dist(start, end)
    if not length:
        return
    on, period = _DASH[0], _DASH[0] + _DASH[1]
    for offset in range(0, math.ceil(length), period):
        a, b = offset / length, min(offset + on, length) / length
        yield tuple((start[0] + (end[0] - start[0]) * t, start[1] + (end[1] - start[1]) * t) for t in (a, b))


def to_png(drawing: Drawing, scale: int = 2) -> bytes:
    """PNG bytes, `scale` pixels per unit of the drawing (2: sharp on high-density screens).
    Drawn at twice that and halved, so that lines are smooth (Pillow does not anti-alias them);
    then kept to 128 colours, which look the same and take a third of the bytes."""
    ink = scale * 2
    image = Image.new("RGB", (drawing.width * ink, drawing.height * ink), "#FFFFFF")
    draw = ImageDraw.Draw(image)
    for item in drawing.items:
        if isinstance(item, Rect):
            box = [item.x * ink, item.y * ink, (item.x + item.w) * ink - 1, (item.y + item.h) * ink - 1]
            draw.rectangle(box, fill=item.fill)
        elif isinstance(item, Polyline):
            pieces = ([dash for a, b in zip(item.points, item.points[1:]) for dash in _dashes(a, b)] if item.dashed
                      else [item.points])
            for piece in pieces:
                draw.line([(x * ink, y * ink) for x, y in piece], fill=item.colour,
                          width=max(1, round(item.width * ink)), joint="curve")
        else:
            draw.text((item.x * ink, item.y * ink), item.text, fill=item.colour, font=_font(item.size * ink),
                      anchor=_PIL_ANCHOR[item.anchor], stroke_width=ink // 2 if item.bold else 0,
                      stroke_fill=item.colour)
    image = image.resize((drawing.width * scale, drawing.height * scale), Image.Resampling.BOX)
    image = image.quantize(colors=128, method=Image.Quantize.FASTOCTREE, dither=Image.Dither.NONE)
    out = io.BytesIO()
    image.save(out, format="PNG", optimize=True)
    return out.getvalue()
