"""The swarm-peer daemon and what it runs beside its stage: DHT bootstrap, planning, status."""

import os as _os

# hivemind shares its futures' state as torch tensors, by default with torch's "file_system" strategy, which
# starts a torch_shm_manager process (110 MB RSS, 61 MB PSS) beside every process; Linux's default
# "file_descriptor" strategy needs none. Set before hivemind is imported (it reads this then); a user's own
# choice stands. See swarm.daemon.lean and `swarm bench footprint`.
_os.environ.setdefault("HIVEMIND_MEMORY_SHARING_STRATEGY", "file_descriptor")

# a daemon uses hivemind's DHT only: its package __init__ (averager, optimizer, MoE, scipy, pydantic: ~50 MB) runs
# only if something asks for it (swarm.daemon.lean.defer_hivemind_init, measured by `swarm bench footprint`)
from swarm.daemon.lean import defer_hivemind_init as _defer_hivemind_init  # noqa: E402
from swarm.daemon.lean import exec_without_thread_caches as _exec_without_thread_caches  # noqa: E402
from swarm.daemon.lean import no_mkl_buffer_pools as _no_mkl_buffer_pools  # noqa: E402

# swarm-peer only (its console script, or `python -m swarm.daemon.peer`): replaced once by itself without glibc's
# per-thread malloc caches, which can only be set before a process starts; first, before anything loads
_exec_without_thread_caches()
_defer_hivemind_init()
# before torch is imported (MKL reads its environment then): no per-thread matmul buffer pools in a process that
# computes on ~100 server threads (swarm.daemon.lean)
_no_mkl_buffer_pools()
