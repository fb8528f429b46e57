"""A process's life: stop signals, exit statuses, the run lock, diagnostics, config errors, missing extras."""
