"""`hpctrain train ARGS...` as the CLI runs it, with async_diloco's arrivals watched: writes
OUTDIR/rank<r>.json with, for each round this rank ended (in order), its replica, the arrival and
digests of its weights before the arrival ("inner") and after it ("after"). Nothing is changed:
the hook wraps AsyncDiLoCo._arrive and calls it.

usage: async_hier_probe.py OUTDIR train --config CFG [overrides...]
"""
import hashlib
import json
import sys

from hpctrain.sync.async_diloco import AsyncDiLoCo
from hpctrain.sync.asynchronous import flat

OUT = sys.argv[1]
ROUNDS: list = []


def watch() -> None:
    arrive = AsyncDiLoCo._arrive

    def watched(self, last: bool = False):
        inner = hashlib.sha1(flat(self.params).tobytes()).hexdigest()
        arrive(self, last)
        ROUNDS.append({"replica": self.replica, "arrival": self.last_arrival, "inner": inner,
                       "after": hashlib.sha1(flat(self.params).tobytes()).hexdigest()})
        with open(f"{OUT}/rank{self.ctx.rank}.json", "w") as f:
            json.dump(ROUNDS, f)

    AsyncDiLoCo._arrive = watched


if __name__ == "__main__":
    from hpctrain.__main__ import exit_without_teardown, main

    watch()
    exit_without_teardown(main(sys.argv[2:]))
