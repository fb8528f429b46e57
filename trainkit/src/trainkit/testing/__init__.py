"""What tests of a project, and the kit's own, run training with: a real `train.py` in a subprocess, callbacks that
pace a run or report what each process saw, and a tiny model and data of their own."""
