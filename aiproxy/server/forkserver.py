"""Where worker processes come from: a multiprocessing forkserver with the proxy imported.

The supervisor itself never imports the request path; the forkserver does, once, and
every worker start or restart is a fork of it. `prestart()` launches it before the
supervisor's own imports so both import at the same time.
"""

from __future__ import annotations

import multiprocessing
from multiprocessing import forkserver
from multiprocessing.context import BaseContext

PRELOAD = ["aiproxy.server.worker"]


def context() -> BaseContext:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def prestart() -> None:
    context()
    forkserver.ensure_running()
