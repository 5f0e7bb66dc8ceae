"""A profiled pipeline step as a Chrome trace (JSON) and as a timeline picture (PNG).

The step runs under TensorFlow's profiler, which records every op on every thread
without changing the graph (time-stamp ops would: TensorFlow orders stateful ops
among themselves, which would serialize the stages). Each op belongs to the action
whose name scope it was built in (`pipeline_r0/1F0/...`; the gradient of that
forward, `gradient_tape/pipeline_r0/1F0/...`, is `1B0`); an action spans from its
first op's start to its last op's end.

Spans are `(label, device_row, start_seconds, end_seconds)`; rows are devices
(one per pipeline replica and stage). The JSON opens in chrome://tracing or
Perfetto; the picture is drawn with Pillow (a dependency of tfpar).
"""

import glob
import json
import os
import re

_FORWARD_COLOR = (66, 122, 183)
_BACKWARD_COLOR = (230, 140, 50)
_INPUT_GRAD_COLOR = (200, 80, 60)
_WEIGHT_GRAD_COLOR = (120, 90, 170)
_OTHER_COLOR = (120, 120, 120)
_COLORS = {"F": ("forward", _FORWARD_COLOR), "B": ("backward", _BACKWARD_COLOR),
           "I": ("input grad", _INPUT_GRAD_COLOR), "W": ("weight grad", _WEIGHT_GRAD_COLOR)}


_ACTION_OP = re.compile(r"^(?:gradient_tape/)?pipeline_r(\d+)(?:_\d+)?/(\d+)([FBIW])(\d+)/")
_OP_EVENT = re.compile(r"^([^:]+):([^:]+)$")  # "name:type"; executor bookkeeping has "::".
# Not timed: transfers wait rather than compute, and variable reads or identities
# (which may run as soon as the previous action ends) are instants.
_NOT_TIMED = {"_Send", "_Recv", "_HostSend", "_HostRecv", "ReadVariableOp", "Identity",
              "IdentityN", "Const", "NoOp"}


def action_of_op(name):
    """`(replica, label)` of a pipeline train-step op, e.g. `(0, "1B0")`; None for others."""
    match = _ACTION_OP.match(name)
    if match is None:
        return None
    kind = "B" if name.startswith("gradient_tape/") else match[3]
    return int(match[1]), f"{match[2]}{kind}{match[4]}"


def profiled_ops(logdir, absolute=False):
    """`(op name, op type, start s, end s, thread)` of every op TensorFlow's profiler wrote
    to `logdir`; times from the profile's start, or with `absolute` from the epoch (to put
    several tasks' profiles on one timeline)."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    paths = sorted(glob.glob(os.path.join(logdir, "plugins", "profile", "*", "*.xplane.pb")))
    if not paths:
        raise RuntimeError(f"TensorFlow's profiler wrote no profile under {logdir}.")
    space = xplane_pb2.XSpace()
    with open(paths[-1], "rb") as f:
        space.ParseFromString(f.read())
    origin = 0.0
    if absolute:
        # Lines are timed from the profile's start, which TensorFlow records apart.
        starts = [st.int64_value or st.uint64_value for plane in space.planes
                  if plane.name == "Task Environment" for st in plane.stats
                  if plane.stat_metadata[st.metadata_id].name == "profile_start_time"]
        if not starts:
            from importlib.metadata import version

            raise RuntimeError(
                f"The profile in {logdir} has no profile_start_time (TensorFlow "
                f"{version('tensorflow')}), so profiles of several tasks cannot be put on one "
                f"timeline; tfpar was built against TensorFlow 2.21.")
        origin = starts[0] * 1e-9
    ops = []
    for plane in space.planes:
        for line in plane.lines:
            for event in line.events:
                match = _OP_EVENT.match(plane.event_metadata[event.metadata_id].name)
                if match is None:
                    continue
                start = origin + line.timestamp_ns * 1e-9 + event.offset_ps * 1e-12
                ops.append((match[1], match[2], start, start + event.duration_ps * 1e-12,
                            line.name))
    return ops


def action_spans(ops, num_stages):
    """`[(label, row, start, end)]` of the pipeline's actions; row = replica * K + stage
    (a chunk's stage: chunk % K).

    A gradient op is named after the forward op it differentiates, so it reads as B. With
    a split backward, each I and W action starts with a marker op (`.../1W0/start`): a
    gradient op that starts at or after its W's marker is the W's, else the I's.
    """
    ops = [(found, kind, start, end) for name, kind, start, end, _ in ops
           if (found := action_of_op(name)) is not None and kind not in _NOT_TIMED]
    starts = {}
    for found, _, start, _ in ops:
        if found[1][len(re.match(r"\d+", found[1])[0])] in "IW":
            starts[found] = min(start, starts.get(found, start))
    spans = {}
    for (replica, label), _, start, end in ops:
        chunk, _, micro = label.partition("B")
        if micro and (replica, f"{chunk}I{micro}") in starts:
            w = starts.get((replica, f"{chunk}W{micro}"))
            label = f"{chunk}{'W' if w is not None and start >= w else 'I'}{micro}"
        first, last = spans.get((replica, label), (start, end))
        spans[replica, label] = (min(first, start), max(last, end))
    return sorted(((label, replica * num_stages + int(re.match(r"\d+", label)[0]) % num_stages,
                    start, end) for (replica, label), (start, end) in spans.items()),
                  key=lambda s: s[2])


def chrome_events(spans, row_names):
    """Chrome trace events ("X" complete events, microseconds from the first start)."""
    origin = min(start for _, _, start, _ in spans)
    events = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": row,
               "args": {"name": name}} for row, name in enumerate(row_names)]
    for label, row, start, end in spans:
        events.append({"name": label, "cat": "pipeline", "ph": "X", "pid": 0, "tid": row,
                       "ts": round((start - origin) * 1e6, 3),
                       "dur": round((end - start) * 1e6, 3), "args": {"device": row_names[row]}})
    return events


def write_chrome_trace(path, spans, row_names, metadata=None):
    """Writes `{"traceEvents": [...]}` to `path`; returns the events."""
    events = chrome_events(spans, row_names)
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms",
                   "otherData": dict(metadata or {})}, f, indent=1)
    return events


def write_step_trace(path, spans, row_names, title):
    """A step's timeline as files: a Chrome trace at `path` and its picture beside it (`path`
    with `.png` in place of a `.json` suffix). Returns the trace events."""
    events = write_chrome_trace(path, spans, row_names, {"title": title})
    png = path[:-5] if path.endswith(".json") else path
    draw_timeline(png + ".png", spans, row_names, title)
    return events


def _font(size):
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1: one bitmap size.
        return ImageFont.load_default()


def _tick_step(total_ms):
    for step in (0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000):
        if total_ms / step <= 12:
            return step
    return 10000


def draw_timeline(path, spans, row_names, title, width=1400, unit="ms", unit_scale=1e3):
    """Draws one box per span, a row per device, time on the x axis (a span's seconds times
    `unit_scale`, in `unit`s: ms by default); saves a PNG."""
    from PIL import Image, ImageDraw

    origin = min(start for _, _, start, _ in spans)
    total_ms = max((end - origin) * unit_scale for _, _, _, end in spans) or 1.0
    left, right, top, row_height, gap = 190, 30, 58, 44, 8
    height = top + len(row_names) * row_height + 50
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    font, small = _font(14), _font(11)
    # Room for the longest row name (a worker's device name is long).
    left = max(left, 20 + int(max(draw.textlength(name, font=small) for name in row_names)))
    draw.text((left, 14), title, fill="black", font=font)
    scale = (width - left - right) / total_ms

    def x_of(ms):
        return left + ms * scale

    step = _tick_step(total_ms)
    tick = 0.0
    bottom = top + len(row_names) * row_height
    while tick <= total_ms + 1e-9:
        x = x_of(tick)
        draw.line([(x, top - 4), (x, bottom)], fill=(225, 225, 225))
        draw.text((x - 10, bottom + 6), f"{tick:g}", fill="black", font=small)
        tick += step
    axis = f"time ({unit})"
    draw.text((width - right - max(60, draw.textlength(axis, font=small)), bottom + 24), axis,
              fill="black", font=small)
    for row, name in enumerate(row_names):
        y = top + row * row_height
        draw.text((10, y + row_height / 2 - 8), name, fill="black", font=small)
    for label, row, start, end in spans:
        y0 = top + row * row_height + gap / 2
        x0, x1 = x_of((start - origin) * unit_scale), x_of((end - origin) * unit_scale)
        kind = re.sub(r"\d", "", label)
        color = _COLORS.get(kind, ("", _OTHER_COLOR))[1]
        draw.rectangle([x0, y0, max(x1, x0 + 1), y0 + row_height - gap], fill=color,
                       outline="white")
        if x1 - x0 > 8 * len(label):
            draw.text((x0 + 3, y0 + row_height / 2 - 10), label, fill="white", font=small)
    legend_y = top - 22
    kinds = sorted({re.sub(r"\d", "", label) for label, _, _, _ in spans} & set(_COLORS),
                   key="FBIW".index)
    for i, (name, color) in enumerate(_COLORS[k] for k in kinds):
        x = width - right - 100 * len(kinds) + i * 100
        draw.rectangle([x, legend_y, x + 14, legend_y + 12], fill=color)
        draw.text((x + 18, legend_y - 1), name, fill="black", font=small)
    image.save(path)
    return path
