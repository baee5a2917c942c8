"""A peer without torch's compiler stack: what a serving peer needs of torch is eager autograd and an optimizer.

`torch.optim` imports `torch._dynamo` (and with it sympy, triton and torch.fx's symbolic shapes: about 150 MB
of RSS per peer, seen by `swarm bench footprint`) the first time an optimizer is built or steps, only to mark
its methods "not to be compiled" (`torch._disable_dynamo`) and to put graph breaks around `step`. A peer
compiles nothing, so `skip_dynamo()` marks those methods as already handled and runs `step` under the same
grad mode without the graph breaks. Nothing else changes: the optimizers' arithmetic is torch's own.

It is called once, early, by `swarm-peer` only (its role never compiles); a process that already imported
`torch._dynamo`, or a torch whose optimizer no longer has these wrappers, is left as it is.

`defer_hivemind_init()`: `import hivemind.dht` runs hivemind's package `__init__`, which imports all of hivemind
(its averager, optimizer and mixture-of-experts, and with them scipy and pydantic: ~50 MB of RSS per process,
measured on top of torch) though a daemon uses its DHT only. It puts a placeholder for the package in
`sys.modules` whose first attribute lookup runs the real `__init__`, so `hivemind.X` still works for whoever asks.

`no_mkl_buffer_pools()`: torch's CPU matmuls run in MKL, whose memory manager keeps the buffers each thread used
in a pool of that thread's for reuse. A peer computes on whichever of its ~100 gRPC threads takes the call, so
every thread ends up holding such a pool: a toy block's forward and backward on 32 threads, one at a time, held
240 MiB anonymous after three rounds (and rising), 199-204 MiB flat with the pools off, at the same CPU time
(`scripts/measure_heap_retention.py --serial`). MKL reads `MKL_DISABLE_FAST_MM` when torch loads it, so this must
run before `import torch`: `swarm/daemon/__init__.py` calls it.

`exec_without_thread_caches()`: glibc gives every thread a cache of freed small blocks (tcache: up to 7 blocks of
each of 64 sizes) that only that thread reuses, and counts them as in use. A peer's ~130 threads (gRPC's pool of
104 among them) each fill one over a run, one call at a time, and their blocks pin the arenas' chunks around them:
a soak read 15-18 MiB more arena and a free list ten times as long with the caches on (`SWARM_HEAPSTATS_S`). The
caches can only be turned off before the process starts (`GLIBC_TUNABLES=glibc.malloc.tcache_count=0`), so
`swarm-peer` sets the variable and replaces itself (`os.execv`, same argv) once, before it loads torch; a
`GLIBC_TUNABLES` that already sets `tcache_count` stands (the user's choice).
"""

from __future__ import annotations

import functools
import importlib.util
import sys
import types

from swarm.startup import entry_point

__all__ = [
    "cap_arenas", "defer_hivemind_init", "exec_without_thread_caches", "no_mkl_buffer_pools", "runs_swarm_peer",
    "skip_dynamo", "without_thread_caches",
]  # fmt: skip

_M_ARENA_MAX = -8  # glibc's mallopt parameter
ARENAS = 2
"""malloc arenas of a peer: glibc's default is 8 per core, each keeping what its threads freed (a peer has
~120 threads, most of them gRPC's); measured by `swarm bench footprint`, 2 saved 40-120 MB of RSS per peer."""

_MARKED = ("state_dict", "load_state_dict", "zero_grad", "add_param_group")
"""Optimizer methods wrapped by `torch._disable_dynamo`, which imports torch._dynamo on the first call."""


def skip_dynamo() -> bool:
    """Marks torch.optim's dynamo wrappers as handled, so that no optimizer call imports torch._dynamo.
    Returns whether it did (False: dynamo is already loaded, or this torch's optimizer looks different)."""
    if "torch._dynamo" in sys.modules:
        return False
    import torch
    from torch import optim

    done = False
    for name in _MARKED:
        inner = getattr(getattr(optim.Optimizer, name, None), "__wrapped__", None)
        if inner is not None:
            setattr(inner, "__dynamo_disable", inner)  # what the wrapper caches after importing dynamo
            done = True
    for cls in (optim.AdamW, optim.Adam, optim.SGD):
        step = cls.__dict__.get("step")
        raw = getattr(step, "__wrapped__", None)
        if step is None or raw is None or step.__code__.co_name != "_use_grad":
            continue  # not torch's _use_grad_for_differentiable wrapper (or already hooked): leave it
        cls.step = _eager_step(raw, torch)
        done = True
    return done


def cap_arenas(arenas: int = ARENAS) -> bool:
    """Caps glibc's malloc arenas (what MALLOC_ARENA_MAX does); before the process starts its threads. A user's
    own MALLOC_ARENA_MAX stands. Returns whether the cap was set (False: set by the user, or not glibc)."""
    import ctypes
    import ctypes.util
    import os

    if os.environ.get("MALLOC_ARENA_MAX"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.mallopt(_M_ARENA_MAX, arenas) == 1
    except (OSError, AttributeError):
        return False


def no_mkl_buffer_pools(environ=None) -> bool:
    """Turns MKL's per-thread buffer pools off (`MKL_DISABLE_FAST_MM=1`) for this process; a variable the
    environment already has is left as it is (MKL turns them off for any value). Returns whether it set the
    variable (False: already set, or torch is already imported, when MKL has read its environment and setting it
    would change nothing)."""
    import os

    environ = os.environ if environ is None else environ
    if "MKL_DISABLE_FAST_MM" in environ or "torch" in sys.modules:
        return False
    environ["MKL_DISABLE_FAST_MM"] = "1"
    return True


NO_THREAD_CACHES = "glibc.malloc.tcache_count=0"
"""glibc's tunable that turns its per-thread caches off (read once, when the process starts)."""
_REEXECED = "SWARM_REEXECED_FOR_MALLOC"
"""set in the replaced process: it never replaces itself twice (a libc that drops GLIBC_TUNABLES, e.g. setuid)"""


def without_thread_caches(environ) -> dict[str, str] | None:
    """The environment a process needs to start without glibc's thread caches; None where nothing is to change
    (the environment has them off, or its GLIBC_TUNABLES sets tcache_count its own way, or this is a replaced
    process already, or libc is not glibc)."""
    import platform

    tunables = environ.get("GLIBC_TUNABLES", "")
    if "glibc.malloc.tcache_count=" in tunables or environ.get(_REEXECED) or platform.libc_ver()[0] != "glibc":
        return None
    return {
        **environ, "GLIBC_TUNABLES": f"{tunables}:{NO_THREAD_CACHES}" if tunables else NO_THREAD_CACHES,
        _REEXECED: "1",
    }  # fmt: skip


def runs_swarm_peer(orig_argv: list[str]) -> bool:
    """Whether this process's command line (`sys.orig_argv`) runs swarm-peer: its console script, or
    `python [options] -m swarm.daemon.peer`."""
    return entry_point(orig_argv) == "swarm-peer"


def exec_without_thread_caches() -> None:
    """Replaces a swarm-peer process with the same command under `without_thread_caches` (see the module's
    docstring); returns only where nothing is to change (any other program, or the caches are already set)."""
    import os

    environ = without_thread_caches(os.environ) if runs_swarm_peer(sys.orig_argv) else None
    if environ is None:
        return
    sys.stdout.flush(), sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, environ)


def _eager_step(raw, torch):
    """`_use_grad_for_differentiable` without its graph breaks (which are what import torch._dynamo)."""

    @functools.wraps(raw)
    def step(self, *args, **kwargs):
        prev = torch.is_grad_enabled()
        try:
            torch.set_grad_enabled(self.defaults["differentiable"])
            return raw(self, *args, **kwargs)
        finally:
            torch.set_grad_enabled(prev)

    return step


class _DeferredPackage(types.ModuleType):
    """A package whose `__init__` has not run yet: submodules import as usual (the import system needs only
    `__path__`), and the first lookup of anything else runs the `__init__` in this same module object."""

    def __getattr__(self, name: str):
        if (submodule := sys.modules.get(f"{self.__name__}.{name}")) is not None:
            return submodule  # `import pkg.sub.x as y` while pkg.sub is still importing: what the import would find
        self.__class__ = types.ModuleType  # before running it: a lookup inside the __init__ must not recurse
        self.__spec__.loader.exec_module(self)
        return getattr(self, name)


def defer_hivemind_init() -> bool:
    """Defers hivemind's package `__init__` to its first use (see the module's docstring). Returns whether it did
    (False: hivemind is already imported, or not installed)."""
    if "hivemind" in sys.modules:
        return False
    spec = importlib.util.find_spec("hivemind")
    if spec is None or spec.loader is None or spec.submodule_search_locations is None:
        return False
    module = importlib.util.module_from_spec(spec)
    module.__class__ = _DeferredPackage
    sys.modules["hivemind"] = module
    return True
