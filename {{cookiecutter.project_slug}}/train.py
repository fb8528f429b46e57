"""Train, validate, test or predict: `python train.py fit --config configs/mnist.yaml`.

`python train.py --help` lists the subcommands; `python train.py fit --help` every option.
"""

from {{ cookiecutter.package_name }}.cli import main

if __name__ == "__main__":
    main()
