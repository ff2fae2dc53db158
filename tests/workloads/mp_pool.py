"""multiprocessing: a Pool, a Queue, a Pipe and shared_memory, in lock step."""

import multiprocessing as mp
import sys
import time
from multiprocessing import shared_memory


def square(x: int) -> int:
    return x * x


def producer(q, conn, n: int, shm_name: str) -> None:
    shm = shared_memory.SharedMemory(name=shm_name)
    for i in range(n):
        shm.buf[i % 64] = i % 251
        q.put(("item", i, sum(shm.buf[:64])))
        conn.recv()  # lock step with the parent
    q.put(("done", n, 0))
    shm.close()


def main() -> None:
    n = int(sys.argv[1])
    shm = shared_memory.SharedMemory(create=True, size=4096)
    q = mp.Queue()
    parent, child = mp.Pipe()
    p = mp.Process(target=producer, args=(q, child, n, shm.name))
    p.start()
    total = 0
    with mp.Pool(2) as pool:
        for _ in range(n):
            _kind, i, s = q.get()
            squares = pool.map(square, range(i, i + 8))
            total += sum(squares) + s
            print(f"step {i} shm {s} squares {sum(squares)} total {total}", flush=True)
            time.sleep(0.012)
            parent.send(i)
        print(q.get(), flush=True)
    p.join()
    print("exit", p.exitcode, "total", total, flush=True)
    shm.close()
    shm.unlink()


if __name__ == "__main__":
    main()
