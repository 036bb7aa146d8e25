"""Schedules: how a pipeline of halstm.pipeline runs on a target.

Every schedule module defines the same functions, one per pipeline kind
(pack, proj, step, pack_bwd, step_bwd, grads), each taking (pipe, target) and
scheduling the pipe's stages by name. Installed as `halstm.schedules`.

    from halstm import schedules
    schedules.names()                       # ['cpu', 'naive']
    schedules.for_target("host")            # the default module for a target
    schedules.apply(pipe, target, "naive")  # schedule one pipe in place
"""
from __future__ import annotations

import importlib

# name -> (module, families it fits: "cpu" and/or "gpu")
_MODULES = {"naive": ("naive", {"cpu"}), "cpu": ("cpu", {"cpu"}), "cuda": ("cuda", {"gpu"})}
_DEFAULT = {"cpu": "cpu", "gpu": "cuda"}


def names() -> list[str]:
    return sorted(_MODULES)


GPU_FEATURES = {"cuda", "opencl", "metal", "d3d12compute", "vulkan", "webgpu"}


def family(target) -> str:
    """'gpu' for a target (string or halide.Target) with a GPU API feature,
    else 'cpu'. Reads the string: needs no halide import."""
    return "gpu" if GPU_FEATURES & set(str(target).split("-")) else "cpu"


def _target(target):
    import halide as hl
    return target if isinstance(target, hl.Target) else hl.Target(target)


def families(name: str) -> set[str]:
    """The target families ('cpu', 'gpu') that schedule `name` fits."""
    return set(_MODULES[name][1])


def default_for(fam: str) -> str | None:
    return _DEFAULT.get(fam)


def resolve(target, name: str | None = None) -> str:
    """The schedule name to use: `name` checked against the target, or the
    target family's default."""
    fam = family(target)
    if name is None:
        if fam not in _DEFAULT:
            raise ValueError(f"schedule: no schedule for {fam} targets yet "
                             f"(target {target}); available: {names()}")
        return _DEFAULT[fam]
    if name not in _MODULES:
        raise ValueError(f"schedule: expected one of {names()}, got {name!r}")
    if fam not in _MODULES[name][1]:
        raise ValueError(f"schedule: {name!r} does not fit {fam} target {target}")
    return name


def for_target(target, name: str | None = None):
    """The schedule module for `target` (by name, or the family default)."""
    mod, _ = _MODULES[resolve(target, name)]
    return importlib.import_module(f"{__name__}.{mod}")


def apply(pipe, target, name: str | None = None) -> None:
    getattr(for_target(target, name), pipe.kind)(pipe, _target(target))
