"""The control plane of an agent: framing, messages, handshake, the I/O thread.

Everything a peer sends arrives here first and is validated before the agent
acts on it. Data never flows through this channel; only requests, grants,
completions and notifications (small JSON frames).
"""
