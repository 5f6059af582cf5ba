"""The type stubs of the compiled modules (pyrdma/_verbs/*.pyi, _engine.pyi, _hostcalls.pyi, _reduce.pyi).

mypy.stubtest compares them with the built modules (every public name present on both sides, the
same parameters); mypy then checks the README's verbs examples against them and finds the errors in
a wrong call; the stubs and py.typed are installed with the package.
"""
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("mypy", reason="mypy is not installed (scripts/setup.sh installs it)")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODULES = ["pyrdma._verbs." + m for m in ("base", "loader", "device", "pd", "mr", "cq", "wr", "srq", "ah", "mw", "qp", "qpex", "cm")]
MODULES += ["pyrdma._engine", "pyrdma._hostcalls", "pyrdma._reduce"]
TIMEOUT = 300


def _run(*args):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=TIMEOUT, env=env, cwd=ROOT)


def _mypy(path):
    return _run("-m", "mypy", "--no-incremental", "--cache-dir", os.devnull, str(path))


def test_stubtest_matches_the_built_modules():
    run = _run("-m", "mypy.stubtest", "--allowlist", os.path.join(ROOT, "tests", "stubtest_allowlist.txt"), *MODULES)
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"no issues found in {len(MODULES)} modules" in run.stdout


def test_readme_verbs_examples_type_check(tmp_path):
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    verbs = re.search(r"## Verbs in 20 lines.*?```python\n(.*?)```", readme, re.S).group(1)
    cm = re.search(r"```py\n(cm = rd\.CMID\(\).*?)```", readme, re.S).group(1)
    example = tmp_path / "example.py"
    cm_function = "def cm_example() -> None:\n" + "".join("    " + line + "\n" for line in cm.splitlines())
    example.write_text(verbs + "\n\n" + cm_function)
    run = _mypy(example)
    assert run.returncode == 0, run.stdout + run.stderr
    wrong = tmp_path / "wrong.py"
    wrong.write_text("import pyrdma as rd\n"
                     "ctx = rd.Context(3)\n"
                     "cq = rd.CompletionQueue(ctx, cqe='many')\n"
                     "def post(qp: rd.QueuePair) -> None:\n"
                     "    qp.post_write(1, 0)\n")
    run = _mypy(wrong)
    assert run.returncode == 1
    assert 'Argument 1 to "Context" has incompatible type "int"' in run.stdout, run.stdout
    assert 'Argument "cqe" to "CompletionQueue" has incompatible type "str"' in run.stdout
    assert 'Missing positional arguments "length", "remote_addr", "rkey" in call to "post_write"' in run.stdout


def test_stubs_are_installed_with_the_package(tmp_path):
    run = _run("setup.py", "-q", "build_py", "--build-lib", str(tmp_path))
    assert run.returncode == 0, run.stderr
    installed = {os.path.relpath(os.path.join(d, f), tmp_path) for d, _, files in os.walk(tmp_path) for f in files}
    stubs = {m.replace(".", "/") + ".pyi" for m in MODULES}
    assert stubs | {"pyrdma/py.typed"} <= installed, sorted(stubs - installed)
