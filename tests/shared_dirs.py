"""Directories built once per test session and shared by the pytest-xdist workers."""

import fcntl
import json
import os
import shutil


def shared_across_workers(tmp_path_factory, name: str, build):
    """``(directory, result)``: ``build(directory)``'s JSON result, built once per session in
    ``directory``, a folder of the session's temporary directory that every pytest-xdist worker
    sees (the pattern of pytest-xdist's docs). The first worker to ask builds it under a file
    lock; the others wait for it and read the result. A directory to read, not to write into."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    directory, done = root / name, root / f"{name}.json"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            shutil.rmtree(directory, ignore_errors=True)
            directory.mkdir()
            done.write_text(json.dumps(build(directory)))
    return directory, json.loads(done.read_text())
