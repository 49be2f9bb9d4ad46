"""The jail every model-issued command runs in.

Each episode gets a fresh temporary directory on the host; its ``workspace/`` is the only writable
place the commands can see. Every command is a fresh ``bash -c`` inside a bubblewrap jail:

* namespaces: user, mount, pid, network, ipc, uts and cgroup are all new. The network namespace has
  only its own loopback, so nothing (not even the host's 127.0.0.1) can be reached;
* file system: a new root that holds read-only binds of ``/usr`` and ``/etc`` (with ``/bin``,
  ``/lib``... as on the host), a private ``/proc`` and ``/dev``, a small size-capped ``/tmp`` and
  the episode's workspace at ``/workspace`` (also ``$HOME``). ``/root``, ``/home``, ``/work`` and
  the host's ``/tmp`` do not exist in there, so nothing outside the episode can be read or written;
* identity: when we are root, bubblewrap itself is started as ``nobody`` (65534) so that even a
  file the jail could see is checked against an unprivileged user; inside, every capability is
  dropped;
* resource limits (``ulimit``, set inside the jail so they cannot be raised again): CPU seconds,
  address space, processes (counted inside the jail's own user namespace), file size, open files,
  no core dumps;
* watched from outside: a wall-clock timeout, a cap on the bytes of output read back, and a cap on
  the workspace's size and file count. Breaking any of them kills the whole jail: bubblewrap runs
  with ``--die-with-parent`` and its pid namespace dies with its first process, so no child, grandchild
  or forked-off daemon survives a command.

If the jail cannot be set up (no ``bwrap``, user namespaces disabled, a probe that sees the network
or a writable system) :class:`SandboxUnavailable` is raised and nothing runs: there is no unconfined
fallback.
"""

from __future__ import annotations

import os
import re
import select
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

WORKSPACE = "/workspace"  # where the episode's workspace appears inside the jail
TESTS = "/tests"  # where a task's tests appear (read-only) while the verifier runs
NOBODY = 65534  # the unprivileged host user the jail runs as when we are root
JAIL_UID = NOBODY  # the user id seen inside the jail (also unprivileged there)

# Exit statuses of a command killed by a limit (bash reports 128 + signal number).
_SIGNAL_NOTES = {
    128 + signal.SIGXCPU: "CPU-time limit exceeded",
    128 + signal.SIGXFSZ: "file-size limit exceeded",
    128 + signal.SIGKILL: "killed",
    128 + signal.SIGSEGV: "segmentation fault (memory limit?)",
}


class SandboxUnavailable(RuntimeError):
    """The jail cannot be set up or stopped working; commands are refused, never run unconfined."""


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one command (the workspace limits hold for the whole episode)."""

    wall_seconds: float = 30.0  # wall-clock time of one command
    cpu_seconds: int = 20  # CPU time of each process (RLIMIT_CPU)
    memory_bytes: int = 1 << 30  # address space of each process (RLIMIT_AS)
    max_processes: int = 64  # processes and threads inside the jail (RLIMIT_NPROC, per user namespace)
    max_file_bytes: int = 64 << 20  # largest file a command may write (RLIMIT_FSIZE)
    max_open_files: int = 256  # RLIMIT_NOFILE
    max_output_bytes: int = 1 << 20  # stdout+stderr read back; past this the command is killed
    workspace_bytes: int = 256 << 20  # total size of the workspace
    workspace_files: int = 20_000  # files and directories in the workspace
    tmp_bytes: int = 64 << 20  # size of the jail's private /tmp (a tmpfs)

    def scaled(self, **changes) -> "SandboxLimits":
        values = {name: getattr(self, name) for name in self.__dataclass_fields__}
        values.update(changes)
        return SandboxLimits(**values)


@dataclass
class CommandResult:
    """What one command did. ``returncode`` is None when the jail was killed from outside."""

    command: str
    returncode: int | None
    output: str  # stdout and stderr interleaved, decoded as UTF-8 (bad bytes replaced)
    wall_seconds: float
    killed: str | None = None  # why the jail was killed: "wall-clock timeout", "output limit", "workspace limit"
    output_bytes: int = 0  # bytes the command wrote (counted up to the point it was killed)

    @property
    def ok(self) -> bool:
        return self.killed is None and self.returncode == 0

    def note(self) -> str | None:
        """A one-line explanation of an abnormal end, for the observation shown to the model."""
        if self.killed == "wall-clock timeout":
            return f"the command was killed after {self.wall_seconds:.0f} s (wall-clock limit)"
        if self.killed == "output limit":
            return f"the command was killed: its output passed the limit ({self.output_bytes:,} bytes read)"
        if self.killed == "workspace limit":
            return "the command was killed: the workspace passed its size or file-count limit"
        if self.returncode in _SIGNAL_NOTES:
            return _SIGNAL_NOTES[self.returncode]
        return None


def _system_binds() -> list[str]:
    """Read-only binds of the system: /usr and /etc, and /bin, /lib... as the host has them."""
    args = ["--ro-bind", "/usr", "/usr", "--ro-bind", "/etc", "/etc"]
    for path in ("/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32"):
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    return args


def _limits_prologue(limits: SandboxLimits) -> str:
    """Shell lines run first inside the jail: hard limits (cannot be raised again), then stderr
    joined to stdout, then the command (passed as $1, never interpolated)."""
    memory_kib = max(limits.memory_bytes // 1024, 1)
    file_kib = max(limits.max_file_bytes // 1024, 1)
    return (
        # CPU: SIGXCPU at the soft limit (a clear exit status), SIGKILL a second later
        f"ulimit -S -t {int(limits.cpu_seconds)} && ulimit -H -t {int(limits.cpu_seconds) + 1} && "
        f"ulimit -c 0 -v {memory_kib} -u {int(limits.max_processes)} "
        f"-f {file_kib} -n {int(limits.max_open_files)} "
        "|| { echo 'dsv41-sandbox: could not set resource limits' >&2; exit 125; }\n"
        "exec 2>&1\n"
        'exec /bin/bash -c "$1"\n'
    )


def _walk_usage(root: Path, max_entries: int) -> tuple[int, int]:
    """(bytes, entries) under root without following links; stops counting past max_entries."""
    total, entries, stack = 0, 0, [str(root)]
    while stack and entries <= max_entries:
        try:
            with os.scandir(stack.pop()) as it:
                for entry in it:
                    entries += 1
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    total += st.st_blocks * 512
                    if stat.S_ISDIR(st.st_mode):
                        stack.append(entry.path)
        except OSError:
            continue
    return total, entries


def _force_rmtree(path: Path) -> None:
    """Remove a tree the jail may have made hostile (read-only or 000 directories); never follows
    symbolic links (shutil.rmtree unlinks them)."""

    def make_writable_and_retry(function, target, _exc):
        parent = os.path.dirname(target)
        for p in (parent, target):
            try:
                if not os.path.islink(p):
                    os.chmod(p, 0o700)
            except OSError:
                pass
        try:
            function(target)
        except FileNotFoundError:
            pass

    if path.exists() or path.is_symlink():
        if sys.version_info >= (3, 12):
            shutil.rmtree(path, onexc=make_writable_and_retry)
        else:
            shutil.rmtree(path, onerror=lambda f, p, info: make_writable_and_retry(f, p, info[1]))


class Sandbox:
    """Factory of episodes; checks once that the jail really confines before anything runs.

    bwrap: path or name of the bubblewrap binary; base_dir: where episode directories are made
    (default: the system temporary directory)."""

    def __init__(self, limits: SandboxLimits | None = None, *, bwrap: str = "bwrap",
                 base_dir: str | os.PathLike | None = None):
        self.limits = limits or SandboxLimits()
        self.bwrap = bwrap
        self.base_dir = Path(base_dir) if base_dir is not None else Path(tempfile.gettempdir())
        self._checked: str | None = None  # the failure reason once checked, "" when fine
        self._run_as_nobody = os.geteuid() == 0
        self._tmpfs_size = True
        self._disable_userns = False

    # ------------------------------------------------------------------ setup
    def check(self) -> None:
        """Raise SandboxUnavailable unless the jail starts and confines (memoized)."""
        if self._checked is None:
            self._checked = self._probe()
        if self._checked:
            raise SandboxUnavailable(self._checked)

    def _probe(self) -> str:
        binary = shutil.which(self.bwrap)
        if binary is None:
            return (f"bubblewrap ({self.bwrap!r}) is not installed; install it (Debian: apt-get install "
                    "bubblewrap) - commands are never run without the jail")
        self.bwrap = binary
        try:
            help_text = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.SubprocessError) as e:
            return f"{binary} does not run: {e}"
        self._tmpfs_size = "--size" in help_text
        self._disable_userns = "--disable-userns" in help_text
        # Harmless probes: identity and capabilities, read-only system, no host paths, no network.
        script = (
            "set -u\n"
            "echo uid=$(id -u)\n"
            "grep '^CapEff' /proc/self/status\n"
            "( echo x > /usr/.dsv41-probe ) 2>/dev/null && echo usr=writable || echo usr=readonly\n"
            "( echo x > /etc/.dsv41-probe ) 2>/dev/null && echo etc=writable || echo etc=readonly\n"
            "echo probe > probe.txt && cat probe.txt && rm probe.txt\n"
            "echo interfaces=$(tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' ' | sort | tr '\\n' ,)\n"
            "[ -e /root ] || [ -e /home ] && echo host=visible || echo host=hidden\n"
        )
        try:
            with self.episode() as episode:
                result = episode.run(script, check=False)
        except SandboxUnavailable as e:
            return str(e)
        except OSError as e:
            return f"the jail could not be started: {e}"
        out = result.output
        lines = out.split("\n")
        expected = ["CapEff:\t0000000000000000", "usr=readonly", "etc=readonly", "probe", "interfaces=lo,",
                    "host=hidden"]
        if result.returncode != 0 or not all(line in lines for line in expected) or "uid=0" in lines:
            return "the jail did not confine as required (probe output: " + " | ".join(out.split("\n")[:8]) + ")"
        return ""

    # ------------------------------------------------------------------ episodes
    def episode(self) -> "Episode":
        """A fresh episode directory (use as a context manager; removed on exit)."""
        self.base_dir.mkdir(parents=True, exist_ok=True)
        root = Path(tempfile.mkdtemp(prefix="dsv41-episode-", dir=self.base_dir))
        return Episode(self, root)

    def command_line(self, episode: "Episode", command: str, *, tests_dir: Path | None = None,
                     limits: SandboxLimits | None = None, info_fd: int | None = None) -> list[str]:
        """The bwrap argv that runs ``command`` in ``episode`` (exposed for tests and docs)."""
        limits = limits or self.limits
        argv = [
            self.bwrap,
            "--unshare-all",  # user, ipc, pid, net, uts, cgroup: the network namespace has only lo
            "--unshare-user",
            "--uid", str(JAIL_UID), "--gid", str(JAIL_UID),
            "--hostname", "sandbox",
            "--die-with-parent",  # the jail dies when we kill its bwrap
            "--new-session",  # no terminal tricks (TIOCSTI) against the caller
            "--cap-drop", "ALL",
            *(["--info-fd", str(info_fd)] if info_fd is not None else []),
            *(["--disable-userns"] if self._disable_userns else []),  # no nested namespaces inside
            *_system_binds(),
            "--proc", "/proc",
            "--dev", "/dev",
        ]
        if self._tmpfs_size:
            argv += ["--size", str(limits.tmp_bytes), "--tmpfs", "/tmp"]
        else:  # an old bubblewrap: /tmp is a directory of the episode, counted in its quota
            argv += ["--bind", str(episode.tmp), "/tmp"]
        argv += ["--bind", str(episode.workspace), WORKSPACE]
        if tests_dir is not None:
            argv += ["--ro-bind", str(tests_dir), TESTS]
        if self._tmpfs_size:
            argv += ["--size", str(limits.tmp_bytes), "--tmpfs", "/dev/shm"]
        # bwrap's own root and /dev are unbounded in-memory file systems: make them read-only, so the
        # only writable places are the workspace and the size-capped /tmp and /dev/shm
        argv += ["--remount-ro", "/dev", "--remount-ro", "/"]
        argv += [
            "--chdir", WORKSPACE,
            "--clearenv",
            "--setenv", "PATH", "/usr/local/bin:/usr/bin:/bin:/usr/local/sbin:/usr/sbin:/sbin",
            "--setenv", "HOME", WORKSPACE,
            "--setenv", "TMPDIR", "/tmp",
            "--setenv", "LANG", "C.UTF-8",
            "--setenv", "TERM", "dumb",
            "--setenv", "PAGER", "cat",
            "--setenv", "GIT_PAGER", "cat",
            "--setenv", "PYTHONDONTWRITEBYTECODE", "1",
            "--",
            "/bin/bash", "-c", _limits_prologue(limits), "dsv41-sandbox", command,
        ]
        return argv


class Episode:
    """One episode's directory: ``workspace/`` (the jail's /workspace) and, for old bubblewraps,
    ``tmp/``. Use as a context manager: the directory is removed on exit, whatever happened."""

    def __init__(self, sandbox: Sandbox, root: Path):
        self.sandbox = sandbox
        self.root = root
        self.workspace = root / "workspace"
        self.tmp = root / "tmp"
        for d in (self.workspace, self.tmp):
            d.mkdir()
        self._hand_over(root)

    def __enter__(self) -> "Episode":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def remove(self) -> None:
        _force_rmtree(self.root)

    def _hand_over(self, path: Path) -> None:
        """Files the jail must write: owned by the jail's host user when that is `nobody`."""
        if not self.sandbox._run_as_nobody:
            return
        for p in [path, *path.rglob("*")] if path.is_dir() else [path]:
            if not p.is_symlink():
                os.chown(p, NOBODY, NOBODY)

    def copy_in(self, source: Path, destination: str = ".") -> None:
        """Copy a host directory's contents into the workspace (the task's environment)."""
        target = (self.workspace / destination).resolve()
        shutil.copytree(source, target, symlinks=True, dirs_exist_ok=True)
        self._hand_over(self.workspace)

    def stage_tests(self, source: Path) -> Path:
        """A readable copy of a task's tests, outside the workspace, to bind read-only at /tests."""
        target = self.root / "tests"
        if target.exists():
            _force_rmtree(target)
        shutil.copytree(source, target, symlinks=True)
        for p in [target, *target.rglob("*")]:
            if not p.is_symlink():
                os.chmod(p, 0o755 if p.is_dir() or os.access(p, os.X_OK) else 0o644)
        self._hand_over(target)
        return target

    def usage(self) -> tuple[int, int]:
        """(bytes, entries) in the workspace (and the fallback tmp directory)."""
        limits = self.sandbox.limits
        b1, n1 = _walk_usage(self.workspace, limits.workspace_files)
        b2, n2 = _walk_usage(self.tmp, limits.workspace_files)
        return b1 + b2, n1 + n2

    # ------------------------------------------------------------------ running commands
    def run(self, command: str, *, timeout: float | None = None, tests_dir: Path | None = None,
            limits: SandboxLimits | None = None, check: bool = True) -> CommandResult:
        """Run ``command`` with ``bash -c`` in the jail, cwd /workspace. Never raises for what the
        command does; raises SandboxUnavailable if the jail itself fails (``check``: verify the jail
        first)."""
        sandbox = self.sandbox
        if check:
            sandbox.check()
        limits = limits or sandbox.limits
        wall = limits.wall_seconds if timeout is None else timeout
        argv = sandbox.command_line(self, command, tests_dir=tests_dir, limits=limits)
        popen_kwargs = {}
        if sandbox._run_as_nobody:
            popen_kwargs = {"user": NOBODY, "group": NOBODY, "extra_groups": []}
        # bwrap reports the pid of the jail's first process on this pipe: killing that process tears
        # the whole pid namespace down, and bwrap returns only once every process in it is gone.
        info_read, info_write = os.pipe()
        started = time.monotonic()
        try:
            argv = sandbox.command_line(self, command, tests_dir=tests_dir, limits=limits, info_fd=info_write)
            process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, start_new_session=True, cwd="/",
                                       env={"PATH": "/usr/bin:/bin"}, pass_fds=(info_write,), **popen_kwargs)
        except BaseException:
            os.close(info_read)
            raise
        finally:
            os.close(info_write)
        output, jail_errors, info, count, killed = bytearray(), bytearray(), bytearray(), 0, None
        streams = {process.stdout.fileno(): "out", process.stderr.fileno(): "err", info_read: "info"}
        next_usage_check = started + 0.2
        try:
            while set(streams.values()) & {"out", "err"}:
                now = time.monotonic()
                if now - started > wall:
                    killed = "wall-clock timeout"
                    break
                if now >= next_usage_check:
                    size, entries = self.usage()
                    if size > limits.workspace_bytes or entries > limits.workspace_files:
                        killed = "workspace limit"
                        break
                    next_usage_check = now + 0.25
                ready, _, _ = select.select(list(streams), [], [], 0.05)
                for fd in ready:
                    chunk = os.read(fd, 65536)
                    if not chunk:
                        del streams[fd]
                        continue
                    if streams[fd] == "info":
                        info += chunk[: max(0, 4096 - len(info))]
                    elif streams[fd] == "err":
                        jail_errors += chunk[: max(0, 4096 - len(jail_errors))]
                    else:
                        count += len(chunk)
                        output += chunk[: max(0, limits.max_output_bytes - len(output))]
                if count > limits.max_output_bytes:
                    killed = "output limit"
                    break
            if killed is None:
                remaining = max(0.0, wall - (time.monotonic() - started))
                try:
                    process.wait(timeout=remaining)
                except subprocess.TimeoutExpired:
                    killed = "wall-clock timeout"
            if killed is None:  # the workspace may have grown in the last moments
                size, entries = self.usage()
                if size > limits.workspace_bytes or entries > limits.workspace_files:
                    killed = "workspace limit"
        finally:
            _stop_jail(process, info)
            process.stdout.close()
            process.stderr.close()
            os.close(info_read)
        elapsed = time.monotonic() - started
        errors = jail_errors.decode("utf-8", "replace").strip()
        if errors.startswith("bwrap:") or "dsv41-sandbox: could not set resource limits" in errors:
            raise SandboxUnavailable(f"the jail failed: {errors.splitlines()[0]}")
        returncode = None if killed else process.returncode
        text = output.decode("utf-8", "replace")
        return CommandResult(command, returncode, text, elapsed, killed, count)


def _stop_jail(process: subprocess.Popen, info: bytes) -> None:
    """Make sure nothing of the jail is left running: kill its first process (pid 1 of its namespace;
    the kernel then kills every other process in it) and wait for bwrap, which returns only when all
    are gone. While bwrap runs, its child's pid cannot have been reused, so the kill cannot hit a
    stranger. Falls back to killing bwrap's process group (its --die-with-parent child follows)."""
    if process.poll() is not None:
        return
    found = re.search(rb'"child-pid"\s*:\s*(\d+)', info)
    if found:
        try:
            os.kill(int(found.group(1)), signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            process.wait(timeout=10)
            return
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def describe_jail(sandbox: Sandbox) -> str:
    """The jail's command line for a placeholder command, for logs and docs."""
    with sandbox.episode() as episode:
        return shlex.join(sandbox.command_line(episode, "COMMAND"))
