"""ChunkQueue probe: three rounds of chunks handed out by MPI fetch-and-add; rank 0 is made slow
(it sleeps per chunk) and round 2 caps what a rank may hold.  Writes OUTDIR/rank<r>.json with
the chunks each rank got per round (the test checks each chunk went to exactly one rank, the
slow rank got fewer, and the cap held).

usage: chunk_queue_probe.py OUTDIR
"""
import json
import sys
import time

from mpi4py import MPI

from data_tools.exchange import ChunkQueue

ROUNDS = [([1] * 40, 10 ** 9), ([5, 1, 1, 1, 1, 1, 1, 1] * 6, 10 ** 9), ([1] * 30, 12)]


def main():
    comm = MPI.COMM_WORLD
    queue = ChunkQueue(comm, len(ROUNDS))
    got = []
    try:
        for r, (sizes, cap) in enumerate(ROUNDS):
            mine = []
            for c in queue.claims(r, sizes, cap):
                time.sleep(0.02 if comm.Get_rank() == 0 else 0.002)  # rank 0: a slow core
                mine.append(c)
            got.append(mine)
            comm.Barrier()
    finally:
        queue.close()
    with open(f"{sys.argv[1]}/rank{comm.Get_rank()}.json", "w") as f:
        json.dump({"got": got, "sizes": [s for s, _ in ROUNDS], "caps": [c for _, c in ROUNDS]}, f)


if __name__ == "__main__":
    main()
