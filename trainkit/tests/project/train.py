"""The kit tests' entry point, as a project's: `python train.py fit --config configs/experiment.yaml`."""

# Imported first, before torch and Lightning: from here on SIGTERM and Ctrl-C stop the job cleanly.
from trainkit.startup import main

if __name__ == "__main__":
    main()
