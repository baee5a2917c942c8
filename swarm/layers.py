"""The layer order of swarm's packages, bottom first: a module imports only from its own layer's package and
from layers below it, never upward, so no two packages import each other (tests/unit/test_layers.py checks it,
counting every import, in-function ones too).

Names are `swarm.<name>`: a subpackage or a top-level module. `compression`, `kernels`, `peers` and `proto`
are folders at the top of the repository that pyproject.toml maps into the `swarm` namespace. Packages that
share a layer do not import each other.
"""

from __future__ import annotations

__all__ = ["LAYERS", "layer_of"]

LAYERS: tuple[tuple[str, ...], ...] = (
    ("field_source", "startup"),  # fields' docstrings and annotations read from the source; a command's start
    ("proto", "kernels", "metrics", "trace", "plots", "report", "layers", "flags"),  # wire, kernels, leaf utilities
    ("compression", "model"),  # codecs; the model families and their data
    ("peers",),  # DHT records and node, transport, the link shaper
    ("net",),  # stage calls on the wire, how to reach a stage
    ("runtime",),  # the stage runtime, the driver
    ("scheduler",),  # the planner, its cost model and the message sizes it plans with
    ("options",),  # shared command-line options
    ("daemon",),  # swarm-peer, live planning
    ("train",),  # swarm train
    ("testbed",),  # local, netns and compose swarms, swarm demo
    ("experiments",),  # swarm experiment ...
    ("bench",),  # swarm bench ...
    ("cli",),  # the `swarm` command
)
"""Bottom first."""


def layer_of(name: str) -> int:
    """The layer index of `swarm.<name>` (0 is the bottom). Raises KeyError for a name in no layer."""
    for index, names in enumerate(LAYERS):
        if name in names:
            return index
    raise KeyError(f"swarm.{name} is in no layer of swarm.layers.LAYERS")
