"""Where in the researcher's own code an error was raised: the project's files, not its train.py or the kit."""

import traceback
from pathlib import Path
from types import FrameType

KIT = Path(__file__).resolve().parent.parent  # the kit's own code, inside a project or not


def researchers_file(path: Path, project: Path) -> bool:
    """Whether `path` is the researcher's code: in the project, and neither its train.py nor the kit it carries."""
    return path.is_relative_to(project) and path != project / "train.py" and not path.resolve().is_relative_to(KIT)


def raised_in(error: BaseException, project: Path) -> tuple[str, str]:
    """The function (with its class) and the file:line where `error` was raised: in the project's code if it was."""
    *_, (frame, line) = traceback.walk_tb(error.__traceback__)
    return raised_under_the_researchers_code(error, project) or _place(frame, line, project)


def raised_under_the_researchers_code(error: BaseException, project: Path) -> tuple[str, str] | None:
    """The function and file:line of the project's code that `error` was raised under (a call of Lightning's in
    it, such as `self.log`), None where it was raised outside the project's code."""
    frames = list(traceback.walk_tb(error.__traceback__))
    ours = [(frame, line) for frame, line in frames if researchers_file(Path(frame.f_code.co_filename), project)]
    return _place(*ours[-1], project) if ours else None


def _place(frame: FrameType, line: int, project: Path) -> tuple[str, str]:
    owner = frame.f_locals.get("self")
    function = f"{type(owner).__name__}.{frame.f_code.co_name}" if owner is not None else frame.f_code.co_name
    path = Path(frame.f_code.co_filename)
    return function, f"{path.relative_to(project) if path.is_relative_to(project) else path}:{line}"
