"""Python commands run in place: `python -m MODULE` as a fork of a process that has MODULE imported.

On a node, every process the agent starts (preflight, torchrun) and every rank torchrun starts is
a new interpreter that imports torch: seconds of CPU each, most of a local run's work on a small
machine. In the processes of a warm image (localcloud/warm_image.py), which has those modules
imported, `install()` makes subprocess.Popen run such a command in a fork of the calling process
instead: no exec, no imports. The rest is what an exec'd child gets, so the caller, the fleet and
every fault see the same process:

- a child of the caller (waited for, signalled and killed through the same Popen), in the session
  or process group asked for, with its stdin/stdout/stderr, working folder and environment;
- the descriptors an exec closes (close-on-exec, or all but 0-2 and pass_fds with close_fds)
  are pointed at /dev/null: their pipes and sockets are released, and their numbers stay taken
  until the caller's Python objects that own them let go (a closed number reused by a new file
  would be closed again under it);
- the signal dispositions of a new interpreter (handlers back to default, SIGPIPE and SIGXFSZ
  ignored, SIGINT raising KeyboardInterrupt); ignored signals stay ignored, as across exec;
- its name (/proc/PID/comm) is the module's (its command line stays the image's): how the fleet
  tells its roles apart (`module_of`);
- it exits as the interpreter would: its non-daemon threads joined, its atexit functions run,
  its output flushed. Functions the caller registered with atexit are not the child's.

Other commands (another program, other interpreter options, preexec_fn, a user or group change)
are exec'd as always.
"""

from __future__ import annotations

import atexit
import ctypes
import io
import logging
import os
import re
import runpy
import signal
import subprocess
import sys
import threading
import traceback
import warnings
from typing import Any, Callable, NoReturn

__all__ = ["install", "runnable", "exec_in_place", "module_of", "NAME_LENGTH"]

NAME_LENGTH = 15
"""How much of a module's name /proc/PID/comm holds (TASK_COMM_LEN - 1)."""
_PR_SET_NAME = 15
_OPTIONS = {"-u"}
"""Interpreter options a command run in place may have (torchrun starts its ranks with -u)."""


def runnable(argv: list[str]) -> bool:
    """Whether `argv` is `python [-u] -m MODULE ...` or `python [-u] -c CODE ...` with this
    interpreter: a command that can run in place."""
    return _parse(argv) is not None


def module_of(name: str, modules: list[str]) -> str | None:
    """Which of `modules` a process named `name` (its /proc/PID/comm) runs in place, if any."""
    return next((module for module in modules if module[:NAME_LENGTH] == name), None)


def exec_in_place(argv: list[str]) -> NoReturn:
    """What `os.execv(argv[0], argv)` would do for a runnable command, in this process: run it and
    exit with its status."""
    options, option, target, arguments = _parse(argv)
    _as_a_new_interpreter(name=target if option == "-m" else "python", unbuffered="-u" in options)
    if option == "-m":
        sys.argv = [target, *arguments]
        sys.path[0] = os.getcwd()
        # runpy warns that the module was imported before it ran: here it was, by the warm image,
        # on purpose; a new interpreter (a node's) has it not imported, and says nothing.
        warnings.filterwarnings("ignore", message=f"'{re.escape(target)}' found in sys.modules", category=RuntimeWarning)
        main = lambda: runpy.run_module(target, run_name="__main__", alter_sys=True)  # noqa: E731
    else:
        sys.argv = ["-c", *arguments]
        sys.path[0] = ""
        main = lambda: exec(compile(target, "<string>", "exec"), {"__name__": "__main__"})  # noqa: E731
    os._exit(_exit_status(main))


def install() -> None:
    """From now on, subprocess.Popen runs runnable commands in place (in this process and its
    forks)."""
    global _execute_child
    if _execute_child is None:
        _execute_child = subprocess.Popen._execute_child
        subprocess.Popen._execute_child = _execute_child_in_place


# --- the parent's side: Popen ------------------------------------------------------------

_execute_child: Callable[..., None] | None = None
"""subprocess.Popen's own, for what is not run in place."""


def _execute_child_in_place(self: subprocess.Popen, args: Any, executable: Any, preexec_fn: Any, close_fds: bool,
                            pass_fds: tuple[int, ...], cwd: Any, env: Any, startupinfo: Any, creationflags: int,
                            shell: bool, p2cread: int, p2cwrite: int, c2pread: int, c2pwrite: int,
                            errread: int, errwrite: int, restore_signals: bool, gid: Any, gids: Any, uid: Any,
                            umask: int, start_new_session: bool, process_group: int) -> None:
    argv = [os.fsdecode(arg) for arg in args] if isinstance(args, (list, tuple)) else None
    if (argv is None or shell or executable is not None or preexec_fn is not None or not runnable(argv)
            or (gid, gids, uid) != (None, None, None)):
        return _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
                              creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite,
                              restore_signals, gid, gids, uid, umask, start_new_session, process_group)
    environment = dict(os.environ if env is None else {os.fsdecode(k): os.fsdecode(v) for k, v in env.items()})
    errors_read, errors_write = os.pipe()
    # Signals wait until the child has a new interpreter's dispositions, as an exec's would: one
    # sent as soon as Popen returns must not run the starter's handler in the child.
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
    pid = os.fork()
    if pid != 0:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    else:
        try:
            _reset_signals()
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            os.close(errors_read)
            if start_new_session:
                os.setsid()
            elif process_group >= 0:
                os.setpgid(0, process_group)
            for fd, target in ((p2cread, 0), (c2pwrite, 1), (errwrite, 2)):
                if fd == target:
                    os.set_inheritable(fd, True)
                elif fd != -1:
                    os.dup2(fd, target)
            if cwd is not None:
                os.chdir(cwd)
            if umask >= 0:
                os.umask(umask)
            _release_descriptors(keep={0, 1, 2, *pass_fds}, every_one=close_fds, also={errors_write})
            os.environ.clear()
            os.environ.update(environment)
        except BaseException as error:  # noqa: BLE001 (told to the parent, as exec's failures are)
            os.write(errors_write, f"{getattr(error, 'errno', 0) or 0}:{error}".encode())
            os._exit(255)
        os.close(errors_write)
        exec_in_place(argv)
    self.pid, self._child_created = pid, True
    os.close(errors_write)
    self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)
    with os.fdopen(errors_read, "rb") as errors:
        failure = errors.read()
    if failure:
        os.waitpid(pid, 0)
        self.returncode = 255
        number, message = failure.decode(errors="replace").split(":", 1)
        raise OSError(int(number), f"starting {argv[:3]} in place: {message}")


def _release_descriptors(keep: set[int], every_one: bool, also: set[int]) -> None:
    """Release what an exec would close: every descriptor but `keep` (every_one) or the
    close-on-exec ones. Each is pointed at /dev/null rather than closed (see the module's
    docstring). `also`: kept open, closed by the caller later."""
    null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    for fd in map(int, os.listdir("/proc/self/fd")):
        if fd in keep or fd in also or fd == null:
            continue
        try:
            if every_one or not os.get_inheritable(fd):
                os.dup2(null, fd, inheritable=False)
        except OSError:
            pass  # the listing's own descriptor, closed since
    os.close(null)


# --- the child's side: be a new interpreter ----------------------------------------------

def _as_a_new_interpreter(name: str, unbuffered: bool) -> None:
    _reset_signals()
    ctypes.CDLL(None).prctl(_PR_SET_NAME, name[:NAME_LENGTH].encode(), 0, 0, 0)
    unbuffered = unbuffered or bool(os.environ.get("PYTHONUNBUFFERED"))
    sys.stdin = _stream(0, "r", unbuffered=False)
    sys.stdout = _stream(1, "w", unbuffered)
    sys.stderr = _stream(2, "w", unbuffered=True)  # stderr is line-buffered at least, as Python's
    atexit._clear()
    atexit.register(logging.shutdown)  # what `import logging` registers in a new interpreter
    _add_python_path(os.environ.get("PYTHONPATH", ""))


def _reset_signals() -> None:
    """A new interpreter's dispositions: handlers back to default (ignored signals stay ignored,
    as across exec), SIGPIPE and SIGXFSZ ignored, SIGINT raising KeyboardInterrupt."""
    for signum in signal.valid_signals():
        try:
            handler = signal.getsignal(signum)
        except (OSError, ValueError):
            continue
        if callable(handler):
            signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    if signal.getsignal(signal.SIGINT) == signal.SIG_DFL:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _stream(fd: int, mode: str, unbuffered: bool) -> io.TextIOWrapper:
    raw = io.FileIO(fd, mode, closefd=False)
    buffered = raw if unbuffered and mode == "w" else (io.BufferedWriter(raw) if mode == "w" else io.BufferedReader(raw))
    return io.TextIOWrapper(buffered, encoding="utf-8", errors="backslashreplace" if fd == 2 else "strict",
                            line_buffering=raw.isatty() or fd == 2, write_through=unbuffered)


def _add_python_path(python_path: str) -> None:
    """The command's PYTHONPATH on the path (the image's interpreter read its own at start)."""
    entries = [entry for entry in python_path.split(os.pathsep) if entry and entry not in sys.path]
    sys.path[1:1] = entries


def _exit_status(main: Callable[[], Any]) -> int:
    """Run `main()` and end as the interpreter ends a program: the status it exits with."""
    try:
        main()
        status = 0
    except SystemExit as exit_request:
        code = exit_request.code
        if code is None or isinstance(code, int):
            status = code or 0
        else:
            print(code, file=sys.stderr)
            status = 1
    except BaseException:  # noqa: BLE001 (the interpreter's own answer to an uncaught error)
        traceback.print_exc()
        status = 1
    threading._shutdown()  # the interpreter joins the program's non-daemon threads
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    return status


def _parse(argv: list[str]) -> tuple[list[str], str, str, list[str]] | None:
    if len(argv) < 3 or argv[0] != sys.executable:
        return None
    options = []
    for index, argument in enumerate(argv[1:], start=1):
        if argument in ("-m", "-c"):
            if index + 1 >= len(argv):
                return None
            return options, argument, argv[index + 1], argv[index + 2:]
        if argument not in _OPTIONS:
            return None
        options.append(argument)
    return None
