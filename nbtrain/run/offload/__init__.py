"""CoTrain: part of each layer's AdamW update runs on the CPU, overlapped with backward (REFERENCE.md, CoTrain).

``optimizer`` is ``OffloadedAdamW`` (per-layer CPU updates started from gradient hooks, landed before the next
forward needs the weights), ``split`` the cut inside a layer between device and CPU, ``state`` its state in the
layout every plan shares (checkpoints), ``ddp`` the gradient hooks for a plain data-parallel model. The fraction
offloaded per layer is chosen by the planner (``nbtrain.planner.offload_split``), never here.
"""
