"""torch.compile builds code with the machine's compiler while training: without one, a run stops before it starts.

Inductor, torch.compile's default backend, generates C++ for the CPU, which it builds with $CXX or g++, and
Triton kernels for GPUs, whose launcher Triton builds with $CC, gcc or clang. PyTorch's CUDA runtime images
have long come without either (pytorch/pytorch#116696); there the first compiled step would end the run with a
long traceback, after the job has formed.
"""

import os
import shutil

from torch import nn
from torch._dynamo import OptimizedModule  # what torch.compile(module) returns; Lightning imports it from here too

# Per device type: the variable torch or Triton reads, else the programs they look for on PATH.
COMPILERS = {
    "cpu": ("CXX", ("g++",)),  # torch._inductor.config.cpp.cxx
    "cuda": ("CC", ("gcc", "clang")),  # triton.runtime.build
}


def compiled_modules(model: nn.Module) -> list[str]:
    """The names of the modules in `model` (itself included, as "") that torch.compile compiled, however
    compiled: in place (`module.compile()`) or wrapped (`torch.compile(module)`)."""
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, OptimizedModule) or getattr(module, "_compiled_call_impl", None) is not None
    ]


def missing_compiler(device_type: str) -> str | None:
    """What torch.compile would look for on `device_type` and not find ("$CC, then gcc or clang on PATH"), else None."""
    if device_type not in COMPILERS:
        return None  # another backend's business (mps, xla): nothing known to look for
    variable, programs = COMPILERS[device_type]
    chosen = os.environ.get(variable)
    if chosen:  # used as given, with no fallback
        return None if shutil.which(chosen) else f"${variable} ({chosen})"
    if any(shutil.which(program) for program in programs):
        return None
    return f"${variable}, then {' or '.join(programs)} on PATH"


def compile_problem(model: nn.Module, device_type: str) -> str | None:
    """Why `model` cannot train compiled on `device_type` on this machine, in one line; None where it can."""
    compiled = compiled_modules(model)
    missing = missing_compiler(device_type) if compiled else None
    if missing is None:
        return None
    what = f"model.{compiled[0]}" if compiled[0] else "the model"
    more = f" (and {len(compiled) - 1} more)" if len(compiled) > 1 else ""
    return (
        f"{what}{more} is compiled (torch.compile), which builds code with a C compiler while training, and this"
        f" machine has none ({missing}): build the image with --build-arg COMPILER=1 (Dockerfile), install gcc"
        " and g++, or train uncompiled"
    )
