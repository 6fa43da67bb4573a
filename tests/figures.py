"""What a reader sees of a drawn matplotlib figure, for the tests of every figure the project ships: the rendered
extents of its texts (no two may overlap, none may be cut off at the figure's edge) and the styles of the series in
each panel (no two may share a colour and a marker)."""

import itertools

import matplotlib.colors
import matplotlib.text


def rendered_texts(figure) -> list:
    """(text, display-space bbox) of every visible, non-empty text the figure draws: its title, each panel's titles,
    axis labels, tick labels (those within the view), legend entries and annotations."""
    figure.canvas.draw()
    renderer = figure.canvas.get_renderer()
    texts = list(figure.texts) + ([figure._suptitle] if figure._suptitle is not None else [])
    texts += [text for legend in figure.legends for text in [*legend.get_texts(), legend.get_title()]]
    for ax in figure.axes:
        texts += [ax.title, ax._left_title, ax._right_title, ax.xaxis.label, ax.yaxis.label, *ax.texts]
        for axis in (ax.xaxis, ax.yaxis):
            low, high = sorted(axis.get_view_interval())
            tolerance = 1e-9 * max(1.0, abs(high - low))
            texts += [label for tick in axis.get_major_ticks() if low - tolerance <= tick.get_loc() <= high + tolerance
                      for label in (tick.label1, tick.label2)]  # a tick outside the view is not drawn
        legend = ax.get_legend()
        if legend is not None:
            texts += [*legend.get_texts(), legend.get_title()]
    # an annotation's own extent takes in its arrow: the words alone are what a reader must be able to tell apart
    return [(text.get_text(), matplotlib.text.Text.get_window_extent(text, renderer)) for text in dict.fromkeys(texts)
            if text.get_visible() and text.get_text().strip()]


def overlapping_texts(figure, slack: float = 0.5) -> list[str]:
    """Every pair of rendered texts whose boxes overlap by more than `slack` pixels each way, and every text that
    reaches past the figure's edge (cut off): one line each, empty when the figure reads cleanly."""
    texts = rendered_texts(figure)
    width, height = figure.bbox.width, figure.bbox.height
    problems = [f"cut off at the edge: {text!r} at x {box.x0:.0f}-{box.x1:.0f}, y {box.y0:.0f}-{box.y1:.0f} of "
                f"{width:.0f} x {height:.0f}" for text, box in texts
                if box.x0 < -slack or box.y0 < -slack or box.x1 > width + slack or box.y1 > height + slack]
    for (a, box_a), (b, box_b) in itertools.combinations(texts, 2):
        if (min(box_a.x1, box_b.x1) - max(box_a.x0, box_b.x0) > slack
                and min(box_a.y1, box_b.y1) - max(box_a.y0, box_b.y0) > slack):
            problems.append(f"overlap: {a!r} and {b!r}")
    return problems


def series_sharing_a_style(figure) -> list[str]:
    """Within each panel, the series (lines and point sets drawn with a marker; error-bar caps, grid and reference
    lines aside) that share both a colour and a marker with another: a reader could not tell them apart."""
    problems = []
    for number, ax in enumerate(figure.axes):
        seen = {}
        for line in ax.get_lines():
            marker = line.get_marker()
            if marker in (None, "None", "", " ", "|", "_") or not line.get_visible():
                continue
            style = (matplotlib.colors.to_hex(line.get_color()), str(marker), line.get_linestyle())
            if style in seen:
                problems.append(f"panel {number}: {seen[style]!r} and {line.get_label()!r} share {style}")
            seen.setdefault(style, line.get_label())
    return problems
