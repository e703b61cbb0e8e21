"""pytest setup for bench/: collect the bench_*.py micro benchmark modules.

The project's pytest config (pyproject.toml) still applies here: run from the repository
root, `python -m pytest bench` finds it, so markers, --strict-markers and the timeout hold.
The `python_files` ini option is global (it would also change what tests/ collects), so
instead this conftest hook collects bench_*.py, and pytest only consults a conftest's
pytest_collect_file for files under the conftest's own directory: tests/ is unaffected.
test_*.py files here (the slow end-to-end check) are collected the ordinary way.
"""

from __future__ import annotations

from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parent


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Module | None:
    # A file named on the command line is collected by pytest itself whatever its name;
    # returning a module for it here as well would run it twice.
    if (file_path.suffix == ".py" and file_path.name.startswith("bench_")
            and file_path.parent == BENCH_DIR and not parent.session.isinitpath(file_path)):
        ihook = parent.session.gethookproxy(file_path)
        return ihook.pytest_pycollect_makemodule(module_path=file_path, parent=parent)
    return None
