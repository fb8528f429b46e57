"""Checkpoints kept in an object store (S3 and compatible), for a job restarted on a fresh disk."""
