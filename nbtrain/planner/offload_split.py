"""CoTrain's split of a model's optimizer update between the device and the CPU: which fraction of each layer to
offload, from measured per-layer times, and the step that split gives (a max-plus simulation of one step).

    >>> balanced_offload(backward_s=[1.0] * 6, cpu_update_s=[2.0] * 6, device_update_s=[0.5] * 6,
    ...                  forward_s=[0.5] * 6)   # seconds per layer; CoTrain's split: the first layers stay on the device
    [0.0, 0.0, 0.6, 1.0, 1.0, 1.0]

Backward produces gradients from the last layer to the first, and the next forward needs the weights from the first
layer to the last (CoTrain, REFERENCE.md): the last layers are offloaded, the first stay on the device. The
executor cuts each layer at the fraction chosen here (``nbtrain.run.offload.split.cut_layer``).
"""

from __future__ import annotations


def simulate_step(backward_s: list[float], cpu_update_s: list[float], device_update_s: list[float],
                  offload: list[float]) -> tuple[float, float]:
    """(device end, CPU end) in seconds after backward starts, for ``offload[i]`` of layer i's update on the CPU.

    Layer i's gradients are ready when backward has run layers L-1 … i; the CPU updates layers one at a time in that
    order, each starting when both its gradients and the CPU are ready; the device runs its share of the updates
    after backward. A fraction f of a layer costs f of its CPU time and 1 - f of its device time."""
    ready, t = [0.0] * len(backward_s), 0.0
    for i in reversed(range(len(backward_s))):
        t += backward_s[i]
        ready[i] = t
    cpu = 0.0
    for i in reversed(range(len(backward_s))):
        if offload[i] > 0:
            cpu = max(cpu, ready[i]) + offload[i] * cpu_update_s[i]
    device = ready[0] + sum((1 - f) * d for f, d in zip(offload, device_update_s))
    return device, cpu


def step_period(forward_s: list[float], backward_s: list[float], cpu_update_s: list[float],
                device_update_s: list[float], offload: list[float], steps: int = 8) -> float:
    """Seconds per step, in steady state, when each layer's CPU update lands just before its next forward (what
    ``OffloadedAdamW.from_model`` does): the CPU's queue may run on under the next forward's first layers.

    Per step: the forward of layer i starts once the device is free and, when i is offloaded, its previous update
    has landed; backward runs layers L-1 … 0; the CPU updates the offloaded layers in that order as their gradients
    arrive (as in :func:`simulate_step`); then the device updates its share. The period is read from the last
    steps, once the start-up transient is over."""
    n = len(backward_s)
    landed, device, cpu, starts = [0.0] * n, 0.0, 0.0, []
    for _ in range(steps):
        starts.append(device)
        for i in range(n):
            device = max(device, landed[i]) if offload[i] > 0 else device
            device += forward_s[i]
        ready = [0.0] * n
        for i in reversed(range(n)):
            device += backward_s[i]
            ready[i] = device
        for i in reversed(range(n)):
            if offload[i] > 0:
                cpu = max(cpu, ready[i]) + offload[i] * cpu_update_s[i]
                landed[i] = cpu
        device += sum((1 - f) * d for f, d in zip(offload, device_update_s))
    return (starts[-1] - starts[-3]) / 2  # two steps: a max-plus recurrence may alternate between two periods


def balanced_offload(backward_s: list[float], cpu_update_s: list[float], device_update_s: list[float],
                     grain: int = 10, forward_s: list[float] | None = None) -> list[float]:
    """CoTrain's split: the offload fraction per layer that ends the step soonest, from measured times.

    Candidates keep layers ``0 … k-1`` on the device, offload layers ``k+1 …`` entirely and layer ``k`` by a
    fraction in steps of ``1 / grain``; the one with the smallest step wins, so neither side waits for the other
    longer than one grain of a layer. The step is ``max(device end, CPU end)`` of :func:`simulate_step` (updates
    land at ``step()``), or with each layer's ``forward_s`` the :func:`step_period` (updates land at the next
    forward). Ties go to more offload (less device memory)."""
    n = len(backward_s)

    def time(offload):
        if forward_s is None:
            return max(simulate_step(backward_s, cpu_update_s, device_update_s, offload))
        return step_period(forward_s, backward_s, cpu_update_s, device_update_s, offload)

    best, best_time = [1.0] * n, float("inf")
    for k in range(n):  # from the most offload to the least
        for g in reversed(range(grain + 1)):
            offload = [0.0] * k + [g / grain] + [1.0] * (n - k - 1)
            t = time(offload)
            if t < best_time - 1e-12:
                best, best_time = offload, t
    return best
