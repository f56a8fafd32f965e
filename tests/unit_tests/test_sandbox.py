"""The escape suite (CPU, run in CI with real isolation: bubblewrap, installed by the fixture where
missing). Each program tries one way out; inside the sandbox the way is closed and the run goes
on, and the same program run outside the sandbox (`run_outside`, this user's plain child) does
get out, so no test passes because its program is broken."""

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid

import pytest

from megatron_rl_bi.envs import sandbox
from megatron_rl_bi.envs.code import code_environment, run_python

from .. import REPO
from ..sandbox_fixtures import run_outside, sandbox_python


@pytest.fixture(scope="module")
def python():
    return sandbox_python()


def config(python, **limits) -> sandbox.SandboxConfig:
    return sandbox.SandboxConfig(python=python, **{"seconds": 5.0, "memory_mb": 512, **limits})


def inside(python, program: str, **limits) -> str:
    return run_python(program, config(python, **limits))


@pytest.fixture
def marker(tmp_path):
    """A host path no program should be able to create."""
    return str(tmp_path / f"escaped-{uuid.uuid4().hex}")


def host_processes():
    """(pid, parent pid, arguments) of every host process still readable."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                arguments = f.read().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        yield int(pid), parent, arguments


def processes_with(tag: str) -> list[int]:
    """Host processes that have `tag` as one of their arguments: a program that exec'd a command
    carrying it. Not a process whose argument merely contains it, such as a host given the
    program's text, or that host's fork in the moment before it execs another command."""
    return [pid for pid, _, arguments in host_processes() if tag.encode() in arguments]


def descendants(pid: int) -> list[str]:
    """`pid`'s living descendants, each as its id and the start of its command line."""
    children = {}
    for child, parent, arguments in host_processes():
        command = " ".join(b" ".join(arguments).decode(errors="replace").split())
        children.setdefault(parent, []).append((child, command[:80]))
    found, waiting = [], [pid]
    while waiting:
        for child, command in children.get(waiting.pop(), []):
            found.append(f"{child}: {command}")
            waiting.append(child)
    return found


def test_a_process_is_found_by_its_tag_argument_not_by_a_text_holding_the_tag():
    """The kill test's host holds the program's text, tag and all, and so does its fork in the
    moment before that execs the program: a match inside an argument ended that test's wait for
    the program early (CI, then twice in ten runs here), before the program itself had started."""
    tag = uuid.uuid4().hex
    holding = subprocess.Popen([sys.executable, "-c", f"import time; time.sleep(30)  # {tag}"])
    tagged = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", tag])
    try:
        deadline = time.monotonic() + 30
        while not processes_with(tag) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert processes_with(tag) == [tagged.pid]
    finally:
        for process in (holding, tagged):
            process.kill()
            process.wait()


FORK_EXEC = """
import _posixsubprocess, os
errpipe_read, errpipe_write = os.pipe()
# subprocess's own call (Python 3.11-3.12), without the audit event subprocess raises
pid = _posixsubprocess.fork_exec([b"/bin/sh", b"-c", b"id; head -1 /etc/passwd; touch {marker}"], [b"/bin/sh"],
                                 True, (errpipe_write,), None, None, -1, -1, -1, -1, -1, -1, errpipe_read,
                                 errpipe_write, True, False, -1, None, None, None, -1, None, False)
os.close(errpipe_write)
# the child writes its error in pieces ("OSError:", the errno, ...): read to the pipe's end, as subprocess does
error = b"".join(iter(lambda: os.read(errpipe_read, 200), b""))
print("exec error:", error or None)
print("status", os.waitpid(pid, 0)[1])
"""


def test_fork_exec_of_a_shell(python, marker):
    assert "uid=" in run_outside(FORK_EXEC.format(marker=marker), python) and os.path.exists(marker)
    os.remove(marker)
    output = inside(python, FORK_EXEC.format(marker=marker))
    assert "exec error: b'OSError:2:" in output and "uid=" not in output and not os.path.exists(marker)


@pytest.mark.parametrize("program", [
    "import os\nprint(os.system('touch {marker}'))",
    "import subprocess\nsubprocess.run(['touch', '{marker}'])",
    "import os\nif os.fork() == 0:\n    os.execv('/bin/sh', ['sh', '-c', 'touch {marker}'])\nos.wait()",
    "import os\nif os.fork() == 0:\n    open('{marker}', 'w').write('from a child')\n    os._exit(0)\nos.wait()",
    "import ctypes\nprint(ctypes.CDLL(None).system(b'touch {marker}'))",
], ids=["os.system", "subprocess", "fork+exec", "fork+write", "ctypes-system"])
def test_processes_cannot_reach_the_host(python, marker, program):
    run_outside(program.format(marker=marker), python)
    assert os.path.exists(marker)
    os.remove(marker)
    inside(python, program.format(marker=marker))
    assert not os.path.exists(marker)


CONNECT = """
import socket
try:
    with socket.socket(socket.{family}, socket.SOCK_STREAM) as s:
        s.settimeout(2)
        s.connect({address!r})
        s.sendall(b"escaped")
    print("connected")
except OSError as exc:
    print("refused:", type(exc).__name__)
"""


@pytest.mark.parametrize("family", ["AF_INET", "AF_UNIX"], ids=["tcp-127.0.0.1", "abstract-unix"])
def test_no_connection_to_a_host_listener(python, family):
    with socket.socket(getattr(socket, family), socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0) if family == "AF_INET" else f"\0rl-sandbox-{uuid.uuid4().hex}")
        listener.listen(4)
        program = CONNECT.format(family=family, address=listener.getsockname())
        assert run_outside(program, python).strip() == "connected"
        listener.accept()[0].close()
        assert inside(python, program).startswith("refused:")
        listener.settimeout(0.5)
        with pytest.raises(TimeoutError):
            listener.accept()


def test_no_name_lookup_or_route_out(python):
    program = ("import socket\ntry:\n    socket.create_connection(('192.0.2.1', 80), timeout=2)\n"
               "except OSError as exc:\n    print(type(exc).__name__, exc.errno)")
    assert inside(python, program).startswith("OSError 101")  # ENETUNREACH: no route at all


def test_host_files_are_absent(python, tmp_path):
    secret = tmp_path / "secret.txt"
    token = uuid.uuid4().hex
    secret.write_text(token)
    program = (f"for path in ({str(secret)!r}, '/etc/passwd', '/etc/hostname'):\n"
               "    try:\n        print(open(path).read()[:40])\n"
               "    except OSError as exc:\n        print(type(exc).__name__)")
    outside = run_outside(program, python)
    assert token in outside and "root:" in outside
    assert inside(python, program) == "FileNotFoundError\n" * 3


def test_only_the_working_directory_is_writable(python, tmp_path):
    target = tmp_path / "written.txt"
    program = (f"import os\nfor path in ({str(target)!r}, '/usr/lib/written.txt', '/written.txt', 'here.txt'):\n"
               "    try:\n        open(path, 'w').write('x')\n        print('wrote', os.path.basename(path))\n"
               "    except OSError as exc:\n        print(type(exc).__name__, exc.errno)")
    assert run_outside(program, python).startswith("wrote written.txt\n")
    target.unlink()
    # ENOENT: the host's directory is not there; EROFS: read-only mounts
    assert inside(python, program) == "FileNotFoundError 2\nOSError 30\nOSError 30\nwrote here.txt\n"
    assert not target.exists()


def test_the_filesystem_holds_libraries_and_python_only(python):
    top, usr, devices = eval(inside(python, "import os\nprint([sorted(os.listdir(d)) for d in ('/', '/usr', '/dev')])"))
    # the interpreter's own top directory (/root for a pyenv under it, /usr for the system's)
    assert set(top) <= {"dev", "proc", "work", "usr", "lib", "lib32", "lib64", "libx32", python.split(os.sep)[1]}
    assert set(usr) <= {"lib", "lib32", "lib64", "bin"}
    if "bin" in usr:  # the system's Python: its executable alone
        assert inside(python, "import os\nprint(os.listdir('/usr/bin'))").strip() == repr([os.path.basename(python)])
    assert not any(d.startswith(("nvidia", "sd", "nvme", "kvm", "mem")) for d in devices)


def test_the_callers_environment_is_not_passed(python, monkeypatch):
    token = uuid.uuid4().hex
    monkeypatch.setenv("RL_SANDBOX_SECRET", token)
    program = "import os\nprint(os.environ.get('RL_SANDBOX_SECRET'), os.getuid())"
    assert run_outside(program, python).split()[0] == token
    assert inside(python, program).split() == ["None", str(sandbox.NOBODY)]


def test_other_processes_cannot_be_signalled(python):
    target = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    program = (f"import os, signal\nfor pid, sig in (({target.pid}, signal.SIGKILL), ({os.getpid()}, 0)):\n"
               "    try:\n        os.kill(pid, sig)\n        print('sent')\n"
               "    except OSError as exc:\n        print(type(exc).__name__)\nprint(os.getppid())")
    try:
        # the host's pids do not exist in its namespace; its parent is the keeper, the second
        # process there after bubblewrap's init
        assert inside(python, program).split() == ["ProcessLookupError", "ProcessLookupError", "2"]
        time.sleep(0.2)
        assert target.poll() is None
        assert run_outside(program, python).split()[:2] == ["sent", "sent"]
        assert target.wait(timeout=5) == -signal.SIGKILL
    finally:
        target.kill()
        target.wait()


FORKS = """
import os, time
count = 0
try:
    for _ in range(200):
        if os.fork() == 0:
            time.sleep(5)
            os._exit(0)
        count += 1
except OSError as exc:
    print(type(exc).__name__)
print(count)
"""


def test_process_count_is_bounded(python):
    assert run_outside(FORKS, python, seconds=10).split()[-1] == "200"
    output = inside(python, FORKS, processes=16).split()
    assert output[0] == "BlockingIOError" and int(output[1]) < 16


def test_a_fork_bomb_ends_at_the_time_limit_and_leaves_nothing(python):
    tag = uuid.uuid4().hex
    program = f"import os\n# {tag}\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    started = time.monotonic()
    assert inside(python, program, seconds=2).endswith("(killed after 2 s)")
    assert time.monotonic() - started < 6
    assert sandbox.run(config(python), [python, "-c", "print('next')"], {}).stdout == "next\n"


def test_a_memory_bomb_fails(python):
    program = "x = bytearray(1 << 30)\nprint(len(x) >> 30, 'GiB')"
    assert run_outside(program, python).strip() == "1 GiB"
    assert "MemoryError" in inside(python, program, memory_mb=256)


def test_output_is_bounded(python):
    program = ("import sys\nfor _ in range(64):\n    sys.stdout.write('x' * (1 << 20))\nsys.stdout.flush()\n"
               "try:\n    open('big', 'wb').write(b'x' * (32 << 20))\nexcept OSError as exc:\n"
               "    print(exc.strerror, file=sys.stderr)\nprint('all 64 MiB written', file=sys.stderr)")
    assert run_outside(program, python).endswith("x" * 100 + "all 64 MiB written\n")
    result = sandbox.run(config(python), [python, "-I", "main.py"], {"main.py": program})
    assert set(result.stdout) == {"x"} and len(result.stdout) == 8192  # read back: output_bytes
    assert result.stderr == "File too large\nall 64 MiB written\n"  # RLIMIT_FSIZE: a file of 16 MiB


def test_the_working_directory_is_bounded(python):
    program = "f = open('big', 'wb')\ntry:\n    for _ in range(200):\n        f.write(b'x' * (1 << 20))\nexcept OSError as exc:\n    print(exc.errno)"
    assert inside(python, program, disk_mb=8, file_mb=64).strip() == "28"  # ENOSPC


def test_no_child_outlives_the_program(python):
    """A daemon the program left is waited for, as any child, and killed at the limit."""
    tag = uuid.uuid4().hex
    program = (f"import os, sys\nif os.fork() == 0:\n    os.setsid()\n"
               f"    os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(30)', {tag!r}])\n"
               "print('parent exits')")
    try:
        run_outside(program, python, seconds=1)
        time.sleep(0.3)
        assert processes_with(tag)  # outside, the daemonized child lives on
    finally:
        for pid in processes_with(tag):
            os.kill(pid, signal.SIGKILL)
    assert inside(python, program, seconds=1) == "parent exits\n\n(killed after 1 s)"
    time.sleep(0.3)
    assert processes_with(tag) == []


def test_a_programs_children_finish_before_its_output_is_taken(python):
    """What a program's children write after it exits is part of its output, every time: were
    they killed at its exit, the output would depend on whether they had run by then."""
    program = ("import os, sys, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(0.3)\n"
               "    print('child', flush=True)\n    sys.exit()\nprint('parent', flush=True)")
    assert inside(python, program) == "parent\nchild\n"


def test_the_limit_counts_from_the_programs_start_not_the_sandboxs(python, slow_bubblewrap):
    """A loaded host's sandbox start-up (here 4 s, past the 3 s limit) kills no program."""
    started = time.monotonic()
    assert inside(python, "print('ran')", seconds=3) == "ran\n"
    assert time.monotonic() - started > 4


def test_a_program_past_its_time_limit_is_killed_with_its_children(python):
    tag = uuid.uuid4().hex
    program = (f"import os, signal, sys, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
               f"if os.fork() == 0:\n    os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(30)', {tag!r}])\n"
               "time.sleep(3)\nprint('done')")
    assert run_outside(program, python).strip() == "done"
    for pid in processes_with(tag):
        os.kill(pid, signal.SIGKILL)
    started = time.monotonic()
    assert inside(python, program, seconds=1) == "\n(killed after 1 s)"
    assert time.monotonic() - started < 3
    time.sleep(0.3)
    assert processes_with(tag) == []


def test_a_program_that_kills_its_keeper_ends_there(python):
    program = "import os, signal\nprint('before', flush=True)\nos.kill(os.getppid(), signal.SIGKILL)\nprint('after')"
    assert inside(python, program) == "\n(killed by signal 9: a limit)"
    assert inside(python, "print('next')") == "next\n"


def test_a_program_that_stops_its_keeper_is_killed_at_the_hosts_bound(python, monkeypatch):
    monkeypatch.setattr(sandbox, "KEEPER_START_SECONDS", 1.0)
    started, outputs = time.monotonic(), []
    program = "import os, signal, time\nos.kill(os.getppid(), signal.SIGSTOP)\ntime.sleep(30)"
    # in a thread of its own: without the host's bound the call never returns, and the test fails
    # instead of hanging the run
    runner = threading.Thread(target=lambda: outputs.append(inside(python, program, seconds=2)), daemon=True)
    runner.start()
    runner.join(60)
    assert outputs == ["\n(killed after 2 s)"]
    assert 2 < time.monotonic() - started < 7


def test_the_limits_hold_inside(python):
    program = ("import resource\nprint([resource.getrlimit(getattr(resource, 'RLIMIT_' + name)) for name in "
               "('CPU', 'AS', 'FSIZE', 'NOFILE', 'NPROC', 'CORE')])")
    limits = eval(inside(python, program, seconds=2.5, memory_mb=300, file_mb=5, open_files=40, processes=7))
    assert limits == [(3, 3), (300 << 20, 300 << 20), (5 << 20, 5 << 20), (40, 40), (7, 7), (0, 0)]


@pytest.fixture
def fresh_check():
    """`sandbox.check` remembers a Python it has isolated: forget, before and after."""
    sandbox.check.cache_clear()
    yield
    sandbox.check.cache_clear()


def test_without_bubblewrap_the_code_environment_refuses_naming_the_opt_in(python, monkeypatch, fresh_check):
    monkeypatch.setattr(sandbox, "BUBBLEWRAP", "bwrap-not-installed")
    with pytest.raises(ValueError, match=r"--rl-env code: the sandbox cannot isolate programs here: bubblewrap "
                       r"\('bwrap-not-installed'\) is not on PATH; install bubblewrap.*--rl-code-without-isolation"):
        code_environment(config(python))


def test_a_python_the_sandbox_cannot_run_is_refused(tmp_path, fresh_check):
    with pytest.raises(ValueError, match="--rl-code-python PATH"):
        code_environment(sandbox.SandboxConfig(python=str(tmp_path / "python3")))


def test_the_unisolated_mode_says_so_and_is_not_isolated(python, tmp_path, capsys):
    environment = code_environment(config(python, isolated=False))
    assert "WITHOUT ISOLATION" in capsys.readouterr().err
    secret = tmp_path / "secret.txt"
    secret.write_text("visible")
    assert run_python(f"print(open({str(secret)!r}).read())", environment.sandbox_config) == "visible\n"
    assert "(killed after 1 s)" in run_python("import time\ntime.sleep(5)", config(python, isolated=False, seconds=1))
    # its bound kills the program's process group: a child still in it goes too
    tag = uuid.uuid4().hex
    program = (f"import os, sys, time\nif os.fork() == 0:\n"
               f"    os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(30)', {tag!r}])\n"
               "time.sleep(30)")
    assert "(killed after 1 s)" in run_python(program, config(python, isolated=False, seconds=1))
    time.sleep(0.3)
    assert processes_with(tag) == []


def test_the_unisolated_mode_bounds_output_to_output_bytes(python):
    program = "import sys\nsys.stdout.write('x' * (1 << 20))\nsys.stderr.write('y' * (1 << 20))"
    result = sandbox.run(config(python, isolated=False, output_bytes=100), [python, "-I", "main.py"],
                         {"main.py": program})
    assert (result.stdout, result.stderr, result.returncode) == ("x" * 100, "y" * 100, 0)


def test_the_unisolated_mode_does_not_pass_the_callers_environment(python, monkeypatch):
    token = uuid.uuid4().hex
    monkeypatch.setenv("RL_SANDBOX_SECRET", token)
    program = "import os\nprint(os.environ.get('RL_SANDBOX_SECRET'))"
    assert run_outside(program, python).strip() == token
    assert run_python(program, config(python, isolated=False)) == "None\n"


def test_only_regular_files_are_sent_back(python):
    """A link is not followed (it could name a file of the sandbox's own, or nothing), nor a FIFO
    opened (its open would wait for a writer until the host's bound)."""
    command = ["/bin/sh", "-c", "echo kept > a; ln -s a link; ln -s /usr/lib libraries; mkfifo pipe; mkdir -p d/e"]
    started = time.monotonic()
    result, kept = sandbox.run_keeping_files(config(python, shell=True), command, {})
    assert result.returncode == 0 and time.monotonic() - started < 5
    assert {path: file.data for path, file in kept.items()} == {"a": b"kept\n"}


def test_the_program_runs_in_a_session_of_its_own(python):
    """bubblewrap's --new-session: the program's session leader is inside the sandbox (its id 0
    there would be the host's session, whose terminal a TIOCSTI ioctl could type into)."""
    assert inside(python, "import os\nprint(os.getsid(0) > 0)") == "True\n"


HOST = """
import sys
from megatron_rl_bi.envs import sandbox
from megatron_rl_bi.envs.code import run_python
from tests.sandbox_fixtures import run_outside
program, python, how = sys.argv[1:4]
print("started", flush=True)
if how == "inside":
    run_python(program, sandbox.SandboxConfig(python=python, seconds=30.0))
else:
    run_outside(program, python, seconds=30.0)
"""


def _killed_host_leaves(python: str, how: str, scratch: str) -> list[int]:
    """The processes of a program still alive 1 s after the process that ran it (`how`: inside the
    sandbox, or as its plain child) was killed; the killed process's temporary files are left in
    `scratch`."""
    tag = uuid.uuid4().hex
    program = f"import os, sys\nos.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(30)', {tag!r}])"
    host = subprocess.Popen([sys.executable, "-c", HOST, program, python, how], cwd=REPO, stdout=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": scratch})
    try:
        assert host.stdout.readline() == b"started\n"
        deadline = time.monotonic() + sandbox.KEEPER_START_SECONDS  # the sandbox's own bound on its start
        while not processes_with(tag) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert processes_with(tag), f"the program never started; the host's processes: {descendants(host.pid)}"
    finally:
        host.kill()
        host.wait()
    time.sleep(1.0)
    left = processes_with(tag)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return left


def test_the_sandbox_dies_with_the_process_that_ran_it(python, tmp_path):
    """A trainer killed mid-turn (the OOM killer, a job's time limit) leaves no program running:
    bubblewrap's --die-with-parent; a plain child of the killed process lives on."""
    assert _killed_host_leaves(python, "outside", str(tmp_path))
    assert _killed_host_leaves(python, "inside", str(tmp_path)) == []
