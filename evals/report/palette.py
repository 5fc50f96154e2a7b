"""How each method is drawn: a colour per method family, a shade and a marker per member, and a line
style per variant, so that twenty methods on one panel stay apart and related ones look related.

Families (by what a method's eviction score reads): the full cache; recency (a sliding window with
sinks); accumulated attention (H2O, VATP, TOVA: the attention a slot received); LongFlow; reasoning-
aware (R-KV, RPC, BeaconKV, InfoKV, Kara: made for long reasoning outputs); key geometry (KeyDiff,
Expected Attention, CompressKV: the keys themselves, or queries expected from them); learned (LKV);
random (Random Attention). AMS over a scorer X (`ams_<x>`) is drawn in X's colour and marker with a
dashed line; a variant other than the paper's (the LongFlow authors' `lf_repo`) dotted; a budget form
other than the cap (R-KV's `target`, RPC's `ratio`) dash-dotted. Methods outside these families get
colours of their own after them.
"""

from __future__ import annotations

from dataclasses import dataclass

import matplotlib

from evals.report.names import CAPPED, DEFAULT_VARIANT

FAMILY_MEMBERS = {
    "full cache": ("vanilla",),
    "recency": ("streaming",),
    "accumulated attention": ("h2o", "vatp", "tova"),
    "LongFlow": ("longflow",),
    "reasoning-aware": ("rkv", "rpc", "beaconkv", "infokv", "kara"),
    "key geometry": ("keydiff", "expected_attention", "compresskv"),
    "learned": ("lkv",),
    "random": ("random_attention",),
}
# A family of several members: a sequential colormap, its members spread over `SHADES` of it (light
# shades are left out: they vanish on white). A family of one: a single colour.
FAMILY_COLOURS = {"full cache": "0.25", "recency": "#8c564b", "accumulated attention": "Blues",
                  "LongFlow": "#d62728", "reasoning-aware": "Greens", "key geometry": "Purples",
                  "learned": "#ff7f0e", "random": "#bcbd22"}
SHADES = (0.95, 0.45)  # darkest and lightest point of a family's colormap
MARKERS = ("o", "s", "^", "v", "D")  # the members of a family, in order
SOLE_MARKER = {"full cache": "", "recency": "v", "LongFlow": "D", "learned": "X", "random": "h"}
WRAPPER = "ams_"  # AMS over the scorer named after it
WRAPPER_LINE = "--"
VARIANT_LINE = ":"  # a variant other than the paper's
BUDGET_FORM_LINE = "-."  # a budget form other than the cap
SPARE_MARKERS = ("P", "*", "p", "8", "H", "d")  # for series that would otherwise look the same
OTHERS = "tab20"  # methods outside the families


@dataclass(frozen=True)
class Style:
    """A series' look: a matplotlib colour, a line style, a marker ("" for none)."""

    color: str
    linestyle: str
    marker: str


def family_of(method: str) -> str | None:
    """The family of a method config name (of the scorer, for AMS over it); None outside them."""
    method = method.removeprefix(WRAPPER)
    return next((family for family, members in FAMILY_MEMBERS.items() if method in members), None)


def member_style(method: str) -> Style | None:
    """The solid-line style of a family member; None for a method outside the families."""
    family = family_of(method)
    if family is None:
        return None
    members = FAMILY_MEMBERS[family]
    colour = FAMILY_COLOURS[family]
    if len(members) == 1:
        return Style(colour, "-", SOLE_MARKER[family])
    position = members.index(method)
    shade = SHADES[0] + (SHADES[1] - SHADES[0]) * position / (len(members) - 1)
    return Style(matplotlib.colors.to_hex(matplotlib.colormaps[colour](shade)), "-", MARKERS[position])


def method_style(method: str, variant: str = DEFAULT_VARIANT, budget_mode: str | None = None) -> Style | None:
    """The style of a method config name as its paper defines it, or of one of its variants or
    budget forms; None outside the families (`styles` colours those)."""
    wrapped = method.startswith(WRAPPER) and member_style(method.removeprefix(WRAPPER)) is not None
    base = member_style(method.removeprefix(WRAPPER) if wrapped else method)
    if base is None:
        return None
    line = WRAPPER_LINE if wrapped else base.linestyle
    if isinstance(budget_mode, str) and budget_mode != CAPPED:
        line = BUDGET_FORM_LINE
    if isinstance(variant, str) and variant != DEFAULT_VARIANT:
        line = VARIANT_LINE
    return Style(base.color, line, base.marker)


def styles(series: list[tuple[str, str, str | None, str | None]]) -> dict[str, Style]:
    """A style per series, given as (series label, method, variant, budget mode) in drawing order:
    `method_style`, else a colour of `OTHERS` in turn; a series that would look like one before it
    (the same method under another generation config) takes a spare marker."""
    others = [matplotlib.colors.to_hex(c) for c in matplotlib.colormaps[OTHERS].colors]
    others = others[0::2] + others[1::2]  # the dark shade of each hue first
    found: dict[str, Style] = {}
    unknown = 0
    for label, method, variant, mode in series:
        if label in found:
            continue
        style = method_style(method, variant, mode)
        if style is None:
            style = Style(others[unknown % len(others)], "-", "o")
            unknown += 1
        taken = set(found.values())
        free = [Style(style.color, style.linestyle, m) for m in (style.marker, *SPARE_MARKERS)]
        found[label] = next((s for s in free if s not in taken), style)
    return found
