"""Server-sent events: ``data: {json}`` chunks, then ``data: [DONE]``."""
from __future__ import annotations

import json

DONE = "data: [DONE]\n\n"


def event(payload: dict) -> str:
    """One SSE ``data:`` event carrying a JSON object."""
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"
