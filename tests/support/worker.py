"""The last call of every torchrun worker in the test suite: ``finish()``."""

import logging
import os
import sys

import torch.distributed as dist


def finish() -> None:
    """End a worker whose results are saved: destroy the process group, then leave
    without the interpreter's teardown.

    torch 2.13 keeps a process group that a ``DistributedDataParallel`` model used, and its
    gloo threads, alive after ``destroy_process_group()`` (measured here: the three gloo
    threads are still there after ``del model``, ``gc.collect()`` and
    ``destroy_process_group()``, with or without the monitor). Gloo threads alive at
    interpreter shutdown can abort the process with "terminate called without an active
    exception" (pytorch/pytorch#190489): rarely, but enough to fail a test whose results
    are all written. Nothing of the monitor's runs at exit: each worker calls ``stop()``.
    """
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
