"""The garbage collector kept off what lives as long as the process.

A server process holds hundreds of thousands of objects for good once it has started (the libraries, the
model's modules, the services), and every full collection walked all of them with the interpreter stopped:
0.1-0.3 s each on the H100's host, once every few thousand requests on the HTTP front under a burst
(benchmarks/RESULTS.md). Freezing them once start-up is over (the server once it is ready, the sampling
engine's process once its model is loaded, a training rank once built) leaves the collector the objects
that requests make.
"""

import gc


def freeze_startup_objects() -> None:
    """Collect what start-up left behind, then keep every object alive now out of later collections (reference
    counting still frees them; only reference cycles among them would stay)."""
    gc.collect()
    gc.freeze()
