"""Checkpoints: atomic and background saves, the sharded format, resume, preemption, periodic saves, provenance,
and checkpoints kept in an object store for a job restarted on a fresh disk."""
