"""What the command line adds to the library: its default prompt, its thread setting and
the flag wording of the library's messages.

The library names parameters (``'dtype' must be one of ...``); the commands print the same
refusal with their flags (``--dtype must be one of ...``), through
:meth:`dflash.errors.UsageError.worded`. Only the commands change global torch settings.
"""

from __future__ import annotations

#: the prompt ``dflash generate`` / ``bench`` decode when none is given: code, like the
#: embedded pair's training data (the standard library)
DEFAULT_PROMPT = (
    "import os\n\n\ndef read_lines(path, encoding=\"utf-8\"):\n"
    "    \"\"\"Return the lines of the file at *path* without line endings.\"\"\"\n"
)

def flag(param: str) -> str:
    """The command-line flag of the library parameter ``param`` (``prompt_ids`` ->
    ``--prompt-ids``)."""
    return "--" + param.replace("_", "-")


def cli_message(exc: BaseException) -> str:
    """``exc``'s message with the parameters it names spelled as flags."""
    from dflash.errors import UsageError

    return exc.worded(flag) if isinstance(exc, UsageError) else str(exc)


def set_cpu_threads(model: str, device: str) -> None:
    """One torch thread for the ``tiny`` model on CPU: its matrices are far too small to
    share between threads, and one thread is several times faster and immune to other
    load on the machine. A process-wide setting, so the commands make it, not the library."""
    if model == "tiny" and device == "cpu":
        import torch  # imported here: ``dflash validate`` never loads torch

        torch.set_num_threads(1)
