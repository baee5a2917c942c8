"""The stage runtime: pure compute, schedules, the stage host and the links between hosts."""
