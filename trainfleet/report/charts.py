"""The report's charts as data, drawn with matplotlib: line charts with marks and shaded spans,
and bar charts on rows (goodput bars, Gantt strips), as SVG text or PNG.

A chart is plain data: a `Chart` of `Series` (lines), `Bar`s (on named rows), `Mark`s (dashed
vertical lines, named in the legend) and `Span`s (shaded ranges of x). `figure` draws it once;
`to_svg` and `to_png` save that figure, so the page and the image show the same picture.

    chart = Chart("Loss", Axis("step"), Axis("loss"), series=[Series("attempt 0", points, BLUE)])
    svg, png = to_svg(chart, "loss"), to_png(chart)

matplotlib is used through its object interface alone (a Figure and its canvas, never pyplot's
global figures), so charts may be drawn on several threads at once. Nothing here knows about
training runs (trainfleet/report/page.py does).
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import groupby

import matplotlib
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import FuncFormatter, MaxNLocator

__all__ = ["Axis", "Series", "Bar", "Mark", "Span", "Chart", "figure", "to_svg", "to_png", "time_unit", "tint",
           "SERIES_COLOURS", "BLACK", "ORANGE", "SKY_BLUE", "GREEN", "YELLOW", "BLUE", "VERMILLION", "PURPLE",
           "GREY", "LIGHT_GREY"]

# Okabe and Ito's palette: told apart with every common colour-vision deficiency.
BLACK, ORANGE, SKY_BLUE, GREEN = "#000000", "#E69F00", "#56B4E9", "#009E73"
YELLOW, BLUE, VERMILLION, PURPLE = "#F0E442", "#0072B2", "#D55E00", "#CC79A7"
GREY, LIGHT_GREY = "#999999", "#CCCCCC"
SERIES_COLOURS = (BLUE, GREEN, PURPLE, SKY_BLUE, ORANGE, BLACK)
"""Lines, in turn; vermillion is left out, for marks of what went wrong."""

_INK, _MUTED, _GRID = "#222222", "#555555", "#E6E6E6"
_WIDTH_IN, _DPI = 9.6, 100  # 960 px wide on the page
_PNG_DPI = 200
_PLOT_HEIGHT_IN, _ROW_HEIGHT_IN = 2.6, 0.38
_LINE_WIDTH = 1.6

# Read when a figure is saved, the same for every chart: set once, never per drawing (rcParams
# are the process's, and charts may be drawn on several threads). Ids in the SVG are hashed with a
# fixed salt and no date is written, so the same chart gives the same bytes.
matplotlib.rcParams["svg.hashsalt"] = "trainfleet"
# Text stays text in the SVG (a third of the size of text drawn as shapes, and a reader can select
# and search it). The layout is measured with matplotlib's own DejaVu Sans, among the widest sans
# faces: where the reader's browser lacks it, the face it takes instead is narrower, never clipped.
matplotlib.rcParams["svg.fonttype"] = "none"
matplotlib.rcParams["font.family"] = "DejaVu Sans"


def tint(colour: str, strength: float) -> str:
    """`colour` mixed with white: strength 1 is the colour, 0 white (no transparency needed)."""
    channels = (int(colour[i:i + 2], 16) for i in (1, 3, 5))
    return "#" + "".join(f"{round(255 - (255 - channel) * strength):02X}" for channel in channels)


# -- The chart, as data -----------------------------------------------------------------------

@dataclass(frozen=True)
class Axis:
    label: str
    seconds: bool = False
    """The values are seconds: shown in s, min, h or d, whichever suits the range (named in the label)."""
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
    """Written on the bar where it fits, else just after it where the row has room."""
    key: str = ""
    """Its legend entry (bars of one key share it); none when empty."""


@dataclass(frozen=True)
class Mark:
    """A dashed vertical line at `x`, named in the legend."""

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

    def __post_init__(self):
        if self.y_axis is None and self.series:
            raise ValueError("a chart on rows draws bars, not series: give it a y axis")
        if self.y_axis is not None and self.bars:
            raise ValueError("a line chart draws series, not bars: leave out its y axis")


# -- Scales -----------------------------------------------------------------------------------

# Each unit with the steps its ticks may take (within a power of ten), so that they fall on whole
# quarters of an hour, hours of a day, weeks.
_TIME_UNITS = (("s", 1.0, (1, 1.5, 2, 3, 5, 10)), ("min", 60.0, (1, 1.5, 2, 3, 5, 10)),
               ("h", 3600.0, (1, 2, 3, 6, 10)), ("d", 86400.0, (1, 2, 7, 10)))


def time_unit(extent_s: float) -> tuple[str, float, tuple[float, ...]]:
    """The unit a time axis spanning `extent_s` seconds is shown in, its seconds and its tick
    steps: below 3 min in s, below 3 h in min, below 3 d in h, else in d."""
    return next(unit for bound, unit in zip((180, 3 * 3600, 3 * 86400, math.inf), _TIME_UNITS) if extent_s < bound)


def _number(value: float, _position: object = None) -> str:
    """A tick label: from 10,000 up in k, M or G; never in scientific notation."""
    for threshold, scale, suffix in ((1e9, 1e9, "G"), (1e6, 1e6, "M"), (1e4, 1e3, "k")):
        if abs(value) >= threshold:
            return f"{value / scale:,.4g}{suffix}"
    return f"{value:,.6g}"


def _thin(points: list[tuple[float, float]], columns: int) -> list[tuple[float, float]]:
    """Per column of the plot only its lowest and highest point, in their order: a line of any
    length draws the same envelope (spikes and dips kept) with at most two points a column."""
    if len(points) <= 2 * columns:
        return points
    lo, hi = points[0][0], points[-1][0]
    width = (hi - lo) / columns or 1.0
    thinned: list[tuple[float, float]] = []
    for _, group in groupby(points, key=lambda point: min(math.floor((point[0] - lo) / width), columns - 1)):
        column = list(group)
        if len(column) > 2:
            by_y = sorted(range(len(column)), key=lambda i: column[i][1])
            column = [column[i] for i in sorted({by_y[0], by_y[-1]})]
        thinned.extend(column)
    return thinned


def _extent(chart: Chart) -> float:
    xs = [x for line in chart.series for x, _ in line.points] + [mark.x for mark in chart.marks]
    xs += [end for item in [*chart.bars, *chart.spans] for end in (item.start, item.end)]
    xs = [x for x in xs if math.isfinite(x)]
    if chart.x_axis.limits is not None:
        xs += list(chart.x_axis.limits)
    return max(map(abs, xs), default=0.0)


# -- Drawing ----------------------------------------------------------------------------------

def figure(chart: Chart, ids: str = "chart") -> Figure:
    """The chart drawn on a new Figure. Its parts carry SVG ids under `ids`: `{ids}-series-N`,
    `{ids}-bar-N`, `{ids}-mark-N`, `{ids}-span-N`, `{ids}-legend`, `{ids}-note`."""
    rows = list(dict.fromkeys(bar.row for bar in chart.bars))
    height = _PLOT_HEIGHT_IN if chart.y_axis is not None else max(1, len(rows)) * _ROW_HEIGHT_IN + 0.6
    fig = Figure(figsize=(_WIDTH_IN, height + 1.2), dpi=_DPI, layout="constrained")
    FigureCanvasAgg(fig)  # text is measured on it (the labels on bars)
    ax = fig.add_subplot()
    ax.set_title(chart.title, loc="left", fontsize=13, fontweight="bold", color=_INK)
    ax.spines[["top", "right"]].set_visible(False)
    ax.tick_params(labelsize=9, colors=_MUTED)
    ax.grid(True, axis="x" if chart.y_axis is None else "both", color=_GRID, linewidth=0.8)
    ax.set_axisbelow(True)

    unit, size, steps = time_unit(_extent(chart)) if chart.x_axis.seconds else ("", 1.0, None)
    ax.set_xlabel(f"{chart.x_axis.label} ({unit})" if unit else chart.x_axis.label, fontsize=10, color=_MUTED)
    ax.xaxis.set_major_formatter(FuncFormatter(_number))
    ax.xaxis.set_major_locator(MaxNLocator(nbins=9, steps=steps, integer=not unit))
    if chart.x_axis.limits is not None:
        ax.set_xlim(chart.x_axis.limits[0] / size, chart.x_axis.limits[1] / size)

    legend: dict[str, Line2D | Patch] = {}
    for index, span in enumerate(chart.spans):
        ax.axvspan(span.start / size, span.end / size, color=span.colour, linewidth=0, zorder=0,
                   gid=f"{ids}-span-{index}")
        legend.setdefault(span.key, Patch(color=span.colour, label=span.key))
    if chart.y_axis is not None:
        _draw_series(ax, chart, size, ids, legend)
    else:
        _draw_bars(ax, chart, rows, size, ids, legend)
    for index, mark in enumerate(chart.marks):
        dashes = _dashes(mark, chart.marks)
        ax.axvline(mark.x / size, color=mark.colour, linewidth=1.3, linestyle=dashes, zorder=3,
                   gid=f"{ids}-mark-{index}")
        legend.setdefault(mark.label, Line2D([], [], color=mark.colour, linewidth=1.3, linestyle=dashes,
                                             label=mark.label))
    if not chart.series and not chart.bars:
        ax.text(0.5, 0.5, chart.empty_note, transform=ax.transAxes, ha="center", va="center", fontsize=11,
                color=_MUTED, gid=f"{ids}-note")
    if legend:
        drawn = fig.legend(handles=list(legend.values()), loc="outside lower center", ncols=3, fontsize=9,
                           frameon=False, handlelength=2.4)
        drawn.set_gid(f"{ids}-legend")
    return fig


_DASH, _GAP = 5, 3


def _dashes(mark: Mark, marks: Sequence[Mark]) -> tuple[int, tuple[int, int]]:
    """A mark's dash pattern. Marks at one x (a failure after step 19 and the resume from step 19)
    take turns along the line, each dash in the others' gaps, so that none hides another."""
    colours = sorted({other.colour for other in marks if other.x == mark.x})
    if len(colours) == 1:
        return 0, (_DASH, _GAP)
    return colours.index(mark.colour) * _DASH, (_DASH, _DASH * (len(colours) - 1))


def _draw_series(ax, chart: Chart, size: float, ids: str, legend: dict[str, Line2D | Patch]) -> None:
    """The lines, each above the one before. Where they may coincide (an attempt that trains
    again the steps an earlier one trained, from the same checkpoint, draws the same losses) the
    earlier lies wider and lighter beneath, so both are seen: a line whose x range later lines
    overlap is drawn wider for each of them."""
    y_axis = chart.y_axis
    ax.set_ylabel(y_axis.label, fontsize=10, color=_MUTED)
    ax.yaxis.set_major_formatter(FuncFormatter(_number))
    ax.yaxis.set_major_locator(MaxNLocator(nbins=6))
    columns = int(_WIDTH_IN * _DPI)
    ranges = [(min(xs), max(xs)) if (xs := [x for x, _ in line.points if math.isfinite(x)]) else None
              for line in chart.series]
    for index, line in enumerate(chart.series):
        points = _thin([(x / size, y) for x, y in line.points if math.isfinite(x)], columns)
        later = sum(1 for other in ranges[index + 1:] if other and ranges[index]
                    and other[0] <= ranges[index][1] and ranges[index][0] <= other[1])
        style = {"color": line.colour, "linewidth": min(_LINE_WIDTH + 1.8 * later, 5),
                 "alpha": 1.0 if later == 0 else 0.55}
        ax.plot([x for x, _ in points], [y if math.isfinite(y) else math.nan for _, y in points], **style,
                solid_capstyle="round", zorder=2, gid=f"{ids}-series-{index}")
        legend.setdefault(line.name, Line2D([], [], **style, label=line.name))
    # The x range holds every point, drawn or not: a line that stops short of it says that its
    # last values were not finite.
    xs = [end for found in ranges if found for end in found]
    if xs and chart.x_axis.limits is None:
        low, high = ax.get_xlim()
        ax.set_xlim(min(low, min(xs) / size), max(high, max(xs) / size))
    if y_axis.limits is not None:
        ax.set_ylim(*y_axis.limits)
    elif y_axis.from_zero:
        ax.set_ylim(bottom=min(0.0, ax.get_ylim()[0]))


def _draw_bars(ax, chart: Chart, rows: list[str], size: float, ids: str,
               legend: dict[str, Line2D | Patch]) -> None:
    """One row per name, top to bottom; each bar's label on it where it fits, else just after it
    where nothing else of its row lies there, else only the legend tells it."""
    ax.set_yticks(range(len(rows)), rows, fontsize=9, color=_INK)
    ax.set_ylim(max(1, len(rows)) - 0.5, -0.5)
    ax.tick_params(axis="y", length=0)
    placed = []
    for index, bar in enumerate(chart.bars):
        row = rows.index(bar.row)
        ax.barh(row, (bar.end - bar.start) / size, left=bar.start / size, height=0.7, color=bar.colour,
                gid=f"{ids}-bar-{index}")
        if bar.key:
            legend.setdefault(bar.key, Patch(color=bar.colour, label=bar.key))
        if bar.label:
            placed.append((bar, row))
    if chart.x_axis.limits is None:
        ax.margins(x=0.02)
        if chart.x_axis.from_zero:
            ax.set_xlim(left=min(0.0, ax.get_xlim()[0]))
    renderer = ax.figure.canvas.get_renderer()
    ax.figure.draw_without_rendering()  # the final scales, to measure labels against the bars
    to_pixels, from_pixels = ax.transData.transform, ax.transData.inverted().transform
    left_edge, right_edge = ax.get_window_extent(renderer).x0, ax.get_window_extent(renderer).x1
    for bar, row in placed:
        # Only the part of a bar within the axes is drawn (a state entered before the x range began).
        left, right = (min(max(to_pixels((x / size, row))[0], left_edge), right_edge) for x in (bar.start, bar.end))
        if right <= left:
            continue
        middle = from_pixels(((left + right) / 2, 0))[0]
        text = ax.text(middle, row, bar.label, ha="center", va="center", fontsize=8.5, color=_ink_on(bar.colour))
        width = text.get_window_extent(renderer).width
        if width + 6 <= right - left:
            continue
        room = min([to_pixels((other.start / size, row))[0] for other in chart.bars
                    if other.row == bar.row and other.start >= bar.end] + [right_edge])
        if right + 4 + width <= room:
            text.set_position((bar.end / size, row))
            text.set_horizontalalignment("left")
            text.set_color(_INK)
            text.set_text(" " + bar.label)
        else:
            text.remove()


def _ink_on(fill: str) -> str:
    """Dark text on light fills, white on dark ones."""
    red, green, blue = (int(fill[i:i + 2], 16) for i in (1, 3, 5))
    return _INK if 0.299 * red + 0.587 * green + 0.114 * blue > 150 else "#FFFFFF"


def to_svg(chart: Chart, ids: str = "chart") -> str:
    """The chart as an SVG element to put inline in a page (no XML prolog)."""
    out = io.StringIO()
    # No metadata block (RDF naming its creator, date and Dublin Core addresses): nothing but the picture.
    figure(chart, ids).savefig(out, format="svg", metadata={"Date": None, "Creator": None, "Format": None, "Type": None})
    svg = out.getvalue()
    # Inline in HTML, an <svg> element is SVG by the parser's rules: no namespace is declared, and
    # a shape drawn again (a tick) is referred to by SVG 2's plain href, not xlink's.
    svg = svg[svg.index("<svg"):]
    for declaration in (' xmlns="http://www.w3.org/2000/svg"', ' xmlns:xlink="http://www.w3.org/1999/xlink"'):
        svg = svg.replace(declaration, "", 1)
    return svg.replace("xlink:href=", "href=")


def to_png(chart: Chart) -> bytes:
    out = io.BytesIO()
    figure(chart).savefig(out, format="png", dpi=_PNG_DPI, metadata={"Software": None})
    return out.getvalue()
