"""{{ cookiecutter.package_name }}: a PyTorch Lightning research project."""
