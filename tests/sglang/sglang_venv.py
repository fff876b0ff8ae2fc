"""Test infrastructure: the virtual environment the SGLang tests run SGLang in (SGLang pins other versions than
vLLM, so it gets its own).

``ensure_venv()`` returns its Python, building it when missing: ``$KVPUSH_SGLANG_VENV`` if set (an existing venv
is completed in place), else ``.venv-sglang`` at the repository root. Building follows the recipe measured on a
2-core CPU host (docs/guides/sglang.md): torch ``2.13.0+cpu``, the pinned runtime dependencies of
``requirements-cpu.txt`` beside this file (a freeze of a venv that served), ``sglang==0.5.23`` and
``torchvision==0.28.0`` without their CUDA dependencies, ``uv`` when on PATH (about 7x faster than pip). Then two
CPU fixes, both test infrastructure, neither a patch of SGLang:

- the PyPI torchvision is CUDA-built, and its two ``register_fake("torchvision::nms"/"qnms")`` decorators fail
  on a CPU torch (``operator torchvision::nms does not exist``): they become no-ops;
- SGLang imports its CPU kernel package ``sgl_kernel`` unconditionally on CPU and that package is source-only:
  ``shim/sgl_kernel`` (the two functions SGLang calls here, in numpy) is copied into the venv.

Last, kvpush itself is installed editable (``--no-deps``), which registers its ``sglang.srt.plugins`` entry point.
Run ``python tests/sglang/sglang_venv.py`` to build it by hand; it prints the venv's Python.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
REQUIREMENTS = HERE / "requirements-cpu.txt"
SHIM = HERE / "shim" / "sgl_kernel"
PINS = ["torch==2.13.0+cpu"]
NO_DEPS = ["sglang==0.5.23", "torchvision==0.28.0"]
_MARK = ".kvpush-sglang-ready"
_NMS_FAKES = ('@torch.library.register_fake("torchvision::nms")', '@torch.library.register_fake("torchvision::qnms")')
_NO_OP = "@(lambda fn: fn)  # kvpush SGLang test venv: a CPU torch has no {}"


def venv_dir() -> Path:
    return Path(os.environ.get("KVPUSH_SGLANG_VENV") or REPO / ".venv-sglang")


def _python(venv: Path) -> Path:
    return venv / "bin" / "python"


def _site_packages(python: Path) -> Path:
    out = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         check=True, capture_output=True, text=True)
    return Path(out.stdout.strip())


def _fingerprint() -> str:
    digest = hashlib.sha256(REQUIREMENTS.read_bytes())
    for path in sorted(SHIM.rglob("*.py")):
        digest.update(path.read_bytes())
    digest.update(" ".join(PINS + NO_DEPS).encode())
    return digest.hexdigest()[:16]


def _install(python: Path, *args: str) -> None:
    uv = shutil.which("uv")
    command = [uv, "pip", "install", "--python", str(python), "--compile-bytecode"] if uv else \
        [str(python), "-m", "pip", "install", "-q"]
    subprocess.run([*command, *args], check=True)


def _installed(python: Path, module: str) -> bool:
    return subprocess.run([str(python), "-c", f"import importlib.util as u, sys; "
                                               f"sys.exit(u.find_spec({module!r}) is None)"]).returncode == 0


def fix_torchvision(site: Path) -> bool:
    """Turn torchvision's two CUDA-only fake registrations into no-ops; True if the file changed."""
    path = site / "torchvision" / "_meta_registrations.py"
    if not path.exists():
        return False
    text = path.read_text()
    fixed = text
    for fake in _NMS_FAKES:
        fixed = fixed.replace(fake, _NO_OP.format(fake.split('"')[1]))
    if fixed != text:
        path.write_text(fixed)
    return fixed != text


def ready() -> bool:
    """Whether the venv is built from the current recipe."""
    mark = venv_dir() / _MARK
    return mark.exists() and mark.read_text() == _fingerprint()


def ensure_venv(log: bool = True) -> Path:
    """The SGLang test venv's Python, built or completed as the module docstring says."""
    venv = venv_dir()
    python = _python(venv)
    mark = venv / _MARK
    if ready():
        return python
    if log:
        print(f"building the SGLang test venv in {venv} (a few minutes)", file=sys.stderr, flush=True)
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    if not _installed(python, "sglang"):
        _install(python, *PINS, "-r", str(REQUIREMENTS))
        _install(python, "--no-deps", *NO_DEPS)
    site = _site_packages(python)
    fix_torchvision(site)
    if not _installed(python, "sgl_kernel") or (site / "sgl_kernel").exists():
        shutil.rmtree(site / "sgl_kernel", ignore_errors=True)
        shutil.copytree(SHIM, site / "sgl_kernel", ignore=shutil.ignore_patterns("__pycache__"))
    _install(python, "--no-deps", "-e", str(REPO))
    mark.write_text(_fingerprint())
    return python


if __name__ == "__main__":
    print(ensure_venv())
