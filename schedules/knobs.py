"""The hand schedules' knobs that `halstm tune` searches (halstm/tuning.py):
per schedule name, knob name -> Knob. No halide import: aot.Spec checks
knobs before anything is built, and loading a cached library imports no
halide."""
from typing import NamedTuple


class Knob(NamedTuple):
    direction: str        # the layer direction whose pipelines it acts on
    default: int          # the schedule's constant
    candidates: tuple     # the values tune tries


# cpu: DW_PANELS, PROJ_CHUNK and DH_PANEL_BYTES (in KiB) (schedules/cpu.py).
# Which value is fastest depends on the machine: DW_PANELS 4 was fastest on
# the AMD VM, 1 on the Intel VM (bench/RESULTS.md, "Tuned knobs").
KNOBS = {"cpu": {"dw_panels": Knob("bwd", 4, (1, 2, 4, 8)),
                 "proj_chunk": Knob("fwd", 32, (8, 16, 32, 64)),
                 "dh_panel_kib": Knob("bwd", 512, (256, 512, 1024, 2048))}}
