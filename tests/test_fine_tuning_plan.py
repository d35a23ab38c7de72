"""The planner prices fine-tuning as it runs: a frozen weight is held (in the compute dtype, no fp32 master) and
gathered, but has no gradient, no optimizer state, nothing to sync, update or offload, and its matmuls compute only
their input gradient (what the profiler counts, as torch runs them). The expected values are derived by hand in
tests/test_cost_model.py and held to torch's FSDPMemTracker in tests/test_memory_oracle.py; here, the case the issue
was filed on: a LLaMA-7B shape with LoRA r=16 on q, k, v and o, one A100-80GB, batch 1 × 2048.
"""

from __future__ import annotations

import pytest

import nbtrain
from nbtrain.errors import NoFeasiblePlanError
from nbtrain.planner.search_space import SearchOptions

pytestmark = pytest.mark.slow

pytest.importorskip("peft")


@pytest.fixture(scope="module")
def profiles():
    from peft import LoraConfig, get_peft_model

    lora = get_peft_model(nbtrain.build_preset("llama-7b", device="meta"),
                          LoraConfig(r=16, target_modules=["q", "k", "v", "o"]))
    return (nbtrain.profile(lora, batch_size=1, seq_len=2048), nbtrain.profile("llama-7b", batch_size=1, seq_len=2048))


def test_lora_on_a_7b_model_plans_on_one_a100_without_offload_where_full_fine_tuning_needs_it(profiles):
    lora, full = profiles
    a100 = nbtrain.Cluster.from_catalog("A100-80GB", num_devices=1)
    best = nbtrain.plan(lora, a100, global_batch=1, seq_len=2048)
    assert best.predicted.fits and all(s.offload == 0 for s in best.layers), str(best)
    # the adapters: 4 projections × 32 blocks × r 16 × (4096 in + 4096 out) = 16.8 M trained of 6.76 B
    assert sum(layer.trained for layer in lora.layers) == 4 * 32 * 16 * (4096 + 4096)
    # LoRA's model states: 2 bytes a frozen weight, 16 an adapter parameter (bf16 weight and gradient, fp32 master
    # and two moments): 13.6 GB, where full fine-tuning holds 16 bytes a weight (108 GB) and cannot fit
    memory = best.predicted.stages[0].memory
    trained = sum(layer.trained for layer in lora.layers)
    assert memory.params + memory.grads + memory.optimizer == pytest.approx(2 * lora.params + 14 * trained, rel=1e-6)
    with pytest.raises(NoFeasiblePlanError, match="no plan fits 80.00 GiB per device on 1 × A100-80GB"):
        nbtrain.plan(full, a100, global_batch=1, seq_len=2048, options=SearchOptions(offload_levels=(0.0,)))
    assert nbtrain.plan(full, a100, global_batch=1, seq_len=2048).predicted.fits  # with its update on the CPU
