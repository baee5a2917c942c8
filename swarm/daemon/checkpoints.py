"""A peer's stage checkpoints in --checkpoint-dir: resuming once (--resume; its own range's file, else its layers
found one by one in every checkpoint there, the missing ones named), saving every --checkpoint-every steps and at
exit (with the model recorded, for `swarm export`), and reading a stage's state when its holder cannot hand it
over (`StateHandover.load`)."""

from __future__ import annotations

import logging

__all__ = ["StageCheckpoints"]

log = logging.getLogger("swarm.peer")


class StageCheckpoints:
    """The checkpoints of the stages one peer serves, under its `PeerConfig` (`checkpoint_dir`, `resume`,
    `checkpoint_every`)."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.resumed = False
        """whether --resume loaded a checkpoint already (it loads once, into the first stage served)"""

    def read(self, index: int, start: int, end: int, why: str, read) -> dict | None:
        """The old stage's state from its checkpoint in --checkpoint-dir (shared by a local swarm's peers, or
        this peer's own), when its holder could not hand it over; None (logged) without one."""
        if self.cfg.checkpoint_dir:
            try:
                state = read(self.cfg.checkpoint_dir, start, end)
                log.info("stage %d's holder is unreachable (%s): taking its layers from its checkpoint", index, why)
                return state
            except Exception as e:
                why = f"{why}; no usable checkpoint: {e}"
        log.warning("could not take over stage %d (layers [%d, %d)): %s", index, start, end, why)
        return None

    def setup(self, host) -> None:
        """Resumes the stage from its checkpoint once (--resume); `on_step` checkpoints it from then on."""
        from swarm.runtime.checkpoint import resume

        cfg = self.cfg
        if not cfg.checkpoint_dir:
            return
        role = host.role
        if cfg.resume and not self.resumed:
            found = resume(cfg.checkpoint_dir, host.worker, role.layer_start, role.layer_end)
            if found is not None:
                host.restore(int(found["steps_done"]))
                self.resumed = True
                log.info(
                    "resumed layers [%d, %d) at step %d (lr step %s, saved under plan %s%s)",
                    role.layer_start,
                    role.layer_end,
                    host.steps_done,
                    found["lr_step"],
                    found["plan_version"],
                    f"; found by layer, without {found['missing']}" if found.get("missing") else "",
                )

    def on_step(self, host) -> None:
        """After every step the host applied (its `on_step`): a checkpoint every --checkpoint-every steps."""
        if self.cfg.checkpoint_dir and host.steps_done % self.cfg.checkpoint_every == 0:
            self.save(host)

    def save(self, host, final: bool = False) -> None:
        from swarm.model.export import model_to_json
        from swarm.runtime.checkpoint import save_worker

        if not self.cfg.checkpoint_dir:
            return
        role = host.role
        model = getattr(self.cfg, "model", None)
        path = save_worker(
            self.cfg.checkpoint_dir,
            host.worker,
            role.layer_start,
            role.layer_end,
            host.steps_done,
            role.plan_version,
            model=model_to_json(model) if model is not None else None,
        )
        if path is not None:
            log.info("checkpoint written: %s (step %d%s)", path, host.steps_done, ", final" if final else "")
