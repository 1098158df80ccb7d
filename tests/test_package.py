"""prunus as an installed package: the wheel and the sdist carry every file the code reads at run time, and a wheel
installed into a fresh venv outside the checkout trains, exports, generates on the native kernels and serves.

The quick checks read pyproject.toml against the tree (every non-Python file of a package is package data); the slow
one builds with ``python -m build --no-isolation`` (no network) and runs the installed ``prunus`` command."""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import tarfile
import threading
import urllib.request
import zipfile
from pathlib import Path

import pytest

from prunus.artifacts.errors import PrunusError
from prunus.native import build as native_build

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
NOT_PACKAGE = {"tests", "benchmarks", "docs", "build", "dist", "runs"}


def package_dir(package: str) -> Path:
    """The checkout folder of ``package`` (pyproject's package-dir maps prunus to the repository root)."""
    return ROOT.joinpath(*package.split(".")[1:])


def tree_files() -> list[Path]:
    """The checkout's files outside tests/benchmarks/docs (git's view where it has one: no ignored build output)."""
    try:
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=ROOT,
                             capture_output=True, check=True, timeout=60).stdout.decode()
        files = [ROOT / p for p in out.split("\0") if p]
    except (OSError, subprocess.SubprocessError):
        files = [p for p in ROOT.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    return [p for p in files if p.is_file() and is_package_file(p.relative_to(ROOT).parts)]


def is_package_file(parts: tuple[str, ...]) -> bool:
    """Whether a checkout path (its parts) lies where the package's files do: the root's modules (the root's other
    files are the project's: README, Makefile), and the folders that are not tests, benchmarks, docs or hidden."""
    if len(parts) == 1:
        return parts[0].endswith(".py")
    return (parts[0] not in NOT_PACKAGE and not parts[0].endswith(".egg-info")
            and not any(p.startswith(".") or p == "__pycache__" for p in parts))


def owner(path: Path) -> str | None:
    """The deepest listed package whose folder holds ``path``."""
    found = [pkg for pkg in SETUPTOOLS["packages"] if path.is_relative_to(package_dir(pkg))]
    return max(found, key=len, default=None)


def expected_wheel_files() -> set[str]:
    """What the wheel must hold under prunus/: every module of every package and its package data; fails on a file
    no package ships."""
    data = SETUPTOOLS.get("package-data", {})
    want, unshipped = set(), []
    for path in tree_files():
        pkg = owner(path)
        rel = path.relative_to(package_dir(pkg)).as_posix() if pkg else None
        ships = pkg is not None and (path.suffix == ".py" and "/" not in rel
                                     or any(fnmatch.fnmatch(rel, g) for g in data.get(pkg, [])))
        if ships:
            want.add("prunus/" + path.relative_to(ROOT).as_posix())
        else:
            unshipped.append(path.relative_to(ROOT).as_posix())
    assert not unshipped, (f"files in the package's folders that no wheel would carry: {unshipped}; list their "
                           "package in pyproject.toml [tool.setuptools] packages, or their pattern in package-data")
    return want


def test_every_file_of_the_package_folders_is_shipped():
    """A new module folder or data file (a recipe, a kernel header, a template) without packages / package-data in
    pyproject.toml fails here, not in a user's install."""
    want = expected_wheel_files()
    for name in (native_build.SOURCE.name, *native_build.HEADERS):
        assert f"prunus/native/{name}" in want, name
    from prunus.compress.recipe import RECIPES_DIR

    recipes = sorted(RECIPES_DIR.glob("*.yaml"))
    assert recipes and all(f"prunus/{p.relative_to(ROOT).as_posix()}" in want for p in recipes)


def test_the_native_headers_are_the_ones_decode_c_includes():
    """build.py hashes (build key) exactly the local headers decode.c includes, so an edited one rebuilds."""
    includes = set(re.findall(r'^#include "([^"]+)"', native_build.SOURCE.read_text(), re.M))
    assert includes == set(native_build.HEADERS)


def test_a_missing_native_source_is_one_line_the_fallback_takes(tmp_path, monkeypatch):
    shutil.copy(native_build.SOURCE, tmp_path / native_build.SOURCE.name)  # decode.c without its headers
    monkeypatch.setattr(native_build, "SOURCE", tmp_path / native_build.SOURCE.name)
    monkeypatch.setattr(native_build, "cpu_supported", lambda: None)
    monkeypatch.setattr(native_build, "_compiler", lambda: ["cc"])
    native_build.library.cache_clear()
    try:
        with pytest.raises(PrunusError) as e:
            native_build.build_record(["cc"])
        why = native_build.unavailable()  # what native="auto" falls back on (runtime/native_choice.py)
    finally:
        native_build.library.cache_clear()
    line = str(e.value)
    assert "\n" not in line and native_build.HEADERS[0] in line and "reinstall prunus" in line, line
    assert why == line


# --- the wheel, installed outside the checkout ---------------------------------------------------------------


def build_dists(out: Path) -> tuple[Path, Path]:
    """(wheel, sdist) built from the checkout without network (the build backend from this environment)."""
    r = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(ROOT)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return next(out.glob("prunus-*.whl")), next(out.glob("prunus-*.tar.gz"))


def fresh_venv(where: Path, wheel: Path) -> Path:
    """A venv at ``where`` holding the wheel; its dependencies come from this environment's site-packages through
    a plain .pth line (which runs none of that folder's .pth files: the checkout's editable install stays out)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True, timeout=120)
    py = where / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    deps = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    Path(site, "prunus_test_deps.pth").write_text("".join(f"{d}\n" for d in deps))
    r = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--quiet", "--no-deps",
                        "--no-index", "--disable-pip-version-check", str(wheel)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return where / "bin"


def run(bin_: Path, args: list[str], cwd: Path, env: dict) -> str:
    """Run ``bin_/args[0]`` from ``cwd``; its stdout and stderr together, asserted to exit 0."""
    r = subprocess.run([str(bin_ / args[0]), *args[1:]], cwd=cwd, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, f"{' '.join(args)} exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r.stdout + r.stderr


def serve_once(bin_: Path, export: Path, cwd: Path, env: dict) -> tuple[str, dict]:
    """(the startup line, the answer to one completion) from ``prunus serve`` on 127.0.0.1, a free port."""
    proc = subprocess.Popen([str(bin_ / "prunus"), "serve", str(export), "--host", "127.0.0.1", "--port", "0",
                             "--max-batch", "1"], cwd=cwd, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        for line in proc.stderr:
            lines.append(line)
            m = re.search(r"listening on (http://\S+)", line)
            if m:
                break
        else:
            pytest.fail("the server did not start:\n" + "".join(lines))
        threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
        body = json.dumps({"model": export.name, "prompt": "def ", "max_tokens": 4, "temperature": 0}).encode()
        req = urllib.request.Request(m.group(1) + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            return line, json.loads(resp.read())
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def check_dists(wheel: Path, sdist: Path) -> None:
    """The wheel holds exactly the package's modules and data; the sdist holds every one of them too."""
    want = expected_wheel_files()
    got = {n for n in zipfile.ZipFile(wheel).namelist() if not n.startswith("prunus-")}
    assert got == want, f"missing: {sorted(want - got)}; unexpected: {sorted(got - want)}"
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    assert {w.removeprefix("prunus/") for w in want} <= names, sorted({w.removeprefix("prunus/") for w in want} - names)


@pytest.mark.slow
def test_the_wheel_trains_exports_generates_natively_and_serves_outside_the_checkout(tmp_path):
    wheel, sdist = build_dists(tmp_path / "dist")
    check_dists(wheel, sdist)
    bin_ = fresh_venv(tmp_path / "venv", wheel)
    work = tmp_path / "work"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    (tmp_path / "tmp").mkdir()  # its own TMPDIR (a server cleans what it left there), its own kernel build cache
    env.update(OMP_NUM_THREADS="1", TMPDIR=str(tmp_path / "tmp"), XDG_CACHE_HOME=str(tmp_path / "cache"))
    where = run(bin_, ["python", "-c", "import prunus; print(prunus.__file__)"], work, env).strip()
    assert Path(where).is_relative_to(tmp_path / "venv"), where
    assert "train" in run(bin_, ["prunus", "--help"], work, env)
    run(bin_, ["prunus", "train", "--preset", "tiny", "--seq-len", "32", "--batch-size", "4", "--steps", "3",
               "--warmup-steps", "1", "--eval-every", "3", "--eval-tokens", "512", "--ckpt-every", "0",
               "--max-corpus-bytes", "100000", "--out", "run"], work, env)
    run(bin_, ["prunus", "export", "run/model", "--out", "export"], work, env)
    native = native_build.unavailable() is None  # this machine runs the kernels (x86-64 with AVX2, a C compiler)
    out = run(bin_, ["prunus", "generate", "export", "--prompt", "def ", "--max-new-tokens", "4", "--temperature",
                     "0", *(["--native"] if native else [])], work, env)  # --native: refused, never fallen back
    assert out.startswith("def "), out
    line, answer = serve_once(bin_, work / "export", work, env)
    assert ("native kernels" in line) == native, line
    assert answer["choices"][0]["text"] is not None and answer["usage"]["completion_tokens"] >= 1, answer
    if native:  # an install without a header: native="auto" serves on ONNX Runtime and says why
        Path(where).parent.joinpath("native", native_build.HEADERS[0]).unlink()
        info = json.loads(run(bin_, ["python", "-c", FALLBACK, "export"], work, env).strip().splitlines()[-1])
        assert info["runtime"] != "native" and native_build.HEADERS[0] in info["native"], info


# Loads an export under native="auto" and prints what its info says runs it.
FALLBACK = """import json, sys
from prunus.serve import Engine
with Engine.load(sys.argv[1], max_batch=1) as e:
    print(json.dumps({"runtime": e.info.get("runtime"), "native": e.info.get("native")}))
"""
