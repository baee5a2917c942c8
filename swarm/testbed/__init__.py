"""Local swarms of processes, network-namespace and docker compose testbeds."""
