"""The template's machinery: command line, cluster environments, checkpoints, signals, logging.

Nothing here imports the models or data modules: configs choose them by class_path.
"""
