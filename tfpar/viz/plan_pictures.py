"""Pictures of plans, before anything runs (Pillow, no TensorFlow): a pipeline schedule's
planned timeline, the bytes each device would hold, the advisor's layouts against a budget.

The documentation's pictures are made here and checked against this code by
`tests/docs/test_pictures.py`; after a change to a plan or a drawing, remake them with

    python -m tfpar.viz.plan_pictures docs/img

>>> import os, tempfile
>>> from tfpar.plan.schedule import one_f_one_b
>>> path = draw_schedule(os.path.join(tempfile.mkdtemp(), "1f1b.png"), one_f_one_b(2, 3))
>>> os.path.basename(path)
'1f1b.png'
"""

import argparse
import dataclasses
import math
import os
import sys

from tfpar.plan.advisor import advise
from tfpar.plan.memory import DeviceMemory, MemoryConfig, estimate_memory
from tfpar.plan.placement import LayerCost, format_bytes
from tfpar.plan.schedule import bubble_fraction, gpipe, one_f_one_b, timeline, zero_bubble_h1
from tfpar.plan.units import parse_bytes, parse_count
from tfpar.viz.pipeline_trace import _font, _tick_step, draw_timeline

GIB = 2**30
# Each part of DeviceMemory: its name on the picture and its color (a new field of
# DeviceMemory needs one here: draw_memory_plan's KeyError names it).
PARTS = {"weights": ("weights", (66, 122, 183)),
         "gradients": ("gradients", (230, 140, 50)),
         "optimizer": ("optimizer state", (90, 160, 90)),
         "activations": ("activations", (120, 90, 170)),
         "gather_buffer": ("gather buffer", (60, 170, 170)),
         "inputs": ("inputs", (150, 120, 90)),
         "update": ("update temporaries", (200, 80, 60))}
CHOSEN_COLOR = (40, 150, 80)
FITS_COLOR = (66, 122, 183)
OVER_COLOR = (215, 130, 120)
BUDGET_COLOR = (180, 30, 30)
# draw_timeline's left and right margins for short row names ("stage 3"): schedules drawn
# with one unit_width then share one time scale, so their lengths compare.
_TIMELINE_MARGINS = 190 + 30


def _software():
    """What drew the text: another Pillow or FreeType renders it with other pixels."""
    import PIL
    from PIL import features

    return f"Pillow {PIL.__version__}, FreeType {features.version('freetype2')}"


def _save(image, path):
    from PIL import PngImagePlugin

    info = PngImagePlugin.PngInfo()
    info.add_text("Software", _software())
    image.save(path, pnginfo=info)
    return path


def draw_schedule(path, schedule, forward_cost=1, backward_cost=2, unit_width=36, title=None):
    """Draws `schedule`'s planned timeline (`tfpar.plan.schedule.timeline`: each action
    as soon as its stage is free and its inputs are there; F = 1 and B = 2 time units by
    default, I = W = B / 2), a row per stage, `unit_width` pixels per time unit; saves a
    PNG and returns `path`."""
    from PIL import Image

    entries, makespan = timeline(schedule, forward_cost, backward_cost)
    spans = [(str(action), schedule.rank_of(action.stage), start, end)
             for start, end, action in entries]
    if title is None:
        k, m = schedule.num_stages, schedule.num_micro_batches
        title = (f"{schedule.name}: {k} stages, {m} micro-batches, bubble "
                 f"{bubble_fraction(schedule, forward_cost, backward_cost):.1%} "
                 f"(tfpar.plan.schedule.timeline)")
    costs = f"F = {forward_cost:g}, B = {backward_cost:g}"
    if any(action.kind in "IW" for _, _, action in entries):
        costs += f", I = W = {backward_cost / 2:g}"
    draw_timeline(path, spans, [f"stage {s}" for s in range(schedule.num_stages)], title,
                  _TIMELINE_MARGINS + round(makespan * unit_width), unit=costs, unit_scale=1)
    # Stamped like the other pictures (draw_timeline saves plain PNGs): a test compares
    # pixels only with the Pillow and FreeType that drew them.
    with Image.open(path) as image:
        image.load()
        return _save(image, path)


def _bar_chart(path, title, subtitle, rows, legend, budget=None, width=1000):
    """Horizontal bars of bytes from a common zero, `rows` top to bottom: each
    `(label, [(bytes, color), ...] stacked left to right, note after the bar)`, or None for
    a gap; `legend` (name, color) pairs; `budget` a vertical line behind the bars (it shows
    between them). Saves a PNG; returns `path`."""
    from PIL import Image, ImageDraw

    font, small = _font(14), _font(11)
    measure = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    labels = [row[0] for row in rows if row]
    left = 20 + int(max(measure.textlength(label, font=small) for label in labels))
    right = 30 + int(max(measure.textlength(row[2], font=small) for row in rows if row))
    row_height, bar_height, gap_height, top = 16, 12, 10, 84
    height = top + sum(row_height if row else gap_height for row in rows) + 50
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    draw.text((10, 10), title, fill="black", font=font)
    draw.text((10, 32), subtitle, fill="black", font=small)
    largest = max(max(sum(b for b, _ in row[1]) for row in rows if row), budget or 0)
    # The axis in the binary unit format_bytes would write the largest bar in.
    unit, size = next((u, 1024**i) for i, u in enumerate(("B", "KiB", "MiB", "GiB", "TiB"))
                      if largest < 1024**(i + 1) or u == "TiB")
    step = _tick_step(largest / size)
    end = step * math.ceil(largest / size / step)
    scale = (width - left - right) / (end * size)  # Pixels per byte.
    bottom = height - 50
    tick = 0
    while tick <= end + 1e-9:
        x = left + round(tick * size * scale)
        draw.line([(x, top - 4), (x, bottom)], fill=(225, 225, 225))
        draw.text((x - 6, bottom + 6), f"{tick:g}", fill="black", font=small)
        tick += step
    axis = f"{unit} per device"
    draw.text((width - right - draw.textlength(axis, font=small), bottom + 24), axis,
              fill="black", font=small)
    x = 10
    if budget is not None:
        legend = list(legend) + [(f"budget {format_bytes(budget)}", None)]
        bx = left + round(budget * scale)
        draw.line([(bx, top - 4), (bx, bottom + 4)], fill=BUDGET_COLOR, width=2)
    for name, color in legend:
        if color is None:  # The budget: a line, as in the chart.
            draw.line([(x + 6, 56), (x + 6, 68)], fill=BUDGET_COLOR, width=2)
        else:
            draw.rectangle([x, 56, x + 12, 68], fill=color)
        draw.text((x + 18, 56), name, fill="black", font=small)
        x += 36 + draw.textlength(name, font=small)
    y = top
    for row in rows:
        if row is None:
            y += gap_height
            continue
        label, segments, note = row
        draw.text((left - 8 - draw.textlength(label, font=small), y + 1), label, fill="black",
                  font=small)
        # Each edge rounded from the running sum: a part is within a pixel of its bytes.
        total = 0
        for value, color in segments:
            x0 = left + round(total * scale)
            total += value
            x1 = left + round(total * scale)
            if x1 > x0:
                draw.rectangle([x0, y + 2, x1 - 1, y + 1 + bar_height], fill=color)
        draw.text((left + round(total * scale) + 6, y + 1), note, fill="black", font=small)
        y += row_height
    return _save(image, path)


def draw_memory_plan(path, estimates, budget=None, title=None, width=1000):
    """Draws a stacked bar per device of what it holds (`DeviceMemory`'s parts: weights,
    gradients, optimizer state, ...). `estimates`: a `MemoryEstimate`
    (`tfpar.plan.estimate_memory`), or `(name, estimate)` pairs drawn one group after
    another; `budget`: bytes per device, drawn as a line. Saves a PNG; returns `path`."""
    groups = [("", estimates)] if hasattr(estimates, "devices") else list(estimates)
    parts = [field.name for field in dataclasses.fields(DeviceMemory)]
    rows = []
    for name, estimate in groups:
        rows += [None] if rows else []
        for i, device in enumerate(estimate.devices):
            label = f"{name}, device {i}" if name and i == 0 else f"device {i}"
            rows.append((label, [(getattr(device, p), PARTS[p][1]) for p in parts],
                         format_bytes(device.total)))
    held = [p for p in parts if any(getattr(d, p) for _, e in groups for d in e.devices)]
    if title is None:
        title = f"{groups[0][1].num_params:,} parameters: bytes per device"
    return _bar_chart(path, title, "tfpar.plan.estimate_memory, per device", rows,
                      [PARTS[p] for p in held], budget, width)


def _shown(advice):
    """The layouts `Advice.explain` lists: in order of preference up to the chosen one
    (all when none fits)."""
    if advice.chosen is None:
        return list(advice.candidates)
    return list(advice.candidates[:advice.candidates.index(advice.chosen) + 1])


def draw_advice(path, advice, title=None, width=1000):
    """Draws the layouts the advisor tried (`tfpar.plan.advise`'s `Advice`), in its order,
    as `explain()` lists them: a bar per layout of its bytes on the fullest device, against
    the budget; the chosen one in green. Saves a PNG; returns `path`."""
    shown = _shown(advice)
    rows = []
    for option in shown:
        chosen = option is advice.chosen
        color = CHOSEN_COLOR if chosen else FITS_COLOR if option.fits else OVER_COLOR
        rows.append((option.name, [(option.bytes_per_device, color)],
                     f"{format_bytes(option.bytes_per_device)}  ({option.degrees})"
                     f"{'  chosen' if chosen else ''}"))
    kinds = [("chosen", CHOSEN_COLOR, advice.chosen is not None),
             ("fits", FITS_COLOR, any(o.fits and o is not advice.chosen for o in shown)),
             ("over budget", OVER_COLOR, any(not o.fits for o in shown))]
    more = len(advice.candidates) - len(shown)
    subtitle = ("tfpar.plan.advise: layouts in order of preference (data x pipe x model), "
                + (f"up to the first that fits; {more} more, with more communication, not "
                   f"needed" if more else "up to the first that fits" if advice.chosen
                   else "none fits"))
    if title is None:
        title = f"The advisor's layouts: {format_bytes(advice.budget)} per device"
    return _bar_chart(path, title, subtitle, rows,
                      [(name, color) for name, color, used in kinds if used], advice.budget,
                      width)


# --- The documentation's pictures ------------------------------------------------------
# Each is an example the guides already discuss, with their numbers.

def _zero_stages_example():
    """docs/guides/zero.md's model: 1.3e9 parameters, fp32 Adam, 8 devices of 16 GiB, under
    data parallelism and ZeRO stages 1-3: `[(name, estimate)]` and the budget."""
    configs = [("data parallel", MemoryConfig("data", 8))] + [
        (f"ZeRO stage {stage}", MemoryConfig("sharded", 8, shard=shard))
        for stage, shard in enumerate(("optimizer", "gradients", "parameters"), 1)]
    return [(name, estimate_memory(1.3e9, config)) for name, config in configs], 16 * GIB


def _layers_advice_example():
    """docs/guides/zero.md's `advise --layers 50M:1GiB,3B:1GiB,50M:1GiB --devices 16
    --hosts 2 --bytes_per_device 40GiB`."""
    layers = [LayerCost(f"layer_{i}", parse_count(params), 0, 0, parse_bytes("1GiB"))
              for i, params in enumerate(("50M", "3B", "50M"))]
    return advise(layers, 16, parse_bytes("40GiB"), hosts=2)


def _memory_picture(path):
    groups, budget = _zero_stages_example()
    return draw_memory_plan(
        path, groups, budget,
        "1.3e9 parameters, fp32 Adam, 8 devices of 16 GiB: data parallel and ZeRO stages 1-3")


def _advice_picture(path):
    return draw_advice(
        path, _layers_advice_example(),
        "Layers of 50M, 3B and 50M parameters (1 GiB of activations each), 16 devices of "
        "40 GiB on 2 hosts")


# K = 4 stages and M = 8 micro-batches: the pipeline guide's bubble fractions.
DOC_PICTURES = {
    "schedule_gpipe.png": lambda path: draw_schedule(path, gpipe(4, 8)),
    "schedule_1f1b.png": lambda path: draw_schedule(path, one_f_one_b(4, 8)),
    "schedule_zero_bubble_h1.png": lambda path: draw_schedule(path, zero_bubble_h1(4, 8)),
    "memory_zero_stages.png": _memory_picture,
    "advice.png": _advice_picture,
}


def write_doc_pictures(directory):
    """Writes every picture of `DOC_PICTURES` into `directory`; returns their paths."""
    os.makedirs(directory, exist_ok=True)
    return [draw(os.path.join(directory, name)) for name, draw in DOC_PICTURES.items()]


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m tfpar.viz.plan_pictures",
        description="Draws the documentation's pictures of plans (schedules, memory, advice).")
    parser.add_argument("directory", help="where to write them, e.g. docs/img")
    for path in write_doc_pictures(parser.parse_args(argv).directory):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
