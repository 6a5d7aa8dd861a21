"""Fault injection for tests that start servers in other processes.

A test puts this folder first on ``PYTHONPATH`` and sets, for the server's processes:

- ``KVXFER_FAULT_FILE=PATH``: ``kvxfer.Agent.send`` raises
  :class:`kvxfer.PeerDisconnected` (as if the peer had gone away) while PATH exists;
- ``KVXFER_PAUSE_FILE=PATH``: a serving worker's model step
  (``kvxfer.serving.engine.runtime.Runtime.step``) does nothing (an empty step after
  a 50 ms nap: the loop still reads messages, admits requests and polls transfers)
  while PATH or ``PATH-<worker name>`` exists, so a test can hold a queue up
  deterministically whatever the machine's speed.

The production code knows nothing of it; each patch is applied when its module is
first imported.
"""
import importlib.abc
import importlib.util
import os
import sys
import time

FAULT_FILE = os.environ.get("KVXFER_FAULT_FILE")
PAUSE_FILE = os.environ.get("KVXFER_PAUSE_FILE")


def _patch_agent(agent_module) -> None:
    from kvxfer.errors import PeerDisconnected

    cls = agent_module.Agent
    real_send = cls.send

    def send(self, *args, **kwargs):
        if os.path.exists(FAULT_FILE):
            raise PeerDisconnected(f"injected transfer failure ({FAULT_FILE} exists)")
        return real_send(self, *args, **kwargs)

    cls.send = send


def _worker_name() -> str | None:
    argv = sys.argv
    return argv[argv.index("--name") + 1] if "--name" in argv[:-1] else None


def _patch_runtime(runtime_module) -> None:
    cls = runtime_module.Runtime
    real_step = cls.step
    paths = [PAUSE_FILE]

    def step(self, *args, **kwargs):
        if len(paths) == 1 and _worker_name():
            paths.append(f"{PAUSE_FILE}-{_worker_name()}")
        if any(os.path.exists(p) for p in paths):
            time.sleep(0.05)
            return runtime_module.Step([], False, 0)
        return real_step(self, *args, **kwargs)

    cls.step = step


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def __init__(self, patches: dict):
        self.patches = patches  # module name -> patch(module)

    def find_spec(self, name, path, target=None):
        patch = self.patches.pop(name, None)
        if patch is None:
            return None
        sys.meta_path.remove(self)  # find the real spec without us
        try:
            spec = importlib.util.find_spec(name)
        finally:
            if self.patches:  # more modules to patch
                sys.meta_path.insert(0, self)
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            patch(module)

        spec.loader.exec_module = exec_and_patch
        return spec


_patches = {}
if FAULT_FILE:
    _patches["kvxfer.agent"] = _patch_agent
if PAUSE_FILE:
    _patches["kvxfer.serving.engine.runtime"] = _patch_runtime
if _patches:
    sys.meta_path.insert(0, _PatchOnImport(_patches))
