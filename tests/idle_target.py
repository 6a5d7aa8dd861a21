"""An agent process that never calls into kvxfer after start-up (spawned by tests).

It registers a zeroed pool (``agent_procs.make_pool``), sends its address through
the pipe, then only blocks on the pipe: whatever UCX needs from a target (emulated
RMA over TCP, accepting and reaping connections) must be driven by the agent
itself. Commands: ``("pack", block_ids)`` -> the blocks' canonical wire bytes,
``("notes",)`` -> notification payloads received so far, ``("exit",)``.
"""
import contextlib
import multiprocessing as mp
import os
import time

T = 60.0
TCP = {"UCX_TLS": "tcp", "UCX_WARN_UNUSED_ENV_VARS": "n"}


def serve(pipe, env: dict, backend: str, deadline_s: float = 300.0) -> None:
    os.environ.update(env)
    from kvxfer import Agent, pack

    from agent_procs import SECRET, make_pool

    layout = make_pool("2 N B H D", None)
    notes = []
    with Agent("idle-target", secret=SECRET, backend=backend) as agent:
        agent.register_kv(layout)
        pipe.send(agent.address)
        end = time.monotonic() + deadline_s  # never outlive a lost parent
        while time.monotonic() < end:
            if not pipe.poll(1.0):
                continue
            cmd = pipe.recv()
            if cmd[0] == "pack":
                pipe.send(pack(layout, list(cmd[1]), backend="reference").numpy().tobytes())
            elif cmd[0] == "notes":
                notes += [data for _, data in agent.notifications()]
                pipe.send(notes)
            else:
                break


@contextlib.contextmanager
def idle_agent(backend: str, env: dict = TCP):
    """Start :func:`serve` in a spawned process; yields ``(process, pipe, address)``."""
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=serve, args=(theirs, env, backend), daemon=True)
    proc.start()
    try:
        assert ours.poll(T), "target did not start"
        yield proc, ours, ours.recv()
    finally:
        with contextlib.suppress(Exception):
            ours.send(("exit",))
        proc.join(T)
        if proc.is_alive():
            proc.kill()
            proc.join(T)


def ask(pipe, *cmd):
    pipe.send(cmd)
    assert pipe.poll(T), f"target did not answer {cmd[0]!r}"
    return pipe.recv()
