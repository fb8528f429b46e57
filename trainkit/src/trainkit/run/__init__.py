"""A process's life: start-up, stop signals, exit statuses, the run lock, diagnostics, config errors."""
