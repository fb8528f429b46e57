"""Checkpoints: atomic and background saves, the sharded format, resume, preemption, periodic saves, provenance."""
