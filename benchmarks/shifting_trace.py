"""A trace whose mix shifts: a long-prompt phase, then a long-output phase (Mooncake format).

    python benchmarks/shifting_trace.py --out shifting.jsonl            # the defaults below
    kvxfer simulate --trace shifting.jsonl --profile h100-llama2-7b-vidur --num-blocks 6000 \\
        --config 8P8D --config adaptive:8P8D --slo 2500,150

Deterministic for a ``--seed``: Poisson arrivals, lengths uniform in each phase's
ranges, every request its own hash ids (no prefix is shared, so routing plays no
part and the comparison is the P:D split alone). The lengths are within the Mooncake
conversation trace's (prompts 891-126,195 tokens, median 6,909; answers 1-2,000, 99th
percentile 1,120). Defaults, sized for 16 simulated H100s with Llama-2-7B
(``h100-llama2-7b-vidur``, 6,000 blocks of 16 tokens a GPU, 16 sequences a step):

- **prompt phase**, ``--prompt-phase-s`` (120) at ``--prompt-rate`` (23 req/s): prompts of
  8,192-16,384 tokens, answers of 16-64. A 12k-token prefill takes ~0.39 s on the
  profile in 512-token chunks (2.55 requests/s a prefill worker), so this phase keeps
  ~9 prefill workers busy and needs 10 or more to keep TTFT under 2.5 s; each request
  holds ~770 decode blocks from admission to its last token;
- **output phase**, ``--output-phase-s`` (120) at ``--output-rate`` (26 req/s): prompts of
  1,024-3,072 tokens (above the 1,024-token local-prefill threshold), answers of
  768-1,536. A decode step of 16 sequences takes ~5.6 ms (2,860 tokens/s a worker,
  2.5 answers/s), so this phase keeps ~10.4 decode workers busy and needs 11 or more,
  and ~2 prefill workers (~0.045 s a prompt). A decode worker short of throughput
  admits up to its KV pool (~30-45 such requests) and then holds new ones in its admit
  queue, which is what breaks TTFT.

No static split of 16 serves both (the first wants 10 or more prefill workers, the
second 11 or more decode workers); a rebalancer that follows the mix can, if it moves
workers fast enough (one move every 10 s at most: the phases are long enough for it).
"""
from __future__ import annotations

import argparse
import json
import random
import sys

BLOCK_TOKENS = 512  # a Mooncake hash id stands for 512 tokens
# (prompt tokens, output tokens) ranges of each phase
PROMPT_PHASE_LENGTHS = ((8192, 16384), (16, 64))
OUTPUT_PHASE_LENGTHS = ((1024, 3072), (768, 1536))


def phases(args) -> list[tuple[float, float, tuple[int, int], tuple[int, int]]]:
    """(duration_s, rate, prompt range, output range) of each phase, in order."""
    return [(args.prompt_phase_s, args.prompt_rate, PROMPT_PHASE_LENGTHS[0], PROMPT_PHASE_LENGTHS[1]),
            (args.output_phase_s, args.output_rate, OUTPUT_PHASE_LENGTHS[0], OUTPUT_PHASE_LENGTHS[1])]


def generate(args) -> list[dict]:
    rng = random.Random(args.seed)
    rows, t0, next_hash = [], 0.0, 0
    for duration, rate, (in_lo, in_hi), (out_lo, out_hi) in phases(args):
        t = t0 + rng.expovariate(rate)
        while t < t0 + duration:
            n_in = rng.randint(in_lo, in_hi)
            num_hashes = -(-n_in // BLOCK_TOKENS)
            rows.append({"timestamp": int(round(t * 1e3)), "input_length": n_in,
                         "output_length": rng.randint(out_lo, out_hi),
                         "hash_ids": list(range(next_hash, next_hash + num_hashes))})
            next_hash += num_hashes
            t += rng.expovariate(rate)
        t0 += duration
    return rows


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The trace's options (``--seed`` and each phase's length and rate), defaults as in
    the module docstring; :mod:`vclock_adaptive` takes the same."""
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompt-phase-s", type=float, default=120.0)
    ap.add_argument("--prompt-rate", type=float, default=23.0, help="requests/s")
    ap.add_argument("--output-phase-s", type=float, default=120.0)
    ap.add_argument("--output-rate", type=float, default=26.0, help="requests/s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="the jsonl file to write")
    add_arguments(ap)
    args = ap.parse_args()
    rows = generate(args)
    with open(args.out, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    print(f"{args.out}: {len(rows)} requests over {rows[-1]['timestamp'] / 1e3:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
