# The README's Python example runs as written (in a scratch directory, with this build's package).
import os
import re
import subprocess
import sys

from conftest import SOURCE_DIR


def test_readme_python_example_runs(tmp_path):
    readme = (SOURCE_DIR / "README.md").read_text()
    section = readme[readme.index("## Python"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    (tmp_path / "example.py").write_text(code)
    r = subprocess.run([sys.executable, "example.py"], cwd=tmp_path, env=dict(os.environ), capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "max |kvx - numpy|" in r.stdout
    err = float(r.stdout.split("max |kvx - numpy|")[1].split()[0])
    assert err < 0.05  # q8 keys and values against exact fp64 attention
    # Run again: the training resumes from its last checkpoint instead of refusing the directory.
    r = subprocess.run([sys.executable, "example.py"], cwd=tmp_path, env=dict(os.environ), capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
