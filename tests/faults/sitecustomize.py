"""Fault injection for tests that start servers in other processes.

A test puts this folder first on ``PYTHONPATH`` and names a file in
``KVXFER_FAULT_FILE``: in every Python process of that server, ``kvxfer.Agent.send``
then raises :class:`kvxfer.PeerDisconnected` (as if the peer had gone away)
while that file exists. The production code knows nothing of it; the patch is
applied when ``kvxfer.agent`` is first imported.
"""
import importlib.abc
import importlib.util
import os
import sys

FAULT_FILE = os.environ.get("KVXFER_FAULT_FILE")


def _patch(agent_module) -> None:
    from kvxfer.errors import PeerDisconnected

    cls = agent_module.Agent
    real_send = cls.send

    def send(self, *args, **kwargs):
        if os.path.exists(FAULT_FILE):
            raise PeerDisconnected(f"injected transfer failure ({FAULT_FILE} exists)")
        return real_send(self, *args, **kwargs)

    cls.send = send


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "kvxfer.agent":
            return None
        sys.meta_path.remove(self)  # once; and find the real spec without us
        spec = importlib.util.find_spec(name)
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            _patch(module)

        spec.loader.exec_module = exec_and_patch
        return spec


if FAULT_FILE:
    sys.meta_path.insert(0, _PatchOnImport())
