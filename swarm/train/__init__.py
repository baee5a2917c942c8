"""`swarm train`: the trainer, its step log and its freezing policy."""
