"""gcpatch: gradient checkpointing that is correct by default in the Hugging Face stack.

`import gcpatch` (or GCPATCH=1 in the environment) switches it on; GCPATCH=0 switches it off.
Nothing heavy is imported here: the engine starts when a framework is first imported.
"""

from __future__ import annotations

from gcpatch.activation import activate, deactivate, is_active
from gcpatch.errors import GcpatchError

__all__ = ["GcpatchError", "activate", "deactivate", "decisions", "is_active", "__version__"]
__version__ = "0.1.0"


def decisions() -> list[dict]:  # no typing import: this module is on the start-up path
    """The decisions this process made, oldest first, as recorded."""
    from gcpatch import record

    return record.history()


activate()
