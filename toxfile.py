"""tox's hook for `.ci/run`: an env that installs torch finds it in one shared base venv instead of
unpacking its own copy (about a GB, tens of seconds per env), as the matrix's release venvs do
(matrix/run.py). `.ci/run` builds the base (torch through constraints.txt) and names it in
GCPATCH_TORCH_BASE; without the variable (a plain `tox`) every env installs its own torch.

The base's site-packages reach the env through a .pth file written before the env's deps install,
so pip sees torch installed and leaves it; a package the env pins to another version is installed in
the env itself, whose site-packages come first on sys.path.
"""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path

from tox.plugin import impl

PTH = "_gcpatch_torch_base.pth"


def _base_site(base: Path) -> Path | None:
    found = sorted((base / "lib").glob("python3.*/site-packages"))
    return found[0] if found else None


@impl
def tox_on_install(tox_env, arguments, section: str, of_type: str) -> None:  # tox's own types
    base = os.environ.get("GCPATCH_TORCH_BASE", "")
    if of_type != "deps" or not base:
        return
    deps = tox_env.conf[
        "deps"
    ]  # a requirements file for a run env, a plain list for a packaging env
    lines = deps.lines() if hasattr(deps, "lines") else [str(dep) for dep in deps]
    site = _base_site(Path(base))
    env_site = Path(tox_env.env_site_package_dir())
    if site is None or site.parent.name != env_site.parent.name:  # another Python: not shareable
        return
    if shares_base_torch(lines, site):
        (env_site / PTH).write_text(f"{site}\n")


def shares_base_torch(lines: list[str], site: Path) -> bool:
    """Whether an env's deps pin the torch release the base holds: an env pinning another one
    (torch214, torch215) installs its own, with no second torch on its path."""
    specs = (line.replace(" ", "") for line in lines)
    pins = [spec[len("torch==") :] for spec in specs if spec.startswith("torch==")]
    held = [
        dist.version
        for dist in importlib.metadata.distributions(path=[str(site)])
        if (dist.metadata["Name"] or "").lower() == "torch"
    ]
    return (
        bool(pins)
        and bool(held)
        and all(pin.split("+")[0] == held[0].split("+")[0] for pin in pins)
    )
