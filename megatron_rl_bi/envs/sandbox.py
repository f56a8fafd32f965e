"""OS isolation for model-written programs and commands. Every environment that runs code calls
`run` (one entry point), which runs the command under bubblewrap (`bwrap`, the distributions'
package; Flatpak's sandbox) rather than under rules of our own.

Each run gets its own namespaces: user (uid 65534 inside, no capabilities), PID (it sees only
its own processes; when the first one ends or is killed, the kernel kills every other), network
(its own loopback only: no route out, no host socket, abstract ones included), mount, IPC, UTS and
cgroup. Its filesystem holds, read-only, the system's library directories (`/lib*`, `/usr/lib*`)
and the sandbox's Python (`SandboxConfig.python`: the interpreter, its standard library), a
fresh `/proc` and a minimal `/dev`; and one writable directory, `/work`, a fresh tmpfs of
`disk_mb` holding the files given. No `/etc`, `/home`, `/tmp`, none of the caller's environment
variables; no `/usr/bin` or shell either, unless `SandboxConfig.shell` binds the system's
commands (`/bin`, `/usr/bin`) read-only for a terminal. Inside, before the command starts, a launcher sets the resource
limits: CPU seconds, address space of a process, file size, open files, processes and threads
(counted per sandbox, the keeper below among them: RLIMIT_NPROC counts per user namespace). A caller running as root starts
bubblewrap as uid 65534, since the kernel exempts uid 0 from RLIMIT_NPROC in every namespace.
Inside, a keeper runs the command: it reads the command's output through pipes (each stream up
to `output_bytes`), waits for the command and every process it started (orphans come to the
keeper, their subreaper), so what a background job or a daemon writes is there every time
instead of racing the command's end, and kills whatever still runs `seconds` after the
command's start (a busy host's sandbox start-up is not the command's time). The keeper makes
itself non-dumpable, so the command, though it runs as the same user, cannot open the keeper's
`/proc` files or trace it, and cannot forge what it sends back. The host kills bubblewrap, and
with it (`--die-with-parent`, the PID namespace) every descendant, KEEPER_START_SECONDS after the
limit, for a keeper the command stopped.

`run_keeping_files` (a terminal's turn, whose files must outlive it) has the keeper write the
regular files of `/work` back to the caller too. A command killed at the limit, or one that kills
or stops the keeper, sends no files: they stay as they were before it.

Not isolated: the kernel itself (there is no seccomp filter; a kernel exploit is out of scope),
the machine's memory beyond the per-process limit (at most `processes x memory_mb` a sandbox, no
cgroup), what `/proc` tells of the machine, and CPU time within the limits.

Where bubblewrap is missing or the host forbids user namespaces, `check` says why, and callers
refuse to start unless the user opts into `isolated=False` (`--rl-code-without-isolation`): the
same limits, a fresh directory, the process group killed at the limit, nothing else.
"""

import base64
import contextlib
import functools
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field

BUBBLEWRAP = "bwrap"
INSTALL_HINT = "install bubblewrap: apt-get install bubblewrap (Debian, Ubuntu) or dnf install bubblewrap (Fedora, RHEL)"
WORKDIR = "/work"
NOBODY = 65534
# The system's library directories, bound read-only (a symbolic link among them stays a link).
LIBRARY_DIRECTORIES = ("/lib", "/lib64", "/lib32", "/libx32", "/usr/lib", "/usr/lib64", "/usr/lib32")
COMMAND_DIRECTORIES = ("/bin", "/usr/bin")  # SandboxConfig.shell
# run_keeping_files: the host's bound past the keeper's limit (a busy host's sandbox start-up took
# up to 8.5 s; a command that stops its keeper costs this much wall time, and its turn)
KEEPER_START_SECONDS = 30.0

# Runs inside the sandbox (argv: cpu seconds, address space, file size, open files, processes,
# then the command): sets the limits, then becomes the command.
_LAUNCHER = r"""
import os, resource, sys
cpu, address_space, file_size, files, processes = map(int, sys.argv[1:6])
for limit, value in ((resource.RLIMIT_CPU, cpu), (resource.RLIMIT_AS, address_space),
                     (resource.RLIMIT_FSIZE, file_size), (resource.RLIMIT_NOFILE, files),
                     (resource.RLIMIT_NPROC, processes), (resource.RLIMIT_CORE, 0)):
    resource.setrlimit(limit, (value, value))
os.execv(sys.argv[6], sys.argv[6:])
"""

# Runs inside the sandbox (argv: wall-clock seconds, bytes of output read back, 1 to send the
# files back, then the launcher's command line): runs the launcher (the limits, then the command),
# waits for it and for every process it started (their subreaper), kills whatever still runs
# `seconds` after the command's start, and writes its result (with 1, and unless killed at the
# limit, the working directory's regular files: base64, mode) to stdout, which the command does
# not hold.
_KEEPER = r"""
import base64, ctypes, json, os, signal, stat, subprocess, sys, threading, time
seconds, output_bytes, send_files = float(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
libc = ctypes.CDLL(None)
if libc.prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE 0
    sys.exit("the keeper could not make itself non-dumpable")
if libc.prctl(36, 1, 0, 0, 0) != 0:  # PR_SET_CHILD_SUBREAPER: the command's orphans become the keeper's
    sys.exit("the keeper could not become the subreaper of the command's processes")
started = time.monotonic()
command = subprocess.Popen(sys.argv[4:], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
outputs = {}
def read(name, stream):
    outputs[name] = stream.read(output_bytes)
    while stream.read(1 << 16):
        pass
readers = [threading.Thread(target=read, args=item) for item in (("stdout", command.stdout), ("stderr", command.stderr))]
for reader in readers:
    reader.start()
# The command's exit status once it and every process it started have exited, or None at the
# deadline: a result must not depend on whether a background job ran before the command ended.
def wait_for_all(deadline):
    try:
        returncode = command.wait(timeout=max(deadline - time.monotonic(), 0))
    except subprocess.TimeoutExpired:
        return None
    while True:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:  # some still run
                if time.monotonic() >= deadline:
                    return None
                time.sleep(0.005)
        except ChildProcessError:  # none left
            return returncode
returncode = wait_for_all(started + seconds)
ran = time.monotonic() - started
try:
    os.kill(-1, signal.SIGKILL)  # every process of the sandbox but this one and bubblewrap's init
except ProcessLookupError:  # none left
    pass
for reader in readers:
    reader.join()
result = {"stdout": outputs["stdout"].decode(errors="replace"), "stderr": outputs["stderr"].decode(errors="replace"),
          "returncode": returncode, "seconds": ran, "files": None}
if returncode is None or not send_files:
    json.dump(result, sys.stdout)
    sys.exit()
def readable(path, info, bits):  # the command's chmod must not hide its own files from the keeper
    if stat.S_IMODE(info.st_mode) & bits != bits:
        os.chmod(path, stat.S_IMODE(info.st_mode) | bits)
kept = {}
readable("/work", os.lstat("/work"), 0o700)
for directory, subdirectories, names in os.walk("/work"):
    for name in subdirectories:
        path = os.path.join(directory, name)
        if stat.S_ISDIR((info := os.lstat(path)).st_mode):
            readable(path, info, 0o700)
    for name in names:
        path = os.path.join(directory, name)
        info = os.lstat(path)
        if stat.S_ISREG(info.st_mode):
            readable(path, info, 0o400)
            with open(path, "rb") as f:
                kept[os.path.relpath(path, "/work")] = [base64.b64encode(f.read()).decode(), stat.S_IMODE(info.st_mode)]
json.dump({**result, "files": kept}, sys.stdout)
"""


def base_interpreter() -> str:
    """The running Python's base installation (not a virtual environment's: its packages stay
    outside the sandbox)."""
    return os.path.realpath(getattr(sys, "_base_executable", sys.executable))


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot isolate a program on this host; the message says why."""


@dataclass(frozen=True)
class SandboxConfig:
    python: str = field(default_factory=base_interpreter)
    """The interpreter bound into the sandbox (it runs the launcher, and Python programs)."""
    isolated: bool = True
    """False only by the user's explicit choice (--rl-code-without-isolation): no namespaces."""
    seconds: float = 5.0
    """Wall-clock seconds; CPU seconds likewise (rounded up)."""
    memory_mb: int = 1024
    """Address space of each process, MiB."""
    processes: int = 16
    """Processes and threads at once, the first included."""
    disk_mb: int = 64
    """Size of the working directory (a tmpfs), MiB."""
    file_mb: int = 16
    """Size of a file the program writes, its output streams included, MiB."""
    open_files: int = 64
    output_bytes: int = 8192
    """Bytes of stdout, and of stderr, read back."""
    shell: bool = False
    """Bind the system's commands (`/bin`, `/usr/bin`: a shell and its tools) read-only."""

    def __post_init__(self):
        # the path bound into the sandbox: a link's target (the link's directory is not there)
        object.__setattr__(self, "python", os.path.realpath(self.python))


@dataclass(frozen=True)
class WorkFile:
    """A file of the working directory: its bytes and permission bits."""

    data: bytes
    mode: int = 0o644


@dataclass(frozen=True)
class Result:
    stdout: str
    stderr: str
    returncode: int | None
    """The command's exit status (minus the signal that killed it); None: killed at the time limit."""
    seconds: float | None = None
    """How long the command ran, from its start inside the sandbox to the end of its last process
    (not the sandbox's start-up, which a busy host stretches); None when it sent nothing back, or
    run unisolated."""


Files = dict[str, "str | bytes | WorkFile"]
"""A working directory's files: a relative path (subdirectories made as needed) -> its text,
bytes, or WorkFile (with its mode; text and bytes are 0644)."""


def run(config: SandboxConfig, command: list[str], files: Files) -> Result:
    """`command` (an absolute path first) run in a fresh working directory holding `files`,
    isolated as the module docstring says (merely limited when not `config.isolated`). A command
    killed at the time limit returns what it had written by then."""
    if config.isolated:
        return _run_kept(config, command, files, send_files=False)[0]
    with _sandbox_inputs(files) as (inputs, out, err):
        returncode = _run_unisolated(config, _launcher(config, command), inputs, out, err)
        return Result(_read(out, config.output_bytes), _read(err, config.output_bytes), returncode)


def run_keeping_files(config: SandboxConfig, command: list[str], files: Files) -> tuple[Result, dict | None]:
    """`command` run as `run` does, and the working directory's regular files after it (path ->
    WorkFile; symbolic links and empty directories are not kept), or None when it sent none back
    (killed at the time limit, with no output: what it had written by then depends on timing;
    or it killed the keeper): the caller's files then stand. Isolated only: without the
    namespaces the keeper could not tell the command's processes from the user's, nor keep the
    command from forging its answer."""
    if not config.isolated:
        raise ValueError("run_keeping_files: isolated only (a terminal has no unisolated mode)")
    result, kept = _run_kept(config, command, files, send_files=True)
    if result.returncode is None:
        return Result("", "", None), None
    return result, kept


def _run_kept(config: SandboxConfig, command: list[str], files: Files, send_files: bool) -> tuple[Result, dict | None]:
    """`command` under the keeper: its result, and with `send_files` the working directory's
    files (None when killed at the limit, or when the keeper sent no answer)."""
    keeper = [config.python, "-I", "-S", "-B", "-c", _KEEPER, str(config.seconds), str(config.output_bytes),
              "1" if send_files else "0", *_launcher(config, command)]
    with _sandbox_inputs(files) as (inputs, out, err):
        # the keeper times the command from its start; the host's bound is for a keeper the
        # command stopped, and leaves a busy host's sandbox start-up out of the limit
        returncode = _run_isolated(config, keeper, inputs, out, err, config.seconds + KEEPER_START_SECONDS)
        out.seek(0)
        try:  # at most the working directory, base64, and the outputs
            kept = json.loads(out.read((config.disk_mb << 21) + 4 * config.output_bytes + (1 << 20)))
        except ValueError:
            kept = None
        if returncode != 0 or not isinstance(kept, dict):
            return Result("", _read(err, config.output_bytes), returncode), None
    result = Result(kept["stdout"], kept["stderr"], kept["returncode"], kept["seconds"])
    if kept["files"] is None:
        return result, None
    return result, {path: WorkFile(base64.b64decode(data), mode) for path, (data, mode) in kept["files"].items()}


def _launcher(config: SandboxConfig, command: list[str]) -> list[str]:
    """`command` under _LAUNCHER: config's limits set, then the command."""
    return [config.python, "-I", "-S", "-B", "-c", _LAUNCHER, str(math.ceil(config.seconds)),
            str(config.memory_mb << 20), str(config.file_mb << 20), str(config.open_files), str(config.processes),
            *command]


def check_path(name: str) -> None:
    """A ValueError naming `name` unless it is a plain relative path (a working directory's file)."""
    if not name or name.startswith("/") or any(part in ("", ".", "..") for part in name.split("/")):
        raise ValueError(f"file {name!r}: expected a relative path without '.', '..' or '//'")


@contextlib.contextmanager
def _sandbox_inputs(files: Files):
    """A scratch directory holding each file's bytes as input0, input1, ..., and the command's
    output files: ([(path, host file, mode), ...], out, err); a path that is not relative and
    plain fails, naming it."""
    with tempfile.TemporaryDirectory(prefix="rl_sandbox_") as scratch:
        inputs = []
        for name, content in files.items():
            check_path(name)
            if not isinstance(content, WorkFile):
                content = WorkFile(content.encode() if isinstance(content, str) else content)
            inputs.append((name, os.path.join(scratch, f"input{len(inputs)}"), content.mode & 0o777))
            with open(inputs[-1][1], "wb") as f:
                f.write(content.data)
        with open(os.path.join(scratch, "out"), "w+b") as out, open(os.path.join(scratch, "err"), "w+b") as err:
            yield inputs, out, err


def _run_isolated(config: SandboxConfig, launch: list[str], inputs, out, err, seconds: float) -> int | None:
    descriptors = [os.open(path, os.O_RDONLY) for _, path, _ in inputs]
    arguments = [shutil.which(BUBBLEWRAP) or BUBBLEWRAP, "--unshare-all", "--die-with-parent", "--new-session",
                 "--cap-drop", "ALL", "--clearenv", "--uid", str(NOBODY), "--gid", str(NOBODY),
                 "--hostname", "sandbox", "--setenv", "HOME", WORKDIR, "--setenv", "LANG", "C.UTF-8"]
    if config.shell:
        arguments += ["--setenv", "PATH", "/usr/bin:/bin"]
    for path in _read_only_paths(config.python, config.shell):
        arguments += ["--symlink", os.readlink(path), path] if os.path.islink(path) else ["--ro-bind", path, path]
    arguments += ["--proc", "/proc", "--dev", "/dev", "--size", str(config.disk_mb << 20), "--tmpfs", WORKDIR]
    made = set()
    for (name, _, mode), descriptor in zip(inputs, descriptors):
        for depth in range(1, name.count("/") + 1):
            if (directory := "/".join(name.split("/")[:depth])) not in made:
                made.add(directory)
                arguments += ["--dir", f"{WORKDIR}/{directory}"]
        arguments += ["--perms", f"{mode:04o}", "--file", str(descriptor), f"{WORKDIR}/{name}"]
    # bwrap's own root tmpfs, read-only once the mounts above are made
    arguments += ["--remount-ro", "/", "--chdir", WORKDIR, "--"]
    unprivileged = {"user": NOBODY, "group": NOBODY, "extra_groups": []} if os.geteuid() == 0 else {}
    try:
        returncode = _wait(arguments + launch, seconds, out, err, pass_fds=descriptors, **unprivileged)
        # bwrap exits with 128 + N when signal N ended the command, as a shell does
        return 128 - returncode if returncode is not None and returncode > 128 else returncode
    finally:
        for descriptor in descriptors:
            os.close(descriptor)


def _run_unisolated(config: SandboxConfig, launch: list[str], inputs, out, err) -> int | None:
    with tempfile.TemporaryDirectory(prefix="rl_unisolated_") as directory:
        for name, path, mode in inputs:
            os.makedirs(os.path.dirname(os.path.join(directory, name)), exist_ok=True)
            shutil.copyfile(path, os.path.join(directory, name))
            os.chmod(os.path.join(directory, name), mode)
        return _wait(launch, config.seconds, out, err, cwd=directory)


def _wait(command: list[str], seconds: float, out, err, **popen) -> int | None:
    """The exit status, or None once `seconds` have passed (the process group killed:
    bubblewrap, or the unisolated command and the children still in its group)."""
    process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out, stderr=err, env={},
                               start_new_session=True, **popen)
    try:
        return process.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        return None


def _read(stream, limit: int) -> str:
    stream.seek(0)
    return stream.read(limit).decode(errors="replace")


@functools.cache
def _read_only_paths(python: str, shell: bool = False) -> tuple[str, ...]:
    """The library directories that exist (and with `shell` the command directories), then what
    of `python` lies outside them (a pyenv or conda installation): the executable, its standard
    library and its shared-library directory."""
    paths = [p for p in LIBRARY_DIRECTORIES + (COMMAND_DIRECTORIES if shell else ()) if os.path.lexists(p)]
    query = "import json, sys, sysconfig; print(json.dumps([sysconfig.get_config_var('LIBDIR'), " \
            "sysconfig.get_paths()['stdlib'], sys.executable]))"
    found = subprocess.run([python, "-I", "-c", query], capture_output=True, text=True, env={}, check=True)
    for path in json.loads(found.stdout):
        real = os.path.realpath(path or "")
        if path and os.path.exists(real) and not any(_within(real, p) for p in paths):
            paths.append(real)
    return tuple(paths)


def _within(path: str, directory: str) -> bool:
    return (path + os.sep).startswith(os.path.realpath(directory) + os.sep)


@functools.cache
def check(python: str) -> None:
    """Raises SandboxUnavailable, saying why, when `run` cannot isolate a program here."""
    if shutil.which(BUBBLEWRAP) is None:
        raise SandboxUnavailable(f"bubblewrap ('{BUBBLEWRAP}') is not on PATH; {INSTALL_HINT}")
    config = SandboxConfig(python=python, seconds=30)
    if not os.access(config.python, os.X_OK):
        raise SandboxUnavailable(f"the sandbox's Python {python} is not an executable file")
    result = run(config, [config.python, "-I", "-c", "print('isolated')"], {})
    if result.returncode != 0 or result.stdout != "isolated\n":
        raise SandboxUnavailable(
            f"bubblewrap could not start an isolated process (exit {result.returncode}): "
            f"{(result.stderr or result.stdout).strip()[:500]}. Unprivileged user namespaces may be "
            "disabled (sysctl kernel.unprivileged_userns_clone, user.max_user_namespaces, or an AppArmor "
            "policy such as Ubuntu's kernel.apparmor_restrict_unprivileged_userns); as root, the sandbox "
            f"runs as uid {NOBODY}, which must be able to read the sandbox's Python")
