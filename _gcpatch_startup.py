"""Interpreter start-up hook of gcpatch (gcpatch.pth, and gcpatch.start on Python >= 3.15).

Kept outside the gcpatch package: resolving this callable must not import gcpatch itself
when GCPATCH is unset (PEP 829 imports the module of every .start entry).
"""
import os


def bootstrap() -> None:
    """Activate gcpatch when GCPATCH asks for it. Idempotent (the .pth line can run twice in a
    venv whose lib64 links to lib) and never raises into the host."""
    if os.environ.get("GCPATCH", "").strip().lower() in ("", "0", "false", "no", "off"):
        return
    try:
        import gcpatch  # noqa: F401  (importing activates; a second import is a no-op)
    except Exception as exc:  # noqa: BLE001
        import sys

        sys.stderr.write(f"gcpatch: start-up hook failed, continuing without it ({type(exc).__name__}: {exc})\n")
