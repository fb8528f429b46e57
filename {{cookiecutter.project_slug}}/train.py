"""Train, validate, test or predict: `python train.py fit --config configs/mnist.yaml`.

`python train.py --help` lists the subcommands; `python train.py fit --help` every option.
"""

from {{ cookiecutter.package_name }}.stopping import handle_stop_signals

# First of all: SIGTERM and SIGINT stop the job from here on, during the imports below too, and also
# as PID 1 in a container, where the kernel drops signals a process has no handler for (stopping.py).
handle_stop_signals()

import gc  # noqa: E402

# Importing torch and Lightning creates several hundred thousand objects that live as long as the process.
# The garbage collector would scan them over and over while they load (most of a second); frozen
# once loaded, it never scans them again, and forked data loader workers share their memory.
gc.disable()
from {{ cookiecutter.package_name }}.launch_variables import exit_on_bad_rank_variables  # noqa: E402

exit_on_bad_rank_variables()  # Lightning reads them when it is imported: a bad one would end in its traceback
from {{ cookiecutter.package_name }}.cli import main  # noqa: E402

gc.freeze()
gc.enable()

if __name__ == "__main__":
    main()
