"""The trainer and the demo that runs a whole local swarm."""
