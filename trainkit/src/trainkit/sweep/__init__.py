"""A local hyper-parameter sweep: `python -m trainkit.sweep configs/sweep.yaml --count 8` (local.py; needs optuna)."""
