"""``memkit models``: the presets (hub ids, parameter counts) and every diffusers transformer/UNet class."""

from __future__ import annotations

import argparse
import json

from ..naming import diffusers_classes, preset_parameters
from ..presets import PRESETS
from ._common import fmt_count


def _columns(rows: list[tuple[str, ...]], indent: str = "  ") -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(indent + "  ".join(f"{v:<{w}}" for v, w in zip(r, widths, strict=True)).rstrip() for r in rows)


def run(args: argparse.Namespace) -> int:
    """``memkit models``: the presets, grouped by image and video, then each diffusers class's support."""
    import diffusers

    classes = diffusers_classes()
    presets = [
        {
            "name": p.name,
            "kind": "video" if "frames" in p.input_sizes["full"] else "image",
            "hub_id": p.hub_id,
            "class": p.model_class,
            "parameters": preset_parameters(p.name),
            "description": p.description,
        }
        for p in PRESETS.values()
    ]
    if args.json:
        result = {
            "diffusers": diffusers.__version__,
            "presets": presets,
            "classes": [
                dict(cls=c.class_name, kind=c.kind, presets=list(c.presets), supported=c.supported, why=c.why)
                for c in classes
            ],
        }
        print(json.dumps(result, indent=2))
        return 0
    print("Presets: the released models' configs, shipped with memkit; each answers to its name and hub id, offline")
    print("(parameters at full size, counted on the meta device)")
    for kind in ("image", "video"):
        rows = [(p["name"], p["hub_id"], p["class"], fmt_count(p["parameters"])) for p in presets if p["kind"] == kind]
        print(f"\n{kind}:")
        print(_columns([("preset", "hub id", "class", "parameters"), *rows]))
    supported = [c for c in classes if c.supported]
    print(
        f"\ndiffusers {diffusers.__version__}: {len(classes)} transformer and UNet classes; memkit builds the inputs "
        "of "
        f"{len(supported)} (the presets' classes: any config.json of those is estimated), and refuses the others: "
        "those whose inputs it cannot build (memkit.estimate(config, inputs=...) takes them), and those whose memory "
        "no estimate can hold (the reason in their row):"
    )
    rows = [(c.class_name, c.kind, "preset " + ", ".join(c.presets) if c.supported else f"refused: {c.refused}")
            for c in classes]  # fmt: skip
    print(_columns([("class", "kind", "memkit"), *rows]))
    return 0
