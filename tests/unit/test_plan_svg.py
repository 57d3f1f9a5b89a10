"""plan/svg.py: the placement picture of a plan report, drawn from hand-made report dicts."""

from __future__ import annotations

import xml.etree.ElementTree as ET

from hybridllm.plan.svg import plan_svg

NS = "{http://www.w3.org/2000/svg}"
GIB = 1 << 30


def worker(rank, device, *, tp_rank=0, threads=None, weight_bytes=GIB, share=None):
    return {
        "rank": rank,
        "device": device,
        "tp_rank": tp_rank,
        "numa_node": 0 if device == "cpu" else None,
        "num_threads": threads,
        "weight_bytes": weight_bytes,
        "shard": None if share is None else {"share": share, "q_heads": 8, "kv_heads": 2,
                                             "intermediate": 1024, "vocab": 1000},
    }  # fmt: skip


def stage(pp_rank, start, end, workers, *, first=False, last=False, experts=(), stream=None,
          node=None):  # fmt: skip
    return {
        "pp_rank": pp_rank,
        "layer_start": start,
        "layer_end": end,
        "has_embedding": first,
        "has_lm_head": last,
        "node": node,
        "workers": workers,
        "cpu_expert_layers": list(experts),
        "cpu_expert_bytes": 3 * GIB if experts else 0,
        "stream": stream,
    }


def device(name, total, *, weights=GIB, activations=GIB // 4, kv=2 * GIB, per_token=1024):
    return {
        "device": name,
        "total_bytes": total,
        "budget_bytes": int(total * 0.9),
        "weight_bytes": weights,
        "activation_bytes": activations,
        "kv_bytes_per_token": per_token,
        "kv_fixed_bytes": 0,
        "kv_capacity_tokens": kv // per_token if per_token else 0,
        "kv_cache_bytes": kv,
    }


def report(stages, devices, *, gpus=(), path="/models/Tiny-Llama", num_layers=None, moe=None,
           prediction="default", tp=1):  # fmt: skip
    """A dict shaped as PlanReport.to_dict() makes it."""
    if prediction == "default":
        prediction = {
            "context_len": 1024,
            "decode": [{"batch": 1, "tokens_per_s": 12.34}, {"batch": 8, "tokens_per_s": 80.0}],
            "prefill_tokens_per_s": 1500.0,
        }
    return {
        "version": 1,
        "model": {
            "path": path,
            "model_type": "llama",
            "num_layers": num_layers if num_layers is not None else stages[-1]["layer_end"],
            "dtype": "bfloat16",
            "weight_bytes": 57 * GIB + GIB // 5,
            "moe": moe,
        },
        "hardware": {
            "gpus": [
                {
                    "device": f"cuda:{i}",
                    "name": n,
                    "total_bytes": 80 * GIB,
                    "free_bytes": 80 * GIB,
                    "simulated": True,
                }
                for i, n in enumerate(gpus)
            ],  # fmt: skip
            "cpu": {
                "model": "AMD EPYC",
                "physical_cores": 8,
                "logical_cores": 16,
                "numa_nodes": 1,
                "total_bytes": 64 * GIB,
                "available_bytes": 60 * GIB,
            },
        },  # fmt: skip
        "tensor_parallel_size": tp,
        "pipeline_parallel_size": len(stages),
        "stages": stages,
        "devices": devices,
        "kv_capacity_tokens": 2048,
        "kv_reserve_tokens": 1024,
        "host_resident": None,
        "prediction": prediction,
        "text": "",
    }


def parse(svg: str) -> ET.Element:
    root = ET.fromstring(svg)
    assert root.tag == NS + "svg"
    return root


def classed(root: ET.Element, cls: str) -> list[ET.Element]:
    return [e for e in root.iter() if e.get("class") == cls]


def all_text(root: ET.Element) -> str:
    return "\n".join("".join(e.itertext()) for e in root.iter(NS + "text"))


def gpu_cpu_report(**kw):
    """Layers 0-19 on an H100 (routed experts of 4-9 on the CPU), 20-31 on 16 CPU threads."""
    return report(
        [
            stage(0, 0, 20, [worker(0, "cuda:0")], first=True, experts=range(4, 10)),
            stage(1, 20, 32, [worker(1, "cpu", threads=16)], last=True),
        ],
        [device("cuda:0", 80 * GIB), device("cpu", 64 * GIB)],
        gpus=["NVIDIA H100"],
        moe={"num_experts": 128, "top_k": 8},
        **kw,
    )


def test_two_stage_plan_draws_each_layer_where_it_runs():
    svg = plan_svg(gpu_cpu_report())
    assert svg.startswith('<svg xmlns="http://www.w3.org/2000/svg"')
    root = parse(svg)
    assert len(classed(root, "layer gpu")) == 14
    assert len(classed(root, "layer experts-cpu")) == 6
    assert len(classed(root, "layer cpu")) == 12
    layers = sorted(int(e.get("data-layer")) for e in root.iter() if e.get("data-layer"))
    assert layers == list(range(32))
    text = all_text(root)
    assert "cuda:0 · NVIDIA H100 80.00 GiB" in text and "cpu · AMD EPYC, 16 threads" in text
    assert "layers 0-19 + embedding" in text and "layers 20-31 + LM head" in text
    assert "routed experts of 6 layers on cpu (3.00 GiB)" in text
    assert "hidden states" in text and "TP 1 x PP 2" in text and "57.20 GiB" in text
    assert "decode batch 1: 12.3 tok/s · batch 8: 80.0 tok/s · prefill: 1,500.0 tok/s" in text
    assert [g.get("data-device") for g in classed(root, "memory")] == ["cuda:0", "cpu"]
    assert svg == plan_svg(gpu_cpu_report())  # deterministic


def test_hostile_path_and_names_are_escaped():
    hostile = '<script>alert(1)</script>&"x'
    r = gpu_cpu_report(path=hostile)
    r["stages"][0]["node"] = hostile
    r["hardware"]["gpus"][0]["name"] = hostile
    svg = plan_svg(r)
    root = parse(svg)
    assert "<script" not in svg
    assert not [e for e in root.iter() if e.tag.endswith("script")]
    assert "&lt;script&gt;alert(1)&lt;/script&gt;&amp;" in svg
    tips = "\n".join(e.text or "" for e in root.iter(NS + "title"))
    assert hostile in tips  # the whole path, read back intact, as the title's tooltip
    assert f"node {hostile}" in all_text(root)
    for bad in ("http:", "https:", "href", "<image", "<foreignObject", "@import"):
        assert bad not in svg.replace('xmlns="http://www.w3.org/2000/svg"', "")


def test_cpu_only_plan_without_prediction_or_gpus():
    r = report(
        [stage(0, 0, 30, [worker(0, "cpu", threads=2)], first=True, last=True)],
        [device("cpu", 24 * GIB)],
        prediction=None,
    )
    root = parse(plan_svg(r))
    assert len(classed(root, "layer cpu")) == 30 and not classed(root, "layer gpu")
    text = all_text(root)
    assert "cpu · AMD EPYC, 2 threads" in text and "layers 0-29 + embedding + LM head" in text
    assert "Tiny-Llama" in text and "predicted" not in text and not classed(root, "prediction")
    assert "KV capacity 2,097,152 tokens" in text


def test_memory_bar_segments_are_proportional():
    r = report(
        [stage(0, 0, 4, [worker(0, "cuda:0")], first=True, last=True)],
        [device("cuda:0", 1000, weights=500, activations=100, kv=250, per_token=1)],
        gpus=["H100"],
    )
    root = parse(plan_svg(r))
    bar = classed(root, "mem-bar")[0]
    full = float(bar.get("width"))
    assert full > 500
    widths = {
        name: float(classed(root, f"seg {name}")[0].get("width"))
        for name in ("weights", "activations", "kv")
    }
    assert abs(widths["weights"] - full / 2) <= 1
    assert abs(widths["activations"] - full / 10) <= 1
    assert abs(widths["kv"] - full / 4) <= 1
    kv = classed(root, "seg kv")[0]  # segments follow each other from the bar's left edge
    assert abs(float(kv.get("x")) - float(bar.get("x")) - 0.6 * full) <= 1


def test_tensor_parallel_stage_streaming_and_unsized_device():
    stream = {"device": "cuda:0", "threshold_tokens": 32, "layer_bytes": GIB,
              "decode_crossover_tokens": None, "prefill_crossover_tokens": None}  # fmt: skip
    tp = [worker(i, f"cuda:{i}", tp_rank=i, share=0.5) for i in range(2)]
    r = report(
        [
            stage(0, 0, 47, tp, first=True, node="gpu-box"),
            stage(1, 47, 94, [worker(2, "cpu", threads=8)], last=True, stream=stream),
        ],
        [device("cuda:0", 80 * GIB), device("cuda:1", 0), device("cpu", 64 * GIB)],
        gpus=["H100"],
        tp=2,
    )
    root = parse(plan_svg(r))
    assert len(classed(root, "layer gpu")) == 47 and len(classed(root, "layer cpu")) == 47
    assert [w.get("data-device") for w in root.iter() if w.get("data-rank")] == [
        "cuda:0",
        "cuda:1",
        "cpu",
    ]
    text = all_text(root)
    assert "tensor parallel x 2" in text and text.count("50% shard") == 2
    assert "node gpu-box" in text and "cuda:1" in text
    assert "streams layers to cuda:0 for steps >= 32 tokens" in text
    assert len(classed(root, "stream-marker")) == 1
    # no size known for cuda:1: its numbers, but no bar
    bars = [g.get("data-device") for g in classed(root, "memory") if classed(g, "mem-bar")]
    assert bars == ["cuda:0", "cpu"]
    cells = [e for e in root.iter(NS + "rect") if e.get("class") is None and e.get("width")]
    assert all(float(c.get("x")) + float(c.get("width")) <= 960 for c in cells)


def test_speculative_memory_is_noted():
    rep = gpu_cpu_report()
    rep["mtp"] = {"device": "cuda:0", "weight_bytes": 4 * GIB, "cpu_expert_bytes": 21 * GIB}
    rep["host_reserved"] = {"bytes": GIB + GIB // 2, "note": "the draft model <d>.gguf"}
    root = parse(plan_svg(rep))
    (mtp,) = classed(root, "note mtp")
    assert "".join(mtp.itertext()) == (
        "+ the MTP layer (speculative drafts) on cuda:0, 4.00 GiB; its routed experts on cpu "
        "(21.00 GiB)"
    )
    (host,) = classed(root, "note host-reserved")
    assert "".join(host.itertext()).endswith("host: 1.50 GiB for the draft model <d>.gguf")
    assert not classed(parse(plan_svg(gpu_cpu_report())), "note mtp")
