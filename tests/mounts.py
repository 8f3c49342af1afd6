"""``train.py`` under a mount of its own, in a user and mount namespace (``unshare -rm``): the
kernel's own EROFS and ENOSPC, with no root needed where user namespaces are allowed."""

import pathlib
import shlex
import subprocess
import sys

from subprocess_env import subprocess_env

REPO = pathlib.Path(__file__).resolve().parents[1]


def read_only(where: str) -> str:
    """A read-only bind mount of ``where`` over itself."""
    return f"mount --bind -o ro {where} {where}"


def tmpfs(size: str):
    """A tmpfs of ``size`` (``2m``, ``16k``) mounted at ``where``."""
    return lambda where: f"mount -t tmpfs -o size={size} tmpfs {where}"


def mount_works(mount) -> bool:
    """Whether this machine lets ``mount(where)`` run in a namespace (a read-only one must also
    refuse a write)."""
    check = " && ! touch /tmp/.ro" if mount is read_only else ""
    probe = ["unshare", "-rm", "sh", "-c", mount("/tmp") + check]
    try:
        return subprocess.run(probe, capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def train_under(mount, where: pathlib.Path, run_dir: pathlib.Path, args: list[str], timeout=300):
    """Runs ``train.py --no-progress run_dir=RUN args`` with ``mount(where)`` in place (``where``
    is created first); returns ``(returncode, stdout, stderr)``. A run still going after
    ``timeout`` seconds is killed (its return code then says so)."""
    where.mkdir(parents=True)
    train = [sys.executable, "train.py", "--no-progress", f"run_dir={run_dir}", *args]
    command = f"{mount(shlex.quote(str(where)))} && exec {shlex.join(train)}"
    child = subprocess.Popen(
        ["unshare", "-rm", "sh", "-c", command],
        cwd=REPO,
        env=subprocess_env(1),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        child.kill()
        out, err = child.communicate()
    return child.returncode, out, err
