"""A DDP communication hook shared by the integration workers that check ``unreduced``
rows under DDP (Lightning's DDPStrategy, the Hugging Face Trainer): the reference is each
parameter's local gradient as it enters the all-reduce."""

from typing import Any, Callable, Dict

import torch
import torch.distributed as dist


def clone_then_average(local: Dict[int, Dict[str, torch.Tensor]], names: Dict[int, str],
                       step_of: Callable[[], int]) -> Callable[..., Any]:
    """A hook for ``DistributedDataParallel.register_comm_hook(None, hook)``: stores
    ``local[step_of()][name]`` = a clone of each parameter's local accumulated gradient
    (``names``: parameter id -> name), then averages the bucket as DDP does."""

    # annotated as DDP checks a hook's signature (GradBucket in, a Future of the bucket out)
    def hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        step = local.setdefault(step_of(), {})
        for p, g in zip(bucket.parameters(), bucket.gradients()):
            step[names[id(p)]] = g.detach().clone()
        buffer = bucket.buffer().div_(dist.get_world_size())
        return dist.all_reduce(buffer, async_op=True).get_future().then(lambda f: f.value()[0])

    return hook
