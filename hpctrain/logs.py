"""hpctrain's logging: `setup(rank, world_size)`, `get_logger(name)`, and `info`/`warning`/
`error`/`debug` on the "hpctrain" logger, rank-aware (rank 0 logs INFO by default, every rank
warnings; HPCTRAIN_LOG_RANKS=all or 0,3 and HPCTRAIN_LOG_LEVEL=DEBUG|INFO|WARNING|ERROR).

The implementation is data_tools/logs.py (the lower layer: data_tools never imports hpctrain), as
hpctrain/errors.py shares data_tools' UserError. Rank 0's lines are the bare message, so what a
run printed before logging is byte for byte what it logs now.
"""
from data_tools.logs import (LEVEL_VAR, RANKS_VAR, debug, error, get_logger, info,  # noqa: F401
                             setup, warning)
