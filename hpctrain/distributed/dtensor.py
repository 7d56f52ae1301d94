"""DTensor checks that never import DTensor: `is_dtensor(x)`.

torch.distributed.tensor (DTensor, and with it torch.fx's symbolic shapes and sympy) costs ~0.5 s
CPU per rank to import, and a plain run (one rank or DDP: no TP, FSDP, expert parallelism, DCP
load or save yet) never needs it. No DTensor can exist before that module is imported, so a check
only looks at it once something else has imported it. Must never import it itself.
"""
import sys


def is_dtensor(x) -> bool:
    """isinstance(x, DTensor), without importing torch.distributed.tensor."""
    cls = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    return cls is not None and isinstance(x, cls)
