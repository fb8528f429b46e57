"""Train, validate, test or predict: `python train.py fit --config configs/experiment.yaml`.

`python train.py --help` lists the subcommands; `python train.py fit --help` every option.
"""

# Imported first, before torch and Lightning: from here on SIGTERM and Ctrl-C stop the job cleanly.
from trainkit.startup import main

if __name__ == "__main__":
    main()
