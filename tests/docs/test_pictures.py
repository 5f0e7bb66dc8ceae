"""The documentation's pictures of plans (`tfpar/viz/plan_pictures.py`): each file in
docs/img is what the code draws now, each is shown on a page, and each shows its plan's
numbers, measured in pixels (boxes counted, bar lengths against bytes)."""

import doctest
import os
import re
import subprocess
import sys

import pytest
from PIL import Image

from tfpar.plan import MemoryConfig, advise, estimate_memory
from tfpar.plan.placement import LayerCost
from tfpar.plan.schedule import gpipe, one_f_one_b, timeline, zero_bubble_h1
from tfpar.viz import pipeline_trace, plan_pictures

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
DOCS = os.path.join(ROOT, "docs")
IMG = os.path.join(DOCS, "img")
REMAKE = "python -m tfpar.viz.plan_pictures docs/img"
GIB = 2**30


def _rows(path):
    """The picture's pixels, a list of rows of (r, g, b)."""
    with Image.open(path) as image:
        image = image.convert("RGB")
        width, pixels = image.width, list(image.getdata())
    return [pixels[y:y + width] for y in range(0, len(pixels), width)]


def _bands(rows, colors):
    """[(first y, last y)] of each run of pixel rows holding any of `colors`, top down."""
    bands, start = [], None
    for y, row in enumerate(rows + [[]]):
        hit = any(pixel in colors for pixel in row)
        if hit and start is None:
            start = y
        elif not hit and start is not None:
            bands.append((start, y - 1))
            start = None
    return bands


def _runs(row, colors):
    """[(first x, last x, color)] of each run of one of `colors` along a pixel row."""
    runs = []
    for x, pixel in enumerate(row):
        if pixel in colors:
            if runs and runs[-1][2] == pixel and runs[-1][1] == x - 1:
                runs[-1] = (runs[-1][0], x, pixel)
            else:
                runs.append((x, x, pixel))
    return runs


def _shown(page_text, page):
    """Paths (relative to docs/) of the images a page shows."""
    folder = os.path.dirname(page)
    return {os.path.normpath(os.path.join(folder, target))
            for target in re.findall(r"!\[[^\]]*\]\(([^)\s]+)", page_text)}


def _pages():
    for folder, _, files in os.walk(DOCS):
        for name in files:
            if name.endswith(".md"):
                page = os.path.relpath(os.path.join(folder, name), DOCS)
                yield page, open(os.path.join(DOCS, page)).read()


@pytest.mark.parametrize("name", sorted(plan_pictures.DOC_PICTURES))
def test_the_committed_picture_is_what_the_code_draws(name, tmp_path):
    committed = os.path.join(IMG, name)
    assert os.path.exists(committed), f"docs/img/{name} is missing: run {REMAKE}"
    made = plan_pictures.DOC_PICTURES[name](str(tmp_path / name))
    with Image.open(committed) as old, Image.open(made) as new:
        drawn_by = old.text.get("Software")
        if drawn_by != plan_pictures._software():
            # Text is rasterized by FreeType: another version draws other pixels, the same
            # numbers. (The pictures' numbers are checked below with any version.)
            pytest.skip(f"docs/img/{name} was drawn with {drawn_by}; this is "
                        f"{plan_pictures._software()}")
        # Pixels, not file bytes: another zlib compresses the same pixels differently.
        assert (old.mode, old.size) == (new.mode, new.size), \
            f"docs/img/{name} is not what the code draws: run {REMAKE}"
        assert old.tobytes() == new.tobytes(), \
            f"docs/img/{name} is not what the code draws: run {REMAKE}"


def test_every_picture_is_made_by_the_code_and_shown_on_a_page():
    shown = set().union(*(_shown(text, page) for page, text in _pages()))
    made = {os.path.join("img", name) for name in plan_pictures.DOC_PICTURES}
    in_folder = {os.path.join("img", name) for name in os.listdir(IMG)}
    assert in_folder == made, f"docs/img holds files no code makes: {sorted(in_folder - made)}"
    assert made <= shown, f"pictures no page shows: {sorted(made - shown)}"


SCHEDULES = {"schedule_gpipe.png": gpipe(4, 8), "schedule_1f1b.png": one_f_one_b(4, 8),
             "schedule_zero_bubble_h1.png": zero_bubble_h1(4, 8)}


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_a_schedule_picture_shows_each_stage_s_actions_at_their_times(name, tmp_path):
    """Row s has one box per action of stage s, in its order, each of its kind's color,
    starting and ending at its planned time (K=4, M=8: the pipeline guide's numbers)."""
    schedule = SCHEDULES[name]
    rows = _rows(plan_pictures.DOC_PICTURES[name](str(tmp_path / name)))
    color_of = {kind: color for kind, (_, color) in pipeline_trace._COLORS.items()}
    colors = set(color_of.values())
    bands = _bands(rows, colors)
    assert len(bands) == 1 + schedule.num_stages, bands  # The legend, then a row per stage.
    entries, _ = timeline(schedule)
    unit = 36  # draw_schedule's default unit_width: pixels per time unit.
    # Boxes have a white outline: the color starts a pixel after the box's left edge.
    origin = _runs(rows[bands[1][0] + 2], colors)[0][0] - 1
    for stage, (top, _) in enumerate(bands[1:]):
        # Near the top of the row, above the boxes' labels.
        boxes = _runs(rows[top + 2], colors)
        actions = [(start, end, a) for start, end, a in entries
                   if schedule.rank_of(a.stage) == stage]
        assert [color for _, _, color in boxes] == [
            color_of[a.kind] for a in schedule.stage_orders[stage]], stage
        for (first, last, _), (start, end, action) in zip(boxes, actions):
            assert abs(first - 1 - (origin + start * unit)) <= 1.5, (action, first, start)
            assert abs(last + 1 - (origin + end * unit)) <= 1.5, (action, last, end)


def _bars(rows, colors):
    """Each bar's parts, top down: [{color: pixels}], from a band of `colors` (the first
    band is the legend), read along the middle of the bar; and the x where bars start."""
    bars, starts = [], set()
    for top, bottom in _bands(rows, colors)[1:]:
        runs = _runs(rows[(top + bottom) // 2], colors)
        starts.add(runs[0][0])
        for (_, last, _), (first, _, _) in zip(runs, runs[1:]):
            assert first == last + 1, "a bar's parts must touch"
        parts = {}
        for first, last, color in runs:
            parts[color] = parts.get(color, 0) + last - first + 1
        bars.append(parts)
    assert len(starts) == 1, f"bars start at several x: {sorted(starts)}"
    return bars, starts.pop()


def _budget_x(rows, bottom):
    """The middle x of the budget line below the last bar."""
    xs = [x for x, pixel in enumerate(rows[bottom + 2]) if pixel == plan_pictures.BUDGET_COLOR]
    assert xs, "no budget line"
    return (xs[0] + xs[-1]) / 2


def test_the_memory_picture_draws_each_device_s_bytes_to_scale(tmp_path):
    """docs/guides/zero.md's 1.3e9 parameters, fp32 Adam, 8 devices of 16 GiB: a bar per
    device under data parallelism and ZeRO stages 1-3, each part (weights, gradients,
    optimizer state, ...) as long as its bytes, within a pixel, and the budget at 16 GiB."""
    expected = [device for config in (MemoryConfig("data", 8),
                                      MemoryConfig("sharded", 8, shard="optimizer"),
                                      MemoryConfig("sharded", 8, shard="gradients"),
                                      MemoryConfig("sharded", 8, shard="parameters"))
                for device in estimate_memory(1.3e9, config).devices]
    path = plan_pictures.DOC_PICTURES["memory_zero_stages.png"](str(tmp_path / "m.png"))
    rows = _rows(path)
    parts = {field: color for field, (_, color) in plan_pictures.PARTS.items()}
    bars, start = _bars(rows, set(parts.values()))
    assert len(bars) == len(expected) == 32
    scale = sum(d.total for d in expected) / sum(sum(bar.values()) for bar in bars)  # B/px
    for i, (bar, device) in enumerate(zip(bars, expected)):
        for field, color in parts.items():
            held = getattr(device, field)
            assert abs(bar.get(color, 0) - held / scale) <= 1, (i, field, bar, held)
    bottom = _bands(rows, set(parts.values()))[-1][1]
    assert abs(_budget_x(rows, bottom) - (start + 16 * GIB / scale)) <= 1.5


def test_the_advice_picture_draws_the_layouts_tried_and_marks_the_chosen(tmp_path):
    """docs/guides/zero.md's `advise --layers 50M:1GiB,3B:1GiB,50M:1GiB --devices 16
    --hosts 2 --bytes_per_device 40GiB`: a bar per layout tried (as `explain()` lists them),
    as long as its bytes per device; over budget in one color, the chosen one in another,
    and only it."""
    layers = [LayerCost(f"layer_{i}", params, 0, 0, GIB)
              for i, params in enumerate((50_000_000, 3_000_000_000, 50_000_000))]
    advice = advise(layers, 16, 40 * GIB, hosts=2)
    shown = advice.candidates[:advice.candidates.index(advice.chosen) + 1]
    path = plan_pictures.DOC_PICTURES["advice.png"](str(tmp_path / "a.png"))
    rows = _rows(path)
    colors = {plan_pictures.CHOSEN_COLOR, plan_pictures.FITS_COLOR, plan_pictures.OVER_COLOR}
    bars, start = _bars(rows, colors)
    assert len(bars) == len(shown)
    marked = [i for i, bar in enumerate(bars) if plan_pictures.CHOSEN_COLOR in bar]
    assert marked == [shown.index(advice.chosen)] == [len(shown) - 1]
    for bar, option in zip(bars, shown):
        assert len(bar) == 1, bar
        if option is not advice.chosen:
            assert set(bar) == {plan_pictures.FITS_COLOR if option.fits
                                else plan_pictures.OVER_COLOR}, option.name
    scale = sum(o.bytes_per_device for o in shown) / sum(sum(bar.values()) for bar in bars)
    for bar, option in zip(bars, shown):
        assert abs(sum(bar.values()) - option.bytes_per_device / scale) <= 1, option.name
    bottom = _bands(rows, colors)[-1][1]
    assert abs(_budget_x(rows, bottom) - (start + advice.budget / scale)) <= 1.5


def test_the_pictures_module_imports_no_tensorflow():
    code = ("import sys, tfpar.viz.plan_pictures; print(sorted(m for m in sys.modules "
            "if m.split('.')[0] in ('tensorflow', 'keras')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=True, cwd=ROOT)
    assert done.stdout.strip() == "[]"


def test_the_module_s_examples_run():
    result = doctest.testmod(plan_pictures)
    assert result.attempted and not result.failed
