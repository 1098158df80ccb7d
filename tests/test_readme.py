"""Every fenced code block of README.md and docs/*.md runs as written, against demo-sized artifacts.

The ```python, ```bash / ```sh and ```console blocks of README.md, then of the docs pages in
``DOC_ORDER`` (and any other docs/*.md after them), are extracted in order and run in one scratch
directory (never the checkout) that a session fixture fills with what ``make demo`` leaves behind
-- ``runs/demo/model`` (a tiny model trained for a few steps) and ``runs/demo/int8`` (its int8
weight-only compression) -- plus the input files the commands name (``notes.txt``, ``tokens.bin``,
``./Qwen-dir``, a GGUF file, ``my.yaml``, ``run.toml``, and ``my_models.py`` as README shows it). Blocks run in that order and see each
other's outputs, as a reader's shell would (docs/serving.md serves the chat model that
docs/interop.md converts).

How a block runs:
- ``python``: the whole block in a fresh interpreter (``python -c``), cwd the scratch dir.
- ``bash`` / ``sh``: one command per line (``\\`` continues a line, ``#`` starts a comment).
  ``prunus VERB ...`` runs in this process through click's test runner (the same entry point
  as the ``prunus`` script, without paying torch's import once per line); ``> FILE`` writes its
  output to FILE. ``prunus serve ...`` starts the real server in the background (the docs
  say the curl lines come "from another shell") and waits for ``/health``; ``curl`` lines run
  as processes against it; the server stops at the end of the block.
- ``console``: ``$ `` lines are commands as above; the lines after one are its expected output.

The only liberties taken are sizes (``VALUES``, ``DEFAULTS``, ``PYTHON_SIZES`` below) and the port
(``PORT`` becomes a free one); every value replaced is checked to still occur in the docs, so the
mapping cannot go stale silently. The Makefile's own blocks are not run (see their marker).
A block that cannot run here (a GPU, many processes or hosts, a long run) is preceded in its
file by ``<!-- not-run: REASON -->``; the reason may not be empty.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from prunus.cli.main import cli

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# the docs pages in reading order: a later page may use what an earlier one wrote (runs/onnx-int8, models/smollm2)
DOC_ORDER = ("training", "compression", "export", "interop", "serving", "native", "results")
RUNNABLE = {"python", "bash", "sh", "console"}
NOT_RUN = re.compile(r"<!--\s*not-run:(.*?)-->")
FENCE = re.compile(r"^```([\w-]*)\s*$")

# --- the size mapping: the docs' sizes -> demo sizes (only sizes; every key must occur in the docs) ---
# Flag values replaced, per verb ...
VALUES = {"train": {"--preset": {"small": "tiny"}, "--steps": {"1000": "6", "5000": "4", "200": "3"},
                   "--stop-at": {"400": "3"}}}
# ... and sizes added where the command leaves them to their defaults (train: only a command that
# starts a run, not --resume, --dry-run or --print-slurm):
# (verb, a flag the command must hold, or None) -> sizes
DEFAULTS = {("train", None): {"--preset": "tiny", "--steps": "6", "--seq-len": "32", "--batch-size": "4",
                              "--warmup-steps": "1", "--eval-every": "3", "--eval-tokens": "1024",
                              "--max-corpus-bytes": "100000", "--ckpt-every": "0"},
            ("generate", None): {"--max-new-tokens": "16"},  # the tiny preset's context is 128 tokens
            ("compress", "--distill"): {"--distill-steps": "4", "--distill-batch-size": "2"},
            # a generic module's run (--model) takes none of the transformer's sizes above
            ("train", "--model"): {"--batch-size": "8", "--warmup-steps": "1", "--eval-every": "3", "--ckpt-every": "0"}}
# Python blocks: exact text -> text.
PYTHON_SIZES = {'preset="small", steps=300': 'preset="tiny", steps=4, seq_len=32, batch_size=4, warmup_steps=1, '
                                             'eval_every=2, eval_tokens=1024, max_corpus_bytes=100_000'}
# the docs' example port -> a free one (set per session).
PORT = "8000"
README_LINES = 200  # README.md's line budget: the overview and the tour; detail lives in docs/


def doc_files() -> list[Path]:
    """README.md, the pages of DOC_ORDER, then any other docs page: the order their blocks run in."""
    pages = [ROOT / "docs" / f"{name}.md" for name in DOC_ORDER]
    others = sorted(p for p in (ROOT / "docs").glob("*.md") if p not in pages)
    return [README, *[p for p in pages if p.exists()], *others]


@dataclass
class Block:
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    not_run: str | None  # the reason given in a not-run marker, or None
    file: str = "README.md"  # relative to the repository root

    @property
    def id(self) -> str:
        return f"{self.file}:L{self.line}-{self.lang}"

    @property
    def where(self) -> str:
        return f"{self.file} line {self.line}"


def readme_blocks(text: str | None = None, file: str = "README.md") -> list[Block]:
    """Every fenced block of a markdown text (README.md by default), with the not-run marker on the nearest
    non-blank line above it."""
    lines = (README.read_text() if text is None else text).splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        above = next((lines[k] for k in range(i - 1, -1, -1) if lines[k].strip()), "")
        marker = NOT_RUN.search(above)
        blocks.append(Block(i + 1, m.group(1), "\n".join(lines[i + 1:end]), marker and marker.group(1).strip(), file))
        i = end + 1
    return blocks


def all_blocks() -> list[Block]:
    """The blocks of README.md and every docs page, in the order they run."""
    return [b for path in doc_files() for b in readme_blocks(path.read_text(), str(path.relative_to(ROOT)))]


def all_text() -> str:
    return "\n".join(path.read_text() for path in doc_files())


BLOCKS = [b for b in all_blocks() if b.lang in RUNNABLE]


def shell_lines(code: str) -> list[str]:
    """Commands of a shell block: continuations joined, comments and blank lines dropped."""
    out, cur = [], ""
    for raw in code.splitlines():
        if raw.rstrip().endswith("\\"):
            cur += raw.rstrip()[:-1] + " "
            continue
        cur += raw
        words = shlex.split(cur, comments=True)
        cur = ""
        if words:
            out.append(words)
    return out


def sized(args: list[str]) -> list[str]:
    """A `prunus VERB ...` argument list with the docs' sizes replaced by the demo sizes above."""
    args, verb = list(args), args[0] if args else ""
    for i, a in enumerate(args[:-1]):
        args[i + 1] = VALUES.get(verb, {}).get(a, {}).get(args[i + 1], args[i + 1])
    if verb == "train" and {"--resume", "--dry-run", "--print-slurm"} & set(args):
        return args
    for (v, needs), sizes in DEFAULTS.items():
        if v != verb or (needs and needs not in args) or (verb == "train" and not needs and "--model" in args):
            continue
        for flag, value in sizes.items():
            if flag not in args and not (verb == "train" and flag == "--preset" and "--config" in args):
                args += [flag, value]
    return args


# --- the workspace: what `make demo` leaves, and the inputs the docs' commands name -------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def workspace(tmp_path_factory):
    from prunus.models.gguf_write import to_gguf
    from prunus.models.hf_convert import to_hf
    from prunus.train_parallel import TrainConfig, train
    from test_gguf import make_model_dir  # a tiny model with a ChatML BPE tokenizer

    root = tmp_path_factory.mktemp("readme")
    demo = root / "runs" / "demo"
    train(TrainConfig(out=str(demo), preset="tiny", steps=6, seq_len=32, batch_size=4, warmup_steps=1, eval_every=3,
                      eval_tokens=1024, ckpt_every=0, max_corpus_bytes=100_000, progress=False))
    r = CliRunner().invoke(cli, ["compress", str(demo / "model"), "--recipe", "int8-weight-only", "--out",
                                 str(demo / "int8"), "--no-latency"])
    assert r.exit_code == 0, r.output
    (root / "notes.txt").write_text("Notes to train on: plain text, any length.\n" * 3000)
    np.frombuffer(("def f(x):\n    return x\n" * 4000).encode(), dtype=np.uint8).astype(np.uint16).tofile(
        root / "tokens.bin")
    to_hf(demo / "model", root / "Qwen-dir")
    to_gguf(make_model_dir(root / "gguf-src" / "model", n_layers=1), root / "smollm2-135m-instruct.gguf")
    (root / "my.yaml").write_text("passes:\n  - quantize: {scheme: int8-weight-only}\n")
    (root / "run.toml").write_text('preset = "tiny"\nseq_len = 32\nbatch_size = 4\n')
    for block in all_blocks():  # the factory file the README shows ("# my_models.py" on its first line)
        if block.lang == "python" and block.code.startswith("# my_models.py"):
            (root / "my_models.py").write_text(block.code)
    return root


@pytest.fixture(scope="session")
def port():
    return str(_free_port())


# --- running commands --------------------------------------------------------------------------------


def run_prunus(words: list[str], cwd: Path) -> tuple[int, str]:
    """`prunus ...` in this process (cwd = the workspace); returns (exit code, stdout + stderr)."""
    args, redirect = list(words[1:]), None
    if ">" in args:
        k = args.index(">")
        args, redirect = args[:k], args[k + 1]
    args = sized(args)
    old = os.getcwd()
    os.chdir(cwd)
    try:
        r = CliRunner().invoke(cli, args)
    finally:
        os.chdir(old)
    if redirect:
        (cwd / redirect).write_text(r.stdout)
    return r.exit_code, r.output


class Server:
    """`prunus serve ...` in the background until the block ends."""

    def __init__(self, words: list[str], cwd: Path, port: str):
        exe = Path(sys.executable).with_name("prunus")
        self.proc = subprocess.Popen([str(exe), *words[1:]], cwd=cwd, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"{shlex.join(words)} exited: {self.proc.stdout.read().decode()}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).read()
                return
            except OSError:
                time.sleep(0.3)
        self.stop()
        raise AssertionError(f"{shlex.join(words)}: no /health within 120 s")

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def run_curl(words: list[str], cwd: Path) -> None:
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed on this machine")
    r = subprocess.run(words, cwd=cwd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"{shlex.join(words)}: {r.stderr}"
    assert r.stdout.strip() and '"error"' not in r.stdout, f"{shlex.join(words)}: {r.stdout[:500]}"


def run_shell_block(block: Block, cwd: Path, port: str) -> None:
    servers = []
    try:
        for words in shell_lines(block.code.replace(PORT, port)):
            cmd = shlex.join(words)
            if words[0] == "prunus" and words[1:2] == ["serve"] and "--print-k8s" not in words:  # a server
                assert not servers, f"{block.where}: `{cmd}`: one server per block (both would take port {PORT})"
                servers.append(Server(words, cwd, port))
            elif words[0] == "prunus":
                code, output = run_prunus(words, cwd)
                assert code == 0, f"{block.where}: `{cmd}` exited {code}:\n{output}"
            elif words[0] == "curl":
                run_curl(words, cwd)
            else:
                raise AssertionError(f"{block.where}: `{cmd}`: the test knows prunus and curl only; mark the block "
                                     "not-run with a reason, or teach this test the command")
    finally:
        for s in servers:
            s.stop()


def run_console_block(block: Block, cwd: Path) -> None:
    lines = block.code.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("$ ")]
    assert starts, "a console block shows at least one `$ ` command"
    for n, i in enumerate(starts):
        words = shlex.split(lines[i][2:], comments=True)
        expected = "\n".join(lines[i + 1:(starts[n + 1] if n + 1 < len(starts) else len(lines))]).strip()
        assert words[0] == "prunus", lines[i]
        _, output = run_prunus(words, cwd)
        assert output.strip() == expected, f"`{lines[i][2:]}` printed:\n{output}\n{block.where} shows:\n{expected}"


def run_python_block(block: Block, cwd: Path) -> None:
    code = block.code
    for old, new in PYTHON_SIZES.items():
        code = code.replace(old, new)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, f"python block at {block.where} failed:\n{r.stdout}\n{r.stderr}"
    assert r.stdout.strip(), "the block printed nothing"


# --- the tests -----------------------------------------------------------------------------------------


def test_every_skipped_block_gives_a_reason():
    blocks = all_blocks()
    assert [b for b in blocks if b.file == "README.md" and b.lang in RUNNABLE and b.not_run is None], "no README block runs"
    for b in blocks:
        if b.not_run is not None:
            assert b.not_run, f"{b.where}: a not-run marker needs a reason"
            assert b.lang in RUNNABLE, f"{b.where}: a not-run marker on a block that never runs"


def test_the_size_mapping_matches_the_docs():
    """Every size the test replaces still occurs in README.md or a docs page, so the mapping cannot rot silently."""
    text = all_text()
    for old in PYTHON_SIZES:
        assert old in text, old
    commands = [w[1:] for b in BLOCKS if b.lang in ("bash", "sh") for w in shell_lines(b.code) if w[0] == "prunus"]
    for verb, flags in VALUES.items():
        for flag, values in flags.items():
            for value in values:
                assert any(w[0] == verb and flag in w and w[w.index(flag) + 1] == value for w in commands), (flag, value)
    assert f"localhost:{PORT}" in text


def test_the_docs_hang_together():
    """README stays short; every docs page is linked from it; relative links and images point at files that exist;
    every picture in docs/ is shown somewhere."""
    readme = README.read_text()
    assert len(readme.splitlines()) <= README_LINES, f"README.md is over its budget of {README_LINES} lines: move " \
        "detail into a docs page and link it"
    shown = set()
    for path in doc_files():
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)\s]*)?\)", path.read_text()):
            if "://" in target:
                continue
            assert (path.parent / target).exists(), f"{path.relative_to(ROOT)}: link to {target}, which does not exist"
            shown.add((path.parent / target).resolve())
    for page in (ROOT / "docs").glob("*.md"):
        assert f"](docs/{page.name})" in readme, f"README.md does not link {page.relative_to(ROOT)}"
    for picture in (ROOT / "docs").glob("*.png"):
        assert picture.resolve() in shown, f"{picture.relative_to(ROOT)} is shown by no page"


def test_marker_parsing():
    text = "a\n\n<!-- not-run: needs a GPU -->\n```bash\nx\n```\n<!-- not-run: -->\n\n```python\ny\n```\n```\nz\n```\n"
    got = [(b.lang, b.code, b.not_run) for b in readme_blocks(text)]
    assert got == [("bash", "x", "needs a GPU"), ("python", "y", ""), ("", "z", None)]
    assert shell_lines("prunus a \\\n  --b 1  # note\n\n# only a comment\ncurl -d '{\"x\": 1}' u") == [
        ["prunus", "a", "--b", "1"], ["curl", "-d", '{"x": 1}', "u"]]
    assert sized(["train", "--preset", "small", "--steps", "1000", "--out", "x"])[:7] == [
        "train", "--preset", "tiny", "--steps", "6", "--out", "x"]
    assert sized(["train", "--resume", "--out", "x"]) == ["train", "--resume", "--out", "x"]
    assert sized(["generate", "m", "--prompt", "a"])[-2:] == ["--max-new-tokens", "16"]
    module_run = sized(["train", "--model", "m:f", "--steps", "200", "--out", "x"])  # none of the transformer's sizes
    assert module_run[:5] == ["train", "--model", "m:f", "--steps", "3"] and "--preset" not in module_run


def test_the_recipe_shown_is_the_shipped_file():
    """A ```yaml block headed by a recipe's path shows that shipped recipe's passes."""
    yaml = pytest.importorskip("yaml")
    shown = [b for b in all_blocks() if b.lang == "yaml" and b.code.startswith("# compress/recipes/")]
    assert shown
    for b in shown:
        name = b.code.splitlines()[0][2:].strip()
        assert yaml.safe_load(b.code)["passes"] == yaml.safe_load((ROOT / name).read_text())["passes"], name


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.not_run is None], ids=lambda b: b.id)
def test_readme_block_runs(block, workspace, port):
    if block.lang == "python":
        run_python_block(block, workspace)
    elif block.lang == "console":
        run_console_block(block, workspace)
    else:
        run_shell_block(block, workspace, port)
