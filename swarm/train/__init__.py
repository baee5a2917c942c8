"""`swarm train`: the trainer, its step log and its freezing policy."""

# `swarm.daemon`'s package init turns MKL's per-thread buffer pools off (swarm.daemon.lean.no_mkl_buffer_pools);
# MKL reads that when torch loads it, so it must run before anything of the trainer imports torch
import swarm.daemon  # noqa: F401, E402
