"""How the torchrun benchmarks end: ``leave(main())``."""

import logging
import os
import sys

import torch.distributed as dist


def leave(code: int) -> None:
    """Exit with ``code`` once the table is printed, skipping the interpreter's teardown.

    After the DeepSpeed and Megatron-Core benchmarks, torch 2.13 still runs the gloo
    threads of their process groups at exit, ``destroy_process_group()`` or not (measured
    with an ``atexit`` probe: 6 threads after DeepSpeed, more than 10 after Megatron-Core),
    and gloo threads alive at interpreter shutdown can abort the process with "terminate
    called without an active exception" (pytorch/pytorch#190489) after the table is out.
    """
    if dist.is_initialized():
        dist.destroy_process_group()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
