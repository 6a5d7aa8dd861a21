"""A cost profile: one engine on one piece of hardware, as a JSON file.

Fields: ``name``, ``hardware``, ``model``, ``dtype``, ``block_size``,
``kv_bytes_per_token`` (the real model's KV bytes per token, all tensor-parallel
ranks together: what a transfer carries), ``fit``
(:class:`~kvxfer.serving.simulated.cost_model.StepCostModel` coefficients) at the tensor-parallel
degree ``tp`` (default 1), ``kv_capacity_tokens`` (the KV one worker of that degree
holds; absent: unknown, and a simulated worker keeps the engine's default pool),
``tensor_parallel`` (the other degrees: ``{"K": {"fit", "kv_capacity_tokens"}}``),
``link`` (:class:`~kvxfer.serving.simulated.link.Link`, one GPU's link across nodes) and
``node_link`` (within a node, e.g. NVLink; absent: ``link``) with ``gpus_per_node``,
``engine`` (the profiled engine's scheduling: :data:`ENGINE_FIELDS`), ``terms``
(what each coefficient is, in words), ``residuals`` (relative error of the fit on
its own points), ``points`` (every measured step: ``{"kind", "chunks":
[[num_tokens, start_pos], ...], "seconds"}``; none where the source published fits
only), ``source`` and ``licence`` (where the measurements come from), ``command``.

A worker of tensor-parallel degree K is :meth:`Profile.at_tp` (K): that degree's fit
and capacity; it counts as K GPUs and moves KV over K GPUs' links.

Profiles shipped with kvxfer live in ``kvxfer/serving/simulated/profiles/NAME.json`` and are
found by name (:func:`shipped_profiles`, :func:`load_profile`).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from typing import Sequence

from ...errors import KVXferError
from .cost_model import StepCostModel
from .link import Link

SHIPPED_DIR = os.path.join(os.path.dirname(__file__), "profiles")
KINDS = ("prefill", "decode", "mixed")
MODES = ("colocated", "split")
HANDOFFS = ("reserve-first", "after-prefill")
# engine: the profiled engine's scheduling, the simulated worker's defaults
#   name: which engine; modes: the configurations it runs (colocated, split);
#   max_num_seqs, max_num_batched_tokens: its batch limits without chunked prefill
#   (a step's whole prompts); chunked_prefill_tokens: its token budget with it;
#   chunked_prefill: False where the engine has none (whole prompts whatever is asked);
#   handoff: reserve-first (kvxfer: the decode worker reserves the prompt's blocks before
#   the prefill starts) or after-prefill (DistServe: the decode instance takes the KV
#   once prefilled, when it has room; the prefill instance holds it meanwhile)
#   preemption: what a decode out of blocks does (recompute, or swap over swap_bytes_per_s,
#   one GPU's host link)
ENGINE_FIELDS = ("name", "modes", "max_num_seqs", "max_num_batched_tokens",
                 "chunked_prefill_tokens", "chunked_prefill", "handoff", "preemption",
                 "swap_bytes_per_s")
DEFAULT_ENGINE = {"name": "kvxfer", "modes": list(MODES), "handoff": "reserve-first",
                  "preemption": "recompute"}


class ProfileError(KVXferError, ValueError):
    """A profile file is unreadable or malformed, no profile has that name, or it lacks
    the tensor-parallel degree or mode asked for."""


def _positive_int(value, what: str) -> int:
    if type(value) is not int or value < 1:
        raise ValueError(f"profile {what} must be an int >= 1, got {value!r}")
    return value


def check_engine(raw: dict) -> dict:
    """A profile's ``engine`` dict checked (:data:`ENGINE_FIELDS`), defaults filled."""
    if not isinstance(raw, dict):
        raise ValueError(f"profile engine must be an object, got {type(raw).__name__}")
    unknown = set(raw) - set(ENGINE_FIELDS)
    if unknown:
        raise ValueError(f"profile engine: unknown fields {sorted(unknown)}; known: {ENGINE_FIELDS}")
    out = {**DEFAULT_ENGINE, **raw}
    modes = out["modes"]
    if not isinstance(modes, list) or not modes or set(modes) - set(MODES):
        raise ValueError(f"profile engine modes must be a non-empty list of {MODES}, got {modes!r}")
    if out["handoff"] not in HANDOFFS:
        raise ValueError(f"profile engine handoff must be one of {HANDOFFS}, got {out['handoff']!r}")
    for key in ("max_num_seqs", "max_num_batched_tokens", "chunked_prefill_tokens"):
        if key in out:
            _positive_int(out[key], f"engine {key}")
    if not isinstance(out.get("chunked_prefill", True), bool):
        raise ValueError("profile engine chunked_prefill is true or false")
    if out["preemption"] not in ("recompute", "swap"):
        raise ValueError(f"profile engine preemption is recompute or swap, got {out['preemption']!r}")
    if out["preemption"] == "swap" and not (isinstance(out.get("swap_bytes_per_s"), (int, float))
                                           and out["swap_bytes_per_s"] > 0):
        raise ValueError("profile engine preemption swap needs swap_bytes_per_s > 0")
    return out


@dataclass(frozen=True)
class Profile:
    name: str
    hardware: str
    model: str
    dtype: str
    block_size: int
    kv_bytes_per_token: int
    fit: StepCostModel
    link: Link
    points: tuple[dict, ...] = ()
    residuals: dict = field(default_factory=dict)
    source: str = ""
    licence: str = ""
    command: str = ""
    tp: int = 1
    kv_capacity_tokens: int | None = None
    # the other degrees: K -> (fit, kv_capacity_tokens or None)
    tensor_parallel: dict = field(default_factory=dict)
    node_link: Link | None = None
    gpus_per_node: int = 8
    engine: dict = field(default_factory=lambda: dict(DEFAULT_ENGINE))
    terms: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("block_size", "kv_bytes_per_token", "tp", "gpus_per_node"):
            _positive_int(getattr(self, name), name)
        if not self.name or not isinstance(self.name, str):
            raise ValueError("profile name must be a non-empty string")
        if self.kv_capacity_tokens is not None:
            _positive_int(self.kv_capacity_tokens, "kv_capacity_tokens")
        for k, (fit, capacity) in self.tensor_parallel.items():
            _positive_int(k, "tensor-parallel degree")
            if k == self.tp:
                raise ValueError(f"tensor_parallel repeats the profile's own degree {k}")
            if not isinstance(fit, StepCostModel):
                raise ValueError(f"tensor_parallel[{k}] needs a StepCostModel fit")
            if capacity is not None:
                _positive_int(capacity, f"kv_capacity_tokens at TP {k}")
        object.__setattr__(self, "engine", check_engine(self.engine))

    @property
    def block_bytes(self) -> int:
        """Bytes of one real KV block (``block_size`` tokens)."""
        return self.block_size * self.kv_bytes_per_token

    @property
    def tp_degrees(self) -> tuple[int, ...]:
        """Every tensor-parallel degree this profile has a fit for, ascending."""
        return tuple(sorted({self.tp, *self.tensor_parallel}))

    def at_tp(self, tp: int) -> "Profile":
        """This profile as one worker of tensor-parallel degree ``tp`` sees it: that
        degree's fit and KV capacity (``tensor_parallel`` emptied); :class:`ProfileError`
        naming the degrees it has when it lacks ``tp``."""
        if tp == self.tp and not self.tensor_parallel:
            return self
        fits = {self.tp: (self.fit, self.kv_capacity_tokens), **self.tensor_parallel}
        if tp not in fits:
            raise ProfileError(f"profile {self.name!r} has no tensor-parallel degree {tp!r}; "
                               f"it has {', '.join(map(str, self.tp_degrees))}")
        fit, capacity = fits[tp]
        return replace(self, tp=tp, fit=fit, kv_capacity_tokens=capacity, tensor_parallel={})

    def link_between(self, same_node: bool) -> Link:
        """One GPU's link for a transfer within a node (``node_link``) or across nodes."""
        return self.node_link if same_node and self.node_link is not None else self.link

    def default_num_blocks(self, fallback: int) -> int:
        """Blocks of a worker's default pool: its KV capacity in whole blocks (``fallback``
        where the profile does not say)."""
        if self.kv_capacity_tokens is None:
            return fallback
        return max(1, self.kv_capacity_tokens // self.block_size)

    def check_mode(self, mode: str) -> None:
        """:class:`ProfileError` unless the profiled engine runs ``mode`` (:data:`MODES`)."""
        if mode not in self.engine["modes"]:
            raise ProfileError(f"profile {self.name!r} models {self.engine['name']}, which runs "
                               f"{' and '.join(self.engine['modes'])} configurations only, not {mode}")

    def as_dict(self) -> dict:
        out = {"name": self.name, "hardware": self.hardware, "model": self.model,
               "dtype": self.dtype, "block_size": self.block_size,
               "kv_bytes_per_token": self.kv_bytes_per_token}
        if self.tp != 1:
            out["tp"] = self.tp
        out["fit"] = self.fit.as_dict()
        if self.kv_capacity_tokens is not None:
            out["kv_capacity_tokens"] = self.kv_capacity_tokens
        if self.tensor_parallel:
            out["tensor_parallel"] = {
                str(k): {"fit": fit.as_dict(),
                         **({} if cap is None else {"kv_capacity_tokens": cap})}
                for k, (fit, cap) in sorted(self.tensor_parallel.items())}
        out["link"] = self.link.as_dict()
        if self.node_link is not None:
            out["node_link"] = self.node_link.as_dict()
            out["gpus_per_node"] = self.gpus_per_node
        if self.engine != DEFAULT_ENGINE:
            out["engine"] = dict(self.engine)
        if self.terms:
            out["terms"] = dict(self.terms)
        out.update({"residuals": self.residuals, "source": self.source, "licence": self.licence,
                    "command": self.command, "points": list(self.points)})
        return out

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.as_dict(), f, indent=1)
            f.write("\n")

    @classmethod
    def from_dict(cls, raw: dict, where: str = "profile") -> "Profile":
        if not isinstance(raw, dict):
            raise ProfileError(f"{where}: expected a JSON object, got {type(raw).__name__}")
        try:
            points = tuple(_check_point(p) for p in raw.get("points", ()))
            degrees = {}
            for k, entry in raw.get("tensor_parallel", {}).items():
                if not str(k).isdigit():
                    raise ValueError(f"tensor_parallel keys are degrees, got {k!r}")
                degrees[int(k)] = (StepCostModel.from_dict(entry["fit"]),
                                   entry.get("kv_capacity_tokens"))
            node_link = raw.get("node_link")
            return cls(name=raw["name"], hardware=str(raw["hardware"]), model=str(raw["model"]),
                       dtype=str(raw["dtype"]), block_size=raw["block_size"],
                       kv_bytes_per_token=raw["kv_bytes_per_token"],
                       fit=StepCostModel.from_dict(raw["fit"]), link=Link.from_dict(raw["link"]),
                       points=points, residuals=dict(raw.get("residuals", {})),
                       source=str(raw.get("source", "")), licence=str(raw.get("licence", "")),
                       command=str(raw.get("command", "")), tp=raw.get("tp", 1),
                       kv_capacity_tokens=raw.get("kv_capacity_tokens"), tensor_parallel=degrees,
                       node_link=None if node_link is None else Link.from_dict(node_link),
                       gpus_per_node=raw.get("gpus_per_node", 8),
                       engine=raw.get("engine", DEFAULT_ENGINE), terms=dict(raw.get("terms", {})))
        except KeyError as exc:
            raise ProfileError(f"{where}: missing field {exc.args[0]!r}") from None
        except (TypeError, ValueError, AttributeError) as exc:
            raise ProfileError(f"{where}: {exc}") from None


def _check_point(point: dict) -> dict:
    if point.get("kind") not in KINDS:
        raise ValueError(f"point kind must be one of {KINDS}, got {point.get('kind')!r}")
    chunks = [(int(n), int(s)) for n, s in point["chunks"]]
    seconds = float(point["seconds"])
    if not chunks or seconds <= 0:
        raise ValueError("a point needs chunks and seconds > 0")
    return {"kind": point["kind"], "chunks": [list(c) for c in chunks], "seconds": seconds}


def residuals(fit: StepCostModel, points: Sequence[dict]) -> dict:
    """Relative error ``(model - measured) / measured`` of ``fit`` on ``points``, by kind:
    median and max of its absolute value, and the mean (signed)."""
    import statistics

    out = {}
    for kind in ("all",) + KINDS:
        errs = [(fit.step_seconds(p["chunks"]) - p["seconds"]) / p["seconds"]
                for p in points if kind == "all" or p["kind"] == kind]
        if errs:
            out[kind] = {"n": len(errs), "median_abs": statistics.median(abs(e) for e in errs),
                         "max_abs": max(abs(e) for e in errs), "mean": statistics.fmean(errs)}
    return out


def shipped_profiles() -> list[str]:
    """Names of the profiles shipped with kvxfer, sorted."""
    return sorted(f[:-5] for f in os.listdir(SHIPPED_DIR) if f.endswith(".json"))


def load_profile(name_or_path: str) -> Profile:
    """A shipped profile by name, or a profile file by path; :class:`ProfileError` otherwise."""
    if not isinstance(name_or_path, str) or not name_or_path:
        raise TypeError(f"profile must be a name or a path, got {name_or_path!r}")
    path = name_or_path
    if not os.path.sep in path and not path.endswith(".json"):
        if name_or_path not in shipped_profiles():
            raise ProfileError(f"no shipped profile {name_or_path!r}; shipped: "
                               f"{', '.join(shipped_profiles())} (or give a .json path)")
        path = os.path.join(SHIPPED_DIR, name_or_path + ".json")
    try:
        with open(path) as f:
            raw = json.load(f)
    except OSError as exc:
        raise ProfileError(f"cannot read profile {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ProfileError(f"{path}: not JSON ({exc})") from None
    return Profile.from_dict(raw, path)
