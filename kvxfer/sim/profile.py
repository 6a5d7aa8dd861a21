"""A cost profile: one engine on one piece of hardware, as a JSON file.

Fields: ``name``, ``hardware``, ``model``, ``dtype``, ``block_size``,
``kv_bytes_per_token`` (the real model's KV bytes per token: what a transfer
costs on the modelled link), ``fit`` (:class:`~kvxfer.sim.cost_model.StepCostModel`
coefficients), ``link`` (:class:`~kvxfer.sim.link.Link`), ``residuals``
(relative error of the fit on its own points), ``points`` (every measured
step: ``{"kind", "chunks": [[num_tokens, start_pos], ...], "seconds"}``),
``source`` and ``licence`` (where the measurements come from), ``command``.

Profiles shipped with kvxfer live in ``kvxfer/sim/profiles/NAME.json`` and are
found by name (:func:`shipped_profiles`, :func:`load_profile`).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Sequence

from ..errors import KVXferError
from .cost_model import StepCostModel
from .link import Link

SHIPPED_DIR = os.path.join(os.path.dirname(__file__), "profiles")
KINDS = ("prefill", "decode", "mixed")


class ProfileError(KVXferError, ValueError):
    """A profile file is unreadable or malformed, or no profile has that name."""


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

    def __post_init__(self) -> None:
        for name in ("block_size", "kv_bytes_per_token"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"profile {name} must be an int >= 1, got {value!r}")
        if not self.name or not isinstance(self.name, str):
            raise ValueError("profile name must be a non-empty string")

    @property
    def block_bytes(self) -> int:
        """Bytes of one real KV block (``block_size`` tokens)."""
        return self.block_size * self.kv_bytes_per_token

    def as_dict(self) -> dict:
        return {"name": self.name, "hardware": self.hardware, "model": self.model,
                "dtype": self.dtype, "block_size": self.block_size,
                "kv_bytes_per_token": self.kv_bytes_per_token, "fit": self.fit.as_dict(),
                "link": self.link.as_dict(), "residuals": self.residuals,
                "source": self.source, "licence": self.licence, "command": self.command,
                "points": list(self.points)}

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
            return cls(name=raw["name"], hardware=str(raw["hardware"]), model=str(raw["model"]),
                       dtype=str(raw["dtype"]), block_size=raw["block_size"],
                       kv_bytes_per_token=raw["kv_bytes_per_token"],
                       fit=StepCostModel.from_dict(raw["fit"]), link=Link.from_dict(raw["link"]),
                       points=points, residuals=dict(raw.get("residuals", {})),
                       source=str(raw.get("source", "")), licence=str(raw.get("licence", "")),
                       command=str(raw.get("command", "")))
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
