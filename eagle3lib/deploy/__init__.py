"""Stage 04 deploy: the engine started with the drafter, health-checked, a smoke request, a clean stop (the servers
themselves are eagle3lib/engines)."""
