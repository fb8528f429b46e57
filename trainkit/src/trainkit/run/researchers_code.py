"""Where in the researcher's own code an error was raised: the project's files, not its train.py or the kit."""

import traceback
from pathlib import Path

KIT = Path(__file__).resolve().parent.parent  # the kit's own code, inside a project or not


def researchers_file(path: Path, project: Path) -> bool:
    """Whether `path` is the researcher's code: in the project, and neither its train.py nor the kit it carries."""
    return path.is_relative_to(project) and path != project / "train.py" and not path.resolve().is_relative_to(KIT)


def raised_in(error: BaseException, project: Path) -> tuple[str, str]:
    """The function (with its class) and the file:line where `error` was raised: in the project's code if it was."""
    frames = list(traceback.walk_tb(error.__traceback__))
    ours = [(frame, line) for frame, line in frames if researchers_file(Path(frame.f_code.co_filename), project)]
    frame, line = (ours or frames)[-1]
    owner = frame.f_locals.get("self")
    function = f"{type(owner).__name__}.{frame.f_code.co_name}" if owner is not None else frame.f_code.co_name
    path = Path(frame.f_code.co_filename)
    return function, f"{path.relative_to(project) if path.is_relative_to(project) else path}:{line}"
