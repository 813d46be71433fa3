"""``dflash serve``: OpenAI's HTTP API (chat and text completions, streamed or not, models,
health, metrics) over one loaded target and drafter; see :mod:`dflash.serve.app`."""

from dflash.serve.app import (
    Engine,
    Metrics,
    ServeConfig,
    ServeError,
    create_app,
    listen,
    run_server,
)

__all__ = ["Engine", "Metrics", "ServeConfig", "ServeError", "create_app", "listen",
           "run_server"]
