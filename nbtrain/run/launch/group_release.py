"""Process groups that outlive ``destroy_process_group``: their threads, and why a process that keeps them may abort
as it exits.

``torch.distributed.destroy_process_group()`` forgets the groups; each group's gloo threads end only when the last
Python reference to it goes. After a ``dp_shard`` fit under torchrun, the run's FSDP2 structures were still alive in
each rank (the ``FSDPMeshInfo`` of every sharded group, and four ``DeviceMesh`` objects), and every ``DeviceMesh``
holds its groups in ``_pg_registry``: a dict of process groups only, which Python's collector does not track, so no
referrer shows. Every group of the run lived on, 12 gloo threads a rank, until the process exited. (torch 2.13's
FSDP2 can also leave a module it has run uncollectable: ``fully_shard`` on each ``nn.Linear`` of an
``nn.Sequential`` and on the root, one forward, then ``del model; gc.collect()`` frees nothing.)

That is harmless in a forked worker (it leaves by ``os._exit``) but not in a process that exits normally, as under
``torchrun``: a gloo thread that drops a finished collective's last reference after the interpreter began to
finalize needs the GIL to free the collective's tensors, cannot take it, and the process aborts ("terminate called
without an active exception", SIGABRT) after training finished. A core dump of an exported job's rank showed
exactly that (``ProcessGroupGloo::runLoop`` → ``~AsyncBarrierWork`` → ``decref_pyobject`` → ``take_gil`` →
``pthread_exit``). It happened in 2 of about 9 runs of the exported two-node job on a loaded 2-core machine, and in
none of 44 with this release.

:func:`release_process_groups` drops what the run's objects still hold, once the groups are destroyed: every
``DeviceMesh``'s registry of them (this alone ended the 12 threads), and every attribute of torch.distributed's objects
that is a process group. The groups' own destructors then join their threads (torch releases the GIL while they do),
so nothing of gloo runs when the interpreter finalizes.
"""

from __future__ import annotations

import gc
import warnings


def release_process_groups() -> int:
    """Drop the references to ``torch.distributed`` process groups that objects still hold after
    ``destroy_process_group()``: ``DeviceMesh`` registries emptied, torch.distributed objects' attributes that are
    groups set to None. Returns how many references were dropped. Call it only once the groups are destroyed: what
    held them cannot use them any more.

        >>> import torch.distributed as dist
        >>> dist.is_initialized()
        False
        >>> release_process_groups() >= 0
        True
    """
    import torch.distributed as dist

    if dist.is_initialized():  # a live group is still in use: never cut it from under its users
        raise RuntimeError("release_process_groups() runs after torch.distributed.destroy_process_group()")
    from torch.distributed.device_mesh import DeviceMesh

    dropped = 0
    ours: dict[type, bool] = {}  # per class: torch.distributed's own (DeviceMesh, FSDP2's mesh infos) hold the groups
    with warnings.catch_warnings():  # touching torch's deprecated aliases (dist.reduce_op) warns
        warnings.simplefilter("ignore")
        for holder in gc.get_objects():  # the rest of a process is passed by: 0.06-0.08 s over 360,000 objects
            cls = type(holder)
            if (mine := ours.get(cls)) is None:
                module = getattr(cls, "__module__", None)
                mine = ours[cls] = isinstance(module, str) and module.startswith("torch.distributed")
            if not mine:
                continue
            try:  # one whose attribute access raises is left alone
                if isinstance(holder, DeviceMesh):
                    registry = getattr(holder, "_pg_registry", None)
                    if isinstance(registry, dict):
                        dropped += len(registry)
                        registry.clear()
                attributes = getattr(holder, "__dict__", None)
            except Exception:
                continue
            if not isinstance(attributes, dict):  # a class's is a mappingproxy: only instances' attributes
                continue
            for name, value in list(attributes.items()):
                if isinstance(value, dist.ProcessGroup):
                    attributes[name] = None
                    dropped += 1
    return dropped  # the groups went with their last reference (a registry's), joining their threads
