"""The README's Python examples run as written, on the device."""
import pathlib
import re
import subprocess
import sys

import pytest

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_examples():
    assert BLOCKS, "README.md lost its Python examples"


def _example(index, block):
    # the CuPy example needs a GPU (scripts/gpu.sh runs it), the others an RDMA device (the VM)
    return pytest.param(index, id=str(index), marks=pytest.mark.gpu if "import cupy" in block else pytest.mark.device)


@pytest.mark.parametrize("index", [_example(i, b) for i, b in enumerate(BLOCKS)])
def test_readme_example_runs(index, tmp_path):
    script = tmp_path / f"example_{index}.py"
    script.write_text(BLOCKS[index])
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    assert proc.returncode == 0, f"README example {index} failed:\n{proc.stdout}\n{proc.stderr}"
    assert proc.stdout.strip(), "the example printed nothing"
