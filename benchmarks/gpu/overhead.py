"""Host time per ``kvxfer.pack`` call (issue to return, the kernel not waited for).

``python benchmarks/gpu/overhead.py --device cuda --json OUT.json``: a
Llama-3-8B per-layer pool; per layer of a 128-block request (what ``send_layer``
issues) and for the whole request, ``--calls`` calls timed back to back after
warm-up (the caches hold the request's tables and ids), then one synchronize.
Reports median microseconds per call. ``--device cpu`` uses the Triton
interpreter only with ``TRITON_INTERPRET=1`` (plumbing check; the figure then
means nothing).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--blocks", type=int, default=128)
    ap.add_argument("--json")
    args = ap.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import torch

    import kvxfer
    from transfer import make_layout

    small = args.device == "cpu"
    layout = make_layout("SmolLM2-135M" if small else "Llama-3-8B", 2 * args.blocks, args.device, 1)
    ids = list(range(0, 2 * args.blocks, 2))
    out = torch.empty(layout.wire_nbytes(len(ids)), dtype=torch.uint8, device=args.device)
    step = layout.wire_nbytes(len(ids), layers=[0])
    backend = "triton"

    def per_layer(layer):
        kvxfer.pack(layout, ids, layers=[layer], out=out[layer * step:(layer + 1) * step], backend=backend)

    def whole(_):
        kvxfer.pack(layout, ids, out=out, backend=backend)

    result = {"device": args.device, "blocks": len(ids), "load_avg": os.getloadavg()[0]}
    for name, fn in (("per_layer_us", per_layer), ("whole_request_us", whole)):
        calls = 2 if small else args.calls
        for i in range(1 if small else 3):
            fn(i % layout.num_layers)
        samples = []
        for i in range(calls):
            t0 = time.perf_counter()
            fn(i % layout.num_layers)
            samples.append((time.perf_counter() - t0) * 1e6)
            if args.device != "cpu" and i % 32 == 31:
                torch.cuda.synchronize()  # keep the launch queue short: time the host, not back-pressure
        if args.device != "cpu":
            torch.cuda.synchronize()
        result[name] = statistics.median(samples)
    want = kvxfer.pack(layout, ids, backend="reference")
    kvxfer.pack(layout, ids, out=out, backend=backend)
    result["bitwise"] = bool(torch.equal(out, want))
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    return 0 if result["bitwise"] else 1


if __name__ == "__main__":
    sys.exit(main())
