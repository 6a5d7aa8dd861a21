"""``kvxfer loadgen``: replay a Mooncake trace (or a Poisson stream) against an
OpenAI-compatible streaming server and report TTFT, TPOT, ITL, end-to-end
latency, throughput, goodput under an SLO and KV transfer time as a share of TTFT.

Pipeline: :mod:`.trace` / :mod:`.poisson` (what to send, when) -> :mod:`.prompts`
(text whose shared hash ids share token prefixes) -> :mod:`.runner` (schedule) ->
:mod:`.client` (one streamed request, timestamps) -> :mod:`.metrics` (summaries).
"""
