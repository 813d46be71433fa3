"""Output files of the commands, checked before any work starts."""

from __future__ import annotations

import os
from pathlib import Path

from dflash.errors import UsageError


class OutputPathError(UsageError):
    """An output path that cannot be written; the message names the option and the path."""


def check_output_file(path: Path, option: str, example: str = "report.json") -> Path:
    """``path`` if a file can be written there (missing parent folders may be created).

    Refused: an existing directory, an existing file without write permission, a parent
    that is a file, or a nearest existing parent folder without write permission.
    """
    if path.is_dir():
        raise OutputPathError(
            f"{option} names a directory ({str(path)!r}); give a file path such as "
            f"{str(path / example)!r}"
        )
    if path.exists():
        if not os.access(path, os.W_OK):
            raise OutputPathError(f"{option} {str(path)!r}: the file is not writable")
        return path
    parent = path.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise OutputPathError(f"{option} {str(path)!r}: {str(parent)!r} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputPathError(
            f"{option} {str(path)!r}: the directory {str(parent)!r} is not writable"
        )
    return path
