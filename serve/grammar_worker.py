"""A grammar compile in a process of its own, so that one that runs too long can be stopped.

xgrammar compiles in C++ with Python's lock released: a thread cannot be interrupted, and a compile left
running keeps a core busy after its client has gone. So every new grammar is first compiled in a process:

* :class:`CompileWorker`, in the serving process, starts one *host* (``python -m prunus.serve.grammar_worker``),
  sends it the tokenizer once (xgrammar's serialized ``TokenizerInfo``) and then one compile at a time;
* the host imports xgrammar and builds the tokenizer's tables once (seconds), then forks a child per compile
  (milliseconds: the tables are shared); the child answers whether the grammar compiles, and xgrammar's
  message when it does not;
* past the deadline, or when the serving process cancels (its client left), the host kills the child (SIGKILL;
  its own child, so no other process can be hit) and answers at once. A host that does not answer in time
  is killed in turn, and the pool starts another.

The deadline counts the child's CPU time (Linux's ``/proc/PID/stat``), not the clock's: whether a grammar
compiles in time is then the same answer on an idle machine and on a loaded one, where the niced child may get
a fraction of a core. A loaded machine's wait is bounded all the same: :data:`WALL_FACTOR` times the deadline on
the clock. Where ``/proc`` cannot be read the deadline is the clock's.

A grammar that compiled in time is then compiled again by the serving process (the same work, so the same
time). Its compiled form does not travel back: xgrammar 0.2.8's ``CompiledGrammar.serialize_json`` can take
hundreds of times the compile's time and memory (docs/defaults.md).

Hosts and children run at a lower CPU priority than the serving process and die with their parent (Linux's
parent-death signal; an idle host also leaves when its socket closes).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection, Pipe, wait

STARTUP_TIMEOUT_S = 180.0  # a new host's imports and tokenizer tables (not counted in the compile deadline)
HOST_GRACE_S = 5.0  # past the deadline, how long the host may take to answer before it is killed itself
NICE = 5  # the compile processes' CPU priority below the serving process's
POLL_S = 0.05  # how often a wait looks at its cancel flag
WALL_FACTOR = 4.0  # a compile's wait on the clock, in deadlines of CPU time (a child starved on a loaded machine)
_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01


class Stopped(Exception):
    """The compile did not finish: ``reason`` is ``"deadline"``, ``"cancelled"``, ``"startup"`` (the host did not
    start in :data:`STARTUP_TIMEOUT_S`) or ``"died"`` (``detail``: how)."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(reason, detail)
        self.reason, self.detail = reason, detail


class Refused(Exception):
    """xgrammar refused the grammar (its message, one line)."""


def build(xgr, compiler, what: str, text: str):
    """The compiled grammar of one constraint: ``what`` is json_schema, json_object, regex or tool_call."""
    if what == "regex":
        return compiler.compile_regex(text)
    if what == "tool_call":  # <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call> (prunus.serve.tool_calls)
        return compiler.compile_grammar(xgr.Grammar.concat(
            xgr.Grammar.from_regex(r"<tool_call>\n"), xgr.Grammar.from_json_schema(text, any_whitespace=False),
            xgr.Grammar.from_regex(r"\n</tool_call>")))
    # json_object: any JSON object (OpenAI's JSON mode); whitespace as json.dumps writes it
    return compiler.compile_json_schema(text if what == "json_schema" else '{"type": "object"}', any_whitespace=False)


class CompileWorker:
    """The serving process's side of one host (see the module docstring)."""

    def __init__(self, tokenizer_json: str, nice: int = NICE):
        ours, theirs = socket.socketpair()
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", __name__, str(theirs.fileno()), str(nice)],
                                         pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL, env=env)
        finally:
            theirs.close()
        self.conn = Connection(ours.detach())
        self._tokenizer_json, self._sent, self.ready = tokenizer_json, False, False
        self._lock = threading.Lock()

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None and not self.conn.closed

    def _next(self, timeout_s: float, cancelled: threading.Event | None):
        """The host's next message; None when ``cancelled`` is set first; Stopped("died") past ``timeout_s`` or
        when the host is gone (killed then)."""
        end = time.monotonic() + timeout_s
        while True:
            left = end - time.monotonic()
            if cancelled is not None and cancelled.is_set():
                return None
            try:
                if left > 0 and not self.conn.poll(min(left, POLL_S)):
                    continue
                if left > 0:
                    return self.conn.recv()
            except (EOFError, OSError):
                pass
            how = f"exit code {self.proc.poll()}" if self.proc.poll() is not None else "no answer"
            self.kill()
            raise Stopped("died", how)

    def _start(self, cancelled: threading.Event) -> None:
        if not self._sent:
            self.conn.send(self._tokenizer_json)
            self._sent = True
        try:
            answer = self._next(STARTUP_TIMEOUT_S, cancelled)
        except Stopped as e:
            raise Stopped("startup", e.detail) from None
        if answer is None:  # the host goes on starting, for the next compile
            raise Stopped("cancelled")
        self.ready = True

    def probe(self, what: str, text: str, timeout_s: float, cancelled: threading.Event) -> None:
        """Return once the grammar compiled in the child; :class:`Refused` with xgrammar's message; :class:`Stopped`
        when it passes ``timeout_s`` (the host's startup not counted), is cancelled, or a process dies."""
        with self._lock:
            try:
                if not self.ready:
                    self._start(cancelled)
                self.conn.send(("compile", what, text, timeout_s))
                answer = self._next(WALL_FACTOR * timeout_s + HOST_GRACE_S, cancelled)
                if answer is None:
                    self.conn.send(("cancel",))
                    self._next(HOST_GRACE_S, None)  # this compile's one answer, whatever it was
                    raise Stopped("cancelled")
            except (BrokenPipeError, ConnectionError, OSError):
                self.kill()
                raise Stopped("died", f"exit code {self.proc.poll()}") from None
        kind, payload = answer
        if kind == "ok":
            return
        if kind == "refused":
            raise Refused(payload)
        raise Stopped(kind, payload)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass
        self.conn.close()


# --- the host and its children ----------------------------------------------------------------------------

def _die_with_parent() -> None:
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: an idle host still leaves when its socket closes


def _child(out: Connection, xgr, compiler, what: str, text: str) -> None:
    """The forked child: compile, send the answer, leave (never back into the host's loop)."""
    try:
        _die_with_parent()
        try:
            build(xgr, compiler, what, text)
            answer = ("ok", "")
        except Exception as e:  # noqa: BLE001 - xgrammar's refusal, whatever its type, goes back as text
            answer = ("refused", " ".join(str(e).split())[:600])
        out.send(answer)
    finally:
        os._exit(0)


def cpu_seconds(pid: int) -> float | None:
    """CPU seconds process ``pid`` has used (user and system), or None where ``/proc`` cannot tell."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()  # after the command's name, which may hold spaces
        return (int(fields[11]) + int(fields[12])) * _TICK_S  # utime, stime: the stat's 14th and 15th fields
    except (OSError, IndexError, ValueError):
        return None


def _wait(conn: Connection, theirs: Connection, pid: int, timeout_s: float) -> tuple[str, str]:
    """The child's answer, or ("deadline", "") once it used ``timeout_s`` of CPU (or ``WALL_FACTOR`` times that
    on the clock), or ("cancelled", "") on the serving process's "cancel"."""
    start = time.monotonic()
    while True:
        ready = wait([theirs, conn], timeout=POLL_S)
        if theirs in ready:
            try:
                return theirs.recv()
            except EOFError:
                return ("died", "")
        if conn in ready and conn.recv()[0] == "cancel":  # EOFError: the serving process is gone, and this host
            return ("cancelled", "")
        waited, used = time.monotonic() - start, cpu_seconds(pid)
        if (waited if used is None else used) >= timeout_s or waited >= WALL_FACTOR * timeout_s:
            return ("deadline", "")


def _job(conn: Connection, xgr, compiler, what: str, text: str, timeout_s: float) -> tuple[str, str]:
    """One compile in a forked child, killed at the deadline or on the serving process's "cancel"."""
    theirs, ours = Pipe(duplex=False)
    pid = os.fork()
    if pid == 0:
        theirs.close()
        _child(ours, xgr, compiler, what, text)
    ours.close()
    try:
        answer = _wait(conn, theirs, pid, timeout_s)
    finally:
        try:
            os.kill(pid, signal.SIGKILL)  # not yet waited for: the pid is still this child's
        except ProcessLookupError:
            pass
        _, status = os.waitpid(pid, 0)
        theirs.close()
    if answer[0] == "died":
        answer = ("died", f"signal {-os.waitstatus_to_exitcode(status)}" if os.WIFSIGNALED(status) else
                  f"exit code {os.waitstatus_to_exitcode(status)}")
    return answer


def host(fd: int, nice: int) -> None:
    """Build the compiler from the tokenizer sent first, then run each compile in a child until the socket closes."""
    _die_with_parent()
    try:
        os.nice(nice)
    except (OSError, AttributeError):
        pass
    conn = Connection(fd)
    import xgrammar as xgr
    try:
        info = xgr.TokenizerInfo.deserialize_json(conn.recv())
        compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        compiler.compile_builtin_json_grammar()  # the tokenizer's tables, built once, before any fork
        conn.send(("ready", ""))
        while True:
            message = conn.recv()
            if message[0] == "compile":  # a "cancel" whose compile was already answered is dropped
                conn.send(_job(conn, xgr, compiler, *message[1:]))
    except (EOFError, OSError, KeyboardInterrupt):
        return


if __name__ == "__main__":
    host(int(sys.argv[1]), int(sys.argv[2]))
