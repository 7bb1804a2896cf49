"""A line plot as SVG text: enough for a benchmark's timeline, with no plotting
library to install."""

from __future__ import annotations

from html import escape

__all__ = ["line_plot_svg"]

_W, _H = 720, 360
_LEFT, _RIGHT, _TOP, _BOTTOM = 60, 20, 40, 50


def _ticks(top: float, count: int = 5) -> list[float]:
    """Round tick values from 0 to at least ``top``."""
    if top <= 0:
        return [0.0, 1.0]
    raw = top / count
    magnitude = 10 ** len(str(int(raw))) / 10 if raw >= 1 else 1.0
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    ticks = [0.0]
    while ticks[-1] < top:
        ticks.append(ticks[-1] + step)
    return ticks


def line_plot_svg(points: list[tuple[float, float]], marks: list[tuple[float, str]], *, title: str,
                  x_label: str, y_label: str) -> str:
    """``points`` (x, y) joined by a line; each mark a dashed vertical line with
    its label."""
    xs = _ticks(max((x for x, _ in points), default=1.0))
    ys = _ticks(max((y for _, y in points), default=1.0))
    x_max, y_max = xs[-1], ys[-1]

    def px(x: float) -> float:
        return _LEFT + (_W - _LEFT - _RIGHT) * x / x_max

    def py(y: float) -> float:
        return _H - _BOTTOM - (_H - _TOP - _BOTTOM) * y / y_max

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{_W}" height="{_H}" font-family="sans-serif" '
           'font-size="12">', f'<rect width="{_W}" height="{_H}" fill="white"/>',
           f'<text x="{_W / 2}" y="20" text-anchor="middle" font-size="14">{escape(title)}</text>']
    for x in xs:
        out.append(f'<line x1="{px(x):.1f}" y1="{py(0):.1f}" x2="{px(x):.1f}" y2="{py(0) + 5:.1f}" stroke="black"/>')
        out.append(f'<text x="{px(x):.1f}" y="{py(0) + 18:.1f}" text-anchor="middle">{x:g}</text>')
    for y in ys:
        out.append(f'<line x1="{px(0):.1f}" y1="{py(y):.1f}" x2="{px(x_max):.1f}" y2="{py(y):.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{px(0) - 6:.1f}" y="{py(y) + 4:.1f}" text-anchor="end">{y:g}</text>')
    out.append(f'<line x1="{px(0)}" y1="{py(0)}" x2="{px(x_max)}" y2="{py(0)}" stroke="black"/>')
    out.append(f'<line x1="{px(0)}" y1="{py(0)}" x2="{px(0)}" y2="{py(y_max)}" stroke="black"/>')
    path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in points)
    out.append(f'<polyline points="{path}" fill="none" stroke="#1f77b4" stroke-width="2"/>')
    for i, (x, label) in enumerate(marks):
        out.append(f'<line x1="{px(x):.1f}" y1="{py(0):.1f}" x2="{px(x):.1f}" y2="{py(y_max):.1f}" '
                   'stroke="#d62728" stroke-dasharray="5,4"/>')
        out.append(f'<text x="{px(x) + 4:.1f}" y="{py(y_max) + 14 + 14 * i:.1f}" fill="#d62728">{escape(label)}</text>')
    out.append(f'<text x="{_W / 2}" y="{_H - 10}" text-anchor="middle">{escape(x_label)}</text>')
    out.append(f'<text x="15" y="{_H / 2}" text-anchor="middle" transform="rotate(-90 15 {_H / 2})">'
               f'{escape(y_label)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"
