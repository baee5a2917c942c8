"""Peers and trainers agree on the model: each stage reports `model_identity` in its Status, and whoever
meets a stage of another model refuses it with an error naming both.

The identity is `swarm.model.spec.model_identity`: a digest of what fixes the weights' shapes and init (never
local paths), so two peers that load the same checkpoint from different directories agree. A peer reports
its own identity, so this catches mistakes (a peer started with another `--model`), not liars.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

__all__ = ["ModelMismatch", "model_label", "check_status", "foreign_models", "check_plan_models", "peer_status"]

log = logging.getLogger("swarm.runtime.modelcheck")


class ModelMismatch(RuntimeError):
    """A stage serves a slice of another model than the caller's."""


def model_label(cfg) -> str:
    """A short human description of an `AnyModelConfig`: family, layers, width, vocabulary, sequence length."""
    family = getattr(cfg, "family", "gpt")
    return (
        f"{family} {cfg.n_layers} layers x {cfg.hidden_dim} wide, vocab {cfg.vocab_size}, "
        f"seq {cfg.seq_len_tokens}, {'tied' if cfg.tied_embeddings else 'untied'} head"
    )


def check_status(reply, identity: str, label: str, where: str) -> None:
    """Raises `ModelMismatch` unless the StatusReply `reply` reports `identity` (a stage of an older swarm
    reports none: also refused, it cannot say which model it serves)."""
    theirs = reply.model_identity
    if theirs != identity:
        mine = f"{identity[:16]}" + (f" ({label})" if label else "")
        raise ModelMismatch(
            f"{where} serves model {theirs[:16] or '(unknown)'} but this one trains/serves model {mine}: "
            "start every peer and the trainer with the same --model/--seq-len/--model-seed"
        )


def peer_status(channels, address: str, timeout_s: float = 2.0):
    """The StatusReply of the stage service at `address` over `channels` (signed calls); None if it does not
    answer."""
    from swarm.net.connect import status_of

    try:
        return status_of(channels.get(address), timeout_s)
    except Exception:
        return None


def foreign_models(status_of: Callable[[str], object], peers: dict[str, str], identity: str, label: str) -> list[str]:
    """One line per peer of `peers` (peer id -> address) whose Status names another model than `identity`;
    a peer that does not answer, or serves no stage yet (no identity), is not judged."""
    problems = []
    for peer, address in sorted(peers.items()):
        reply = status_of(address)
        if getattr(reply, "model_identity", ""):
            try:
                check_status(reply, identity, label, f"peer {peer} at {address}")
            except ModelMismatch as e:
                problems.append(str(e))
    return problems


def check_plan_models(channels, record, announced: Callable[[], list], own_id: str, host) -> threading.Thread | None:
    """After this peer follows plan `record`: on a thread of its own (the plan switch never waits on it, nor on
    the DHT read `announced()` of the peers' announcements), asks every other peer of the plan at its announced
    address for its model, and logs each one that serves another model as an error naming both. The trainer
    refuses such a pipeline (`PipelineDriver.check_model`); a peer only says so, since a peer-reported identity
    is no ground to stop serving on."""
    identity = getattr(host, "model_identity", None)  # None: no host (standby), or one that names no model
    if identity is None:
        return None
    ids = record.document.used_peers() - {own_id}
    label = model_label(host.model)

    def check() -> None:
        try:
            addresses = {p.peer_id: p.address for p in announced()}
        except Exception as e:  # a slow DHT: this check is advisory
            log.warning("plan %d: could not read the announcements to compare models: %s", record.version, e)
            return
        peers = {p: addresses[p] for p in ids if p in addresses}
        for problem in foreign_models(lambda a: peer_status(channels, a), peers, identity, label):
            log.error("plan %d: %s", record.version, problem)

    thread = threading.Thread(target=check, name="swarm-model-check", daemon=True)
    thread.start()
    return thread
