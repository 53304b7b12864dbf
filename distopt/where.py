"""The user's own source line: what every error, fallback warning and wait quotes.

A frame is the user's when its file is not in Python's standard library, not in torch and not in
distopt itself (distopt's reference models count as user code: they are written as users write
models).
"""

from __future__ import annotations

import inspect
import os
import sysconfig
import traceback
import types

import torch

_DISTOPT_DIR = os.path.dirname(os.path.abspath(__file__))
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
_USER_DIRS = (os.path.join(_DISTOPT_DIR, "models") + os.sep,)
_STDLIB_DIRS = tuple(
    {
        os.path.abspath(p) + os.sep
        for p in (sysconfig.get_path("stdlib"), sysconfig.get_path("platstdlib"))
        if p
    }
)


def is_user_file(filename: str) -> bool:
    """Whether code in ``filename`` is the user's (see the module docstring)."""
    if filename.startswith("<"):
        return False
    path = os.path.abspath(filename)
    if path.startswith(_USER_DIRS):
        return True
    if path.startswith((_TORCH_DIR + os.sep, _DISTOPT_DIR + os.sep)):
        return False
    # site-packages lives under the stdlib directory of some layouts: third-party code is the
    # user's (transformers' modeling code is what a model author wrote).
    return "site-packages" in path or not path.startswith(_STDLIB_DIRS)


def _format(frame: traceback.FrameSummary) -> str:
    return f"{frame.filename}:{frame.lineno}: {(frame.line or '').strip()}"


def user_frame_of(frame: types.FrameType | None) -> traceback.FrameSummary | None:
    """The innermost user frame from ``frame`` outwards."""
    frames = [f for f in traceback.extract_stack(frame) if is_user_file(f.filename)]
    return frames[-1] if frames else None


def user_line(frame: types.FrameType | None) -> str | None:
    """``file:line: code`` of the innermost user frame from ``frame`` outwards."""
    summary = user_frame_of(frame)
    return None if summary is None else _format(summary)


def defined_at(fn: object) -> str | None:
    """``file:line`` where function ``fn`` is defined, when Python can tell."""
    code = getattr(inspect.unwrap(fn), "__code__", None) if callable(fn) else None
    return None if code is None else f"{code.co_filename}:{code.co_firstlineno}"


def user_frame(exc: BaseException) -> str | None:
    """``file:line: code`` of the innermost traceback frame of ``exc`` in the user's code."""
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        if is_user_file(frame.filename):
            return _format(frame)
    return None


def describe_failure(exc: BaseException) -> str:
    """``Type: first line of the message (at user_file:line: code)``."""
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    where = user_frame(exc)
    if isinstance(exc, SyntaxError) and exc.filename and exc.msg:
        # The user's line is in the exception, not in a frame; str() names the file without
        # its folder.
        message = exc.msg
        text = (exc.text or "").strip()
        where = f"{exc.filename}:{exc.lineno}" + (f": {text}" if text else "")
    return f"{type(exc).__name__}: {message}" + (f" (at {where})" if where else "")


def caller_stack(frame: types.FrameType | None, *, limit: int = 2) -> str:
    """The innermost ``limit`` user frames from ``frame`` outwards, formatted as a traceback
    (outermost first): the ``stack_trace`` a traced remote call carries into errors."""
    frames = [f for f in traceback.extract_stack(frame) if is_user_file(f.filename)]
    return "".join(traceback.format_list(frames[-limit:]))


def frames_of(stack_trace: str) -> list[traceback.FrameSummary]:
    """Frames of a formatted stack trace (``File "x.py", line 3, in f`` + code lines)."""
    summaries = []
    lines = stack_trace.splitlines()
    for index, line in enumerate(lines):
        stripped = line.strip()
        if not stripped.startswith('File "'):
            continue
        try:
            file_part, line_part, name_part = stripped.split(", ", 2)
            filename = file_part[len('File "') : -1]
            lineno = int(line_part.removeprefix("line "))
            name = name_part.removeprefix("in ")
        except ValueError:
            continue
        code = lines[index + 1].strip() if index + 1 < len(lines) else ""
        summaries.append(traceback.FrameSummary(filename, lineno, name, line=code))
    return summaries


def call_site(stack_trace: str | None, default: str) -> str:
    """Where a traced call was written: the innermost user frame of its stack trace, and when a
    helper made the call, the line that called the helper too (``model.py:30: e = helper(...)
    via helpers.py:12: return rpc.rpc_sync(...)``)."""
    frames = [f for f in frames_of(stack_trace or "") if is_user_file(f.filename)]
    if not frames:
        return default
    inner = frames[-1]
    outer = next((f for f in reversed(frames) if f.name == "forward"), inner)
    return _format(outer) if outer is inner else f"{_format(outer)} via {_format(inner)}"
