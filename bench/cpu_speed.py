"""How much work this machine's CPU did per CPU-second during a replay.

On the shared 2-core machine one replay of the same requests gave 1.5x different
throughput from one deployment to the next with the engines' CPU share unchanged
(docs/benchmarks.md, run 10): what differed was the output per CPU-second. `SpeedProbe`
measures that for every configuration alike. Twice a second a thread of the benchmark's
own process times a small, fixed float32 matrix product, the engines' kind of work, by
its own CPU clock: products per CPU-second of that thread. Load alone does not lower it
(a thread that waits for a core is not charged for the wait); a slower core does, or one
that the host lends to others while the guest charges it to the thread. It costs about
2% of a core.
"""

from __future__ import annotations

import statistics
import threading
import time

PRODUCTS_PER_SAMPLE = 25  # about 10 ms of one core here
INTERVAL_S = 0.5


class SpeedProbe:
    """`with SpeedProbe() as probe: ...`, then `probe.summary()`."""

    def __init__(self, interval_s: float = INTERVAL_S):
        import torch  # the engines' own library, and only where a probe runs

        self._interval_s = interval_s
        self._left = torch.randn(64, 512)
        self._right = torch.randn(512, 512)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="cpu-speed")
        self.samples: list[float] = []

    def _sample(self) -> float:
        started = time.thread_time()
        for _ in range(PRODUCTS_PER_SAMPLE):
            self._left @ self._right
        return PRODUCTS_PER_SAMPLE / max(time.thread_time() - started, 1e-9)

    def _run(self) -> None:
        import torch

        torch.set_num_threads(1)  # per thread in torch: the probe's products on one core
        while not self._stop.wait(self._interval_s):
            self.samples.append(self._sample())

    def __enter__(self) -> SpeedProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict:
        """Products per CPU-second: median and quartiles over the samples."""
        if len(self.samples) < 2:
            return {"samples": len(self.samples)}
        low, median, high = statistics.quantiles(self.samples, n=4)
        return {"samples": len(self.samples), "median": round(median),
                "p25": round(low), "p75": round(high)}
