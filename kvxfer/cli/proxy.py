"""``kvxfer proxy``: an OpenAI-compatible P/D proxy in front of ``vllm serve`` instances
running KVXferConnector (prefill with max_tokens=1, then decode with P's
kv_transfer_params, D's answer streamed back). See docs/vllm.md."""
from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser("proxy", help="OpenAI-compatible proxy in front of vLLM prefill/decode instances",
                       description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--prefill", nargs="+", required=True, metavar="URL",
                   help="prefill (kv_producer) vllm serve base URLs, e.g. http://127.0.0.1:8100")
    p.add_argument("--decode", nargs="+", required=True, metavar="URL",
                   help="decode (kv_consumer) vllm serve base URLs")
    p.add_argument("--timeout", type=float, default=600.0, metavar="S", help="per upstream request")
    p.add_argument("--log-level", default="info")
    p.set_defaults(func=run)


def run(args) -> int:
    import uvicorn

    from kvxfer.integrations.vllm.proxy import make_app

    strip = [u.rstrip("/") for u in args.prefill], [u.rstrip("/") for u in args.decode]
    uvicorn.run(make_app(*strip, timeout=args.timeout), host=args.host, port=args.port,
                log_level=args.log_level)
    return 0
