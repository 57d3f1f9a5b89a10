"""The placement picture: a `PlanReport.to_dict()` drawn as one standalone SVG document."""

from __future__ import annotations

import os
import re
from typing import Any
from xml.sax.saxutils import escape, quoteattr

from hybridllm.plan.memory_budget import format_bytes

WIDTH = 960
PAD = 20
FONT = "system-ui, sans-serif"
# One fixed palette so pictures compare across runs and read the same in every browser.
GPU, CPU, TEXT, MUTED, LINE = "#4d9a2a", "#2f6fdb", "#111827", "#4b5563", "#9ca3af"
BOX_FILL = {"gpu": "#eef7e8", "cpu": "#eaf1fc"}
MEMORY = (("weights", "#475569"), ("activations", "#f59e0b"), ("kv", "#14b8a6"))
FREE, BUDGET = "#e5e7eb", "#dc2626"
# Characters XML 1.0 cannot hold at all: a name carrying one must not break the document.
_INVALID_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ufffe\uffff]")


def _clean(value: Any) -> str:
    return _INVALID_XML.sub("?", str(value))


def _attr(value: Any) -> str:
    return quoteattr(_clean(value))


def _fit(text: str, width: float, size: float, bold: bool = False) -> str:
    """Cut a line to the characters `width` pixels hold (SVG cannot wrap or measure text)."""
    limit = max(4, int(width / (size * (0.62 if bold else 0.55))))
    return text if len(text) <= limit else text[: limit - 1] + "\u2026"


def _text(
    x: float, y: float, s: str, size: float = 12, cls: str = "", tip: str = "", **style: Any
) -> str:
    """A text line, cut to fit before the picture's right edge; the whole line as its tooltip."""
    shown = _fit(s, WIDTH - PAD - x, size, style.get("font_weight") == "bold")
    tip = tip or (s if shown != s else "")
    tip = f"<title>{escape(_clean(tip))}</title>" if tip else ""
    attrs = "".join(f" {k.replace('_', '-')}={_attr(v)}" for k, v in style.items())
    klass = f" class={_attr(cls)}" if cls else ""
    return (
        f'<text x="{x:g}" y="{y:g}" font-size="{size:g}"{klass}{attrs}>'
        f"{tip}{escape(_clean(shown))}</text>"
    )


def _rect(x: float, y: float, w: float, h: float, fill: str, extra: str = "") -> str:
    return f'<rect x="{x:g}" y="{y:g}" width="{w:g}" height="{h:g}" fill="{fill}"{extra}/>'


def _rates(pred: dict[str, Any]) -> str:
    decode = [f"batch {d['batch']}: {d['tokens_per_s']:,.1f} tok/s" for d in pred["decode"]]
    if decode:
        decode[0] = "decode " + decode[0]
    prefill = f"prefill: {pred['prefill_tokens_per_s']:,.1f} tok/s"
    return "predicted " + " \u00b7 ".join([*decode, prefill]) + f" (context {pred['context_len']})"


def _device_name(device: str, report: dict[str, Any], threads: int | None = None) -> str:
    """'cuda:0 · H100 80.00 GiB' from hardware.gpus; 'cpu · AMD EPYC, 16 threads' for the host."""
    hw = report.get("hardware") or {}
    if device == "cpu":
        model = (hw.get("cpu") or {}).get("model") or "host CPU"
        return f"cpu \u00b7 {model}" + (f", {threads} threads" if threads else "")
    for gpu in hw.get("gpus") or ():
        if gpu.get("device") == device:
            return (
                f"{device} \u00b7 {gpu.get('name', '')} {format_bytes(gpu.get('total_bytes', 0))}"
            )
    return device


def _layers(start: int, end: int) -> str:
    # Shown inclusive everywhere ("layers 0-23" for the data's [0, 24)).
    return f"layer {start}" if end - start == 1 else f"layers {start}-{end - 1}"


def _stage(
    report: dict[str, Any], stage: dict[str, Any], y: float, pitch: float
) -> tuple[list[str], float]:
    """One pipeline stage: its workers side by side, then its layer strip and notes."""
    workers, start, end = stage["workers"], stage["layer_start"], stage["layer_end"]
    kind = "cpu" if all(w["device"] == "cpu" for w in workers) else "gpu"
    out = [f'<g class="stage" data-pp-rank="{int(stage["pp_rank"])}" data-kind="{kind}">']
    head = f"stage {stage['pp_rank']}"
    if len(workers) > 1:
        head += f" \u00b7 tensor parallel x {len(workers)}"
    out.append(_text(PAD, y + 14, head, 13, "stage-label", font_weight="bold", fill=TEXT))
    # At most four boxes a row: narrower ones could not hold a device name.
    per_row = min(4, len(workers))
    node = [f"node {stage['node']}"] if stage.get("node") else []
    # Three lines under the device name, a fourth for the cluster node
    box_w, box_h, gap = (WIDTH - 2 * PAD - (per_row - 1) * 8) / per_row, 72 + 15 * len(node), 8
    extras = "+ embedding " * bool(stage["has_embedding"]) + "+ LM head" * bool(
        stage["has_lm_head"]
    )
    for i, w in enumerate(workers):
        bx, by = PAD + (i % per_row) * (box_w + gap), y + 22 + (i // per_row) * (box_h + gap)
        name = _device_name(w["device"], report, w.get("num_threads"))
        rank = f"rank {w['rank']}"
        if w.get("shard"):
            rank += f" \u00b7 tp {w['tp_rank']} \u00b7 {100 * w['shard']['share']:.3g}% shard"
        lines = [
            f"{_layers(start, end)} {extras}".rstrip(),
            f"weights {format_bytes(w['weight_bytes'])}",
            *node,
        ]
        tip = " \n".join([name, rank, *lines])
        wk = "cpu" if w["device"] == "cpu" else "gpu"
        out.append(
            f'<g class="worker {wk}" data-rank="{int(w["rank"])}" data-device={_attr(w["device"])}>'
            f"<title>{escape(_clean(tip))}</title>"
            + _rect(bx, by, box_w, box_h, BOX_FILL[wk], f' rx="6" stroke="{LINE}"')
        )
        fit = box_w - 16  # cut each line to its box, not the picture
        out.append(
            f'<text x="{bx + 8:g}" y="{by + 17:g}" font-size="12" font-weight="bold" '
            f'class="device-label" fill="{GPU if wk == "gpu" else CPU}">'
            f"{escape(_clean(_fit(name, fit, 12, bold=True)))}</text>"
        )
        for j, line in enumerate([rank, *lines]):
            out.append(
                f'<text x="{bx + 8:g}" y="{by + 34 + 15 * j:g}" font-size="11" fill="{TEXT}">'
                f"{escape(_clean(_fit(line, fit, 11)))}</text>"
            )
        out.append("</g>")
    y += 22 + -(-len(workers) // per_row) * (box_h + gap) + 4
    # The strip places each layer at its position in the whole model, so stages line up.
    x0 = PAD
    out.append(_rect(x0, y + 6, WIDTH - 2 * PAD, 2, FREE))  # the whole model's track
    experts = set(stage.get("cpu_expert_layers") or ())
    gap = 1 if pitch >= 4 else 0
    for layer in range(start, end):
        lx, lw = x0 + round(layer * pitch), round((layer + 1) * pitch) - round(layer * pitch) - gap
        cls = "experts-cpu" if layer in experts else kind
        tip = f"layer {layer} on {workers[0]['device']}" + (
            ", routed experts on cpu" if cls == "experts-cpu" else ""
        )
        out.append(
            f'<g class="layer {cls}" data-layer="{layer}"><title>{escape(_clean(tip))}</title>'
        )
        if cls == "experts-cpu":  # attention etc. on the GPU above, the experts on the CPU below
            out.append(_rect(lx, y, lw, 7, GPU) + _rect(lx, y + 7, lw, 7, CPU))
        else:
            out.append(_rect(lx, y, lw, 14, GPU if kind == "gpu" else CPU))
        out.append("</g>")
    stream = stage.get("stream")
    threshold = (stream or {}).get("threshold_tokens")
    on = stream is not None and (threshold is None or threshold >= 0)  # below 0: streaming off
    if on:
        sx, sw = x0 + round(start * pitch) - 2, round(end * pitch) - round(start * pitch) + 3
        dash = f' class="stream-marker" stroke="{GPU}" stroke-dasharray="4 2"'
        out.append(_rect(sx, y - 2, sw, 18, "none", dash))
    lx_end = x0 + round(end * pitch)
    out.append(_text(x0 + round(start * pitch), y + 27, str(start), 10, fill=MUTED))
    if end - start > 1:
        out.append(_text(lx_end - 12, y + 27, str(end - 1), 10, fill=MUTED))
    y += 32
    notes = []
    if experts:
        size = format_bytes(stage.get("cpu_expert_bytes", 0))
        notes.append(("note experts", f"routed experts of {len(experts)} layers on cpu ({size})"))
    if stream is not None:
        text = f"streams layers to {stream['device']}"
        if threshold is not None:
            text += f" for steps >= {threshold} tokens"
        notes.append(("note stream", text if on else f"streaming to {stream['device']} off"))
    mtp = report.get("mtp")
    if mtp and stage.get("has_lm_head"):
        text = f"+ the MTP layer (speculative drafts) on {mtp['device']}, "
        text += format_bytes(mtp["weight_bytes"])
        if mtp.get("cpu_expert_bytes"):
            text += f"; its routed experts on cpu ({format_bytes(mtp['cpu_expert_bytes'])})"
        notes.append(("note mtp", text))
    for cls, note in notes:
        out.append(_text(PAD, y + 10, note, 11, cls, fill=MUTED))
        y += 16
    out.append("</g>")
    return out, y


def _memory(report: dict[str, Any], dev: dict[str, Any], y: float) -> tuple[list[str], float]:
    """A device's memory as one bar: its whole memory wide, weights / activations / KV / free."""
    device, total = dev["device"], int(dev.get("total_bytes") or 0)
    parts = {
        "weights": dev["weight_bytes"],
        "activations": dev["activation_bytes"],
        "kv": dev["kv_cache_bytes"],
    }
    used = sum(parts.values())
    label = _device_name(device, report) + (" (host RAM)" if device == "cpu" else "")
    out = [f'<g class="memory" data-device={_attr(device)}>']
    out.append(_text(PAD, y + 12, label, 12, "device-label", font_weight="bold", fill=TEXT))
    words = " \u00b7 ".join(
        [
            f"weights {format_bytes(parts['weights'])}",
            f"activations {format_bytes(parts['activations'])}",
            f"KV cache {format_bytes(parts['kv'])}",
        ]
        + ([f"free {format_bytes(max(0, total - used))} of {format_bytes(total)}"] if total else [])
        + (
            [f"KV capacity {dev['kv_capacity_tokens']:,} tokens"]
            if dev["kv_bytes_per_token"]
            else []
        )
    )
    y += 18
    if total > 0:  # no size known (a device missing from hardware): the numbers only, no bar
        bar_w = WIDTH - 2 * PAD
        # An over-full device scales by what it holds, so the bar never runs past the picture.
        scale = bar_w / max(total, used)
        out.append(_rect(PAD, y, bar_w, 16, FREE, f' class="mem-bar" data-bytes="{total}"'))
        x = float(PAD)
        for (name, color), nbytes in zip(MEMORY, parts.values()):
            w = nbytes * scale
            tip = escape(f"{name}: {format_bytes(nbytes)}")
            out.append(
                f'<rect class="seg {name}" data-bytes="{int(nbytes)}" x="{x:.2f}" y="{y:g}" '
                f'width="{w:.2f}" height="16" fill="{color}"><title>{tip}</title></rect>'
            )
            if w > 70:  # the bytes inside a segment only where they fit
                out.append(_text(x + 4, y + 12, format_bytes(nbytes), 10, fill="#ffffff"))
            x += w
        bx = PAD + dev["budget_bytes"] * scale
        out.append(
            f'<line class="budget" x1="{bx:.2f}" y1="{y - 3:g}" x2="{bx:.2f}" y2="{y + 19:g}" '
            f'stroke="{BUDGET}" stroke-width="1.5" stroke-dasharray="3 2">'
            f"<title>budget {format_bytes(dev['budget_bytes'])}</title></line>"
        )
        y += 20
    out.append(_text(PAD, y + 12, words, 11, "memory-numbers", fill=MUTED))
    out.append("</g>")
    return out, y + 26


def _legend(x: float, y: float, items: list[tuple[str, str]]) -> tuple[list[str], float]:
    """Color keys in a row; returns where the next one would go."""
    out = []
    for label, color in items:
        out.append(_rect(x, y - 9, 10, 10, color))
        out.append(_text(x + 14, y, label, 11, fill=TEXT))
        x += 26 + len(label) * 5.6
    return out, x


def plan_svg(report: dict[str, Any]) -> str:
    """The report's plan as an SVG document: stages and workers, layer strips, memory, rates."""
    model = report["model"]
    path = str(model.get("path") or "")
    name = os.path.basename(path.rstrip("/\\")) or path or "model"
    title = " \u00b7 ".join(
        [
            name,
            str(model["model_type"]),
            f"{model['num_layers']} layers",
            str(model["dtype"]),
            format_bytes(model["weight_bytes"]),
            f"TP {report['tensor_parallel_size']} x PP {report['pipeline_parallel_size']}",
        ]
    )
    # The whole path as the title's tooltip: the line shows only its last part.
    body = [_text(PAD, 30, title, 16, "title", path, font_weight="bold", fill=TEXT)]
    sub = [f"KV capacity {report.get('kv_capacity_tokens', 0):,} tokens"]
    if model.get("moe"):
        sub.insert(
            0, f"mixture of experts: top-{model['moe']['top_k']} of {model['moe']['num_experts']}"
        )
    body.append(_text(PAD, 50, " \u00b7 ".join(sub), 12, fill=MUTED))
    stages = report["stages"]
    legend = [("layer on GPU", GPU), ("layer on CPU", CPU)]
    y = 66.0
    keys, x = _legend(PAD, y + 12, legend)
    body += keys
    if any(s.get("cpu_expert_layers") for s in stages):  # the split cell, drawn as in the strip
        body += [_rect(x, y + 3, 10, 5, GPU), _rect(x, y + 8, 10, 5, CPU)]
        body.append(_text(x + 14, y + 12, "routed experts on CPU", 11, fill=TEXT))
        x += 26 + 21 * 5.6
    if any(s.get("stream") for s in stages):
        dash = f' stroke="{GPU}" stroke-dasharray="3 1.5"'
        body.append(_rect(x, y + 3, 10, 10, "none", dash))
        body.append(_text(x + 14, y + 12, "streamed to the GPU for long steps", 11, fill=TEXT))
    y += 24
    # Cells share one pitch across stages; 94 layers still get 9 px each at this width.
    last = max([model["num_layers"] or 0, *(s["layer_end"] for s in stages)], default=0)
    pitch = min(28.0, (WIDTH - 2 * PAD) / max(1, last))
    for i, stage in enumerate(stages):
        part, y = _stage(report, stage, y, pitch)
        body += part
        if i + 1 < len(stages):  # the activations a stage hands the next one
            ax = PAD + 30
            body.append(
                f'<g class="connector"><line x1="{ax}" y1="{y + 2:g}" x2="{ax}" y2="{y + 16:g}" '
                f'stroke="{MUTED}" stroke-width="2"/><polygon points="{ax - 5},{y + 14:g} '
                f'{ax + 5},{y + 14:g} {ax},{y + 22:g}" fill="{MUTED}"/></g>'
            )
            body.append(_text(ax + 12, y + 16, "hidden states", 11, fill=MUTED))
            y += 26
    y += 12
    body.append(_text(PAD, y + 12, "memory per device", 13, font_weight="bold", fill=TEXT))
    items = [("weights", MEMORY[0][1]), ("activations", MEMORY[1][1])]
    items += [("KV cache", MEMORY[2][1]), ("free", FREE), ("budget", BUDGET)]
    body += _legend(PAD + 150, y + 12, items)[0]
    y += 24
    for dev in report.get("devices") or ():
        part, y = _memory(report, dev, y)
        body += part
    reserved = report.get("host_reserved")
    if reserved:  # outside the plan's budget, so not in the bars
        text = f"host: {format_bytes(reserved['bytes'])} for {reserved['note']}"
        body.append(_text(PAD, y + 12, text, 11, "note host-reserved", fill=MUTED))
        y += 20
    if report.get("prediction"):
        body.append(_text(PAD, y + 14, _rates(report["prediction"]), 12, "prediction", fill=TEXT))
        y += 24
    height = int(y + PAD)
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
        f'viewBox="0 0 {WIDTH} {height}" font-family="{FONT}">'
        f"<title>{escape(_clean(title))}</title>"
        f"{_rect(0, 0, WIDTH, height, '#ffffff')}\n" + "\n".join(body) + "\n</svg>\n"
    )
