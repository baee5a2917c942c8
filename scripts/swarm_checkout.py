"""Makes a checkout importable as `swarm` where it is not installed (the GPU machine, scripts/gpu-device-run.sh).

pyproject.toml maps compression/, kernels/, peers/ and proto/ into the swarm package; a plain sys.path entry for
the checkout finds `swarm` but not those four. Importing this module (with the checkout's root in
$SWARM_CHECKOUT, and that root on sys.path) adds a finder for them, as an editable install's finder does. Every
process must import it at start, the peers that `swarm demo` starts too: gpu-device-run.sh puts this file on
PYTHONPATH and a .pth file that imports it into the interpreter's site-packages.
"""

from __future__ import annotations

import importlib.util
import os
import sys

# pyproject.toml's [tool.setuptools] package-dir
PACKAGE_DIRS = {"swarm.compression": "compression", "swarm.kernels": "kernels", "swarm.peers": "peers",
                "swarm.proto": "proto"}  # fmt: skip


class CheckoutFinder:
    """Finds the four mapped packages in the checkout at `root` (a meta path finder)."""

    def __init__(self, root: str):
        self.root = root

    def find_spec(self, name, path=None, target=None):
        folder = PACKAGE_DIRS.get(name)
        if folder is None:
            return None
        where = os.path.join(self.root, folder)
        return importlib.util.spec_from_file_location(
            name, os.path.join(where, "__init__.py"), submodule_search_locations=[where]
        )


def install(root: str) -> None:
    """Adds the finder for `root` once (first on sys.meta_path: an installed swarm elsewhere does not win)."""
    if not any(isinstance(f, CheckoutFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, CheckoutFinder(os.path.abspath(root)))


if os.environ.get("SWARM_CHECKOUT"):
    install(os.environ["SWARM_CHECKOUT"])
