"""Schedules: how a pipeline of halstm.pipeline runs on a target.

Every schedule module defines the same functions, one per pipeline kind
(pack, proj, step, step_infer, pack_bwd, step_bwd, grads), each taking (pipe, target) and
scheduling the pipe's stages by name. Installed as `halstm.schedules`.
The family defaults (cpu, cuda) also schedule the char LM's head and
optimizer pipelines (halstm/model/kernels.py: head, sumsq, adam, sgd,
onehot), which always use their family's default module.

    from halstm import schedules
    schedules.names()                       # ['cpu', 'cuda', 'naive', 'auto:Adams2019', ...]
    schedules.for_target("host")            # the default module for a target
    schedules.apply(pipe, target, "naive")  # schedule one pipe in place
"""
from __future__ import annotations

import importlib

# name -> (module, families it fits: "cpu" and/or "gpu")
_MODULES = {"naive": ("naive", {"cpu"}), "cpu": ("cpu", {"cpu"}), "cuda": ("cuda", {"gpu"})}
_DEFAULT = {"cpu": "cpu", "gpu": "cuda"}


# Halide's autoschedulers per family, run as auto:<name> (see auto.py).
# Mullapudi2016 is not offered for GPUs: on CUDA it leaves stages on the
# host (the projection's bias reads, the weight packing), and halstm's
# buffers live on the device only ("The host pointer of Input buffer b_ih
# is null, but the pipeline will access it on the host", on an H100).
AUTOSCHEDULERS = {"cpu": ("Adams2019", "Li2018", "Mullapudi2016"),
                  "gpu": ("Anderson2021", "Li2018")}


def _auto_names() -> dict:
    """auto:<autoscheduler> -> families it runs on."""
    return {f"auto:{n}": {f for f, ns in AUTOSCHEDULERS.items() if n in ns}
            for ns in AUTOSCHEDULERS.values() for n in ns}


def names() -> list[str]:
    return sorted(_MODULES) + sorted(_auto_names())


GPU_FEATURES = {"cuda", "opencl", "metal", "d3d12compute", "vulkan", "webgpu"}


# Schedules whose modules also define the pipelines of a layer fed one-hot
# rows as class indices (gather, grads_ids), on CPU targets.
ONEHOT = {"cpu", "naive"}


def family(target) -> str:
    """'gpu' for a target (string or halide.Target) with a GPU API feature,
    else 'cpu'. Reads the string: needs no halide import."""
    return "gpu" if GPU_FEATURES & set(str(target).split("-")) else "cpu"


def families(name: str) -> set[str]:
    """The target families ('cpu', 'gpu') that schedule `name` fits."""
    return set(_MODULES[name][1]) if name in _MODULES else _auto_names()[name]


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
    if name not in names():
        raise ValueError(f"schedule: expected one of {names()}, got {name!r}")
    if fam not in families(name):
        raise ValueError(f"schedule: {name!r} does not fit {fam} target {target}")
    return name


def for_target(target, name: str | None = None):
    """The schedule module for `target` (by name, or the family default)."""
    name = resolve(target, name)
    if name.startswith("auto:"):
        auto = importlib.import_module(f"{__name__}.auto")
        return auto.Auto(name[len("auto:"):], family(target))
    return importlib.import_module(f"{__name__}.{_MODULES[name][0]}")


def apply(pipe, target, name: str | None = None) -> None:
    """Schedule one pipe in place (target: a string or a halide.Target)."""
    import halide as hl
    if not isinstance(target, hl.Target):
        target = hl.Target(target)
    getattr(for_target(target, name), pipe.kind)(pipe, target)
