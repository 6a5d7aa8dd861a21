"""Step by step: the real engine's forward time against the profile's model, on trace prompts.

    python benchmarks/sim_steps.py --profile cpu-smollm2 --start 300 --max-requests 12 \
        --length-scale 0.03 --output-scale 0.04 [--cpus 0] [--show]

Runs the trace slice's prompts (kvxfer loadgen's prompt builder, tokenized by
the embedded tokenizer), all queued at once, through the real engine core
(:class:`kvxfer.serving.engine.runtime.Runtime`, scheduler ``mixed``), timing
every ``model.forward``; for each step it also asks the profile what it
models for the same chunks. Prints the modelled/measured ratio per step kind
(median, p10, p90) and of the total; ``--show`` prints every prefill and mixed
step. Run it as ``benchmarks/sim_validate.py`` is run (high priority, with the
shell's autogroup raised where the kernel has autogroups).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="cpu-smollm2")
    ap.add_argument("--trace", default="benchmarks/traces/mooncake_conversation_trace.jsonl")
    ap.add_argument("--start", type=int, default=300)
    ap.add_argument("--max-requests", type=int, default=12)
    ap.add_argument("--length-scale", type=float, default=0.03)
    ap.add_argument("--output-scale", type=float, default=0.04)
    ap.add_argument("--cpus", default="0")
    ap.add_argument("--schedule", default="mixed", choices=("mixed", "separate"))
    ap.add_argument("--show", action="store_true",
                    help="print every prefill and mixed step: its prompt chunks, decode batch, times")
    args = ap.parse_args()

    from kvxfer.loadgen.prompts import PromptBuilder
    from kvxfer.loadgen.trace import read_trace
    from kvxfer.serving.engine.config import EngineConfig
    from kvxfer.serving.engine.engine import Engine
    from kvxfer.serving.engine.sampling import SamplingParams
    from kvxfer.serving.workers.main import pin_threads
    from kvxfer.serving.simulated.profile import load_profile

    pin_threads(args.cpus, 1)
    prof = load_profile(args.profile)
    engine = Engine(EngineConfig(num_blocks=1024, num_threads=1, schedule=args.schedule))
    builder = PromptBuilder(length_scale=args.length_scale, output_scale=args.output_scale)
    for req in read_trace(args.trace, start=args.start, max_requests=args.max_requests):
        engine.add_request(builder.prompt(req), SamplingParams(
            temperature=0, max_tokens=builder.max_tokens(req), ignore_eos=True))
    model, rows = engine.model, []
    real_forward = model.forward

    def timed(chunks):
        began = time.perf_counter()
        out = real_forward(chunks)
        seconds = time.perf_counter() - began
        spec = [(len(c.token_ids), c.start_pos) for c in chunks]
        kind = "decode" if all(n == 1 for n, _ in spec) else (
            "prefill" if all(n > 1 for n, _ in spec) else "mixed")
        rows.append((kind, seconds, prof.fit.step_seconds(spec)))
        if args.show and kind != "decode":
            decode = [s for n, s in spec if n == 1]
            print(f"{kind}: prompt chunks {[(n, s) for n, s in spec if n > 1]} + {len(decode)} "
                  f"decode (context {sum(decode) + len(decode)}): {seconds * 1e3:.0f} ms measured, "
                  f"{rows[-1][2] * 1e3:.0f} ms modelled")
        return out

    model.forward = timed
    load = os.getloadavg()[0]
    while engine.has_unfinished():
        engine.step()
    print(f"{len(rows)} steps, profile {prof.name}, load average {load:.2f} -> "
          f"{os.getloadavg()[0]:.2f}")
    for kind in ("prefill", "decode", "mixed", "all"):
        sel = [r for r in rows if kind == "all" or r[0] == kind]
        if not sel:
            continue
        ratios = sorted(m / s for _, s, m in sel)
        q = statistics.quantiles(ratios, n=10) if len(ratios) > 1 else ratios * 9
        print(f"{kind:8s} n={len(sel):4d} modelled/measured median {statistics.median(ratios):.2f} "
              f"p10 {q[0]:.2f} p90 {q[-1]:.2f}; total {sum(r[2] for r in sel):.1f} s modelled vs "
              f"{sum(r[1] for r in sel):.1f} s measured ({sum(r[2] for r in sel) / sum(r[1] for r in sel):.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
