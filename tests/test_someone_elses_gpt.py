"""Someone else's GPT, as nanoGPT's ``model.py`` builds it (``tests/nanogpt_like.py``): a ``ModuleDict`` of blocks,
the head tied by assigning ``transformer.wte.weight = lm_head.weight``, the loss computed inside ``forward(idx,
targets)``, dict batches. And a plain model tied the same way whose loss is outside: its embedding and head sit in
different pipeline stages, each stage holding a copy, as BERT's traced tie already does."""

from __future__ import annotations

import pytest

import nbtrain
from nbtrain.errors import InvalidPlanError
from nbtrain.run.verify import verify
from tests import nanogpt_like as nano


def test_nanogpt_trains_like_one_process_with_the_users_loss_that_reads_its_output():
    report = verify("tests.nanogpt_like:nano_gpt", "dp_shard=2", processes=2, steps=3, batch=4, seq=16,
                    data=nano.dict_batches(), loss_fn=nano.second_output, timeout=200)
    assert report.ok, str(report)


def test_nanogpt_trains_on_its_own_loss_without_a_loss_function_and_says_which(capsys):
    given = nbtrain.fit(nano.nano_gpt(), nano.dict_batches(steps=3), plan="dp_shard=2", steps=3, num_processes=2,
                        loss_fn=nano.second_output, progress=False)
    capsys.readouterr()
    own = nbtrain.fit(nano.nano_gpt(), nano.dict_batches(steps=3), plan="dp_shard=2", steps=3, num_processes=2,
                      progress=False)
    assert own.losses == pytest.approx(given.losses, rel=1e-6)
    assert "training on the loss the model computes in forward (output.loss, or the second element of a (logits, " \
           "loss) tuple)" in capsys.readouterr().out


def test_nanogpt_in_a_pipeline_is_refused_before_launch_naming_the_input_a_later_stage_needs():
    # its last stage computes the loss from `targets`, which the schedule hands to the first stage only
    with pytest.raises(InvalidPlanError, match="NanoGPT's forward uses its input 'targets' after the first pipeline "
                                               "stage .* return the logits and give the loss as loss_fn"):
        nbtrain.fit(nano.nano_gpt(), nano.dict_batches(), plan="pp=2 mb=2", steps=1, num_processes=2,
                    loss_fn=nano.second_output, progress=False)


@pytest.mark.parametrize("plan, processes", [("pp=2 mb=2", 2), ("pp=2 mb=2 schedule=gpipe | dp_shard=2", 4)])
def test_a_head_tied_by_assignment_sits_in_the_last_stage_and_trains_like_one_process(plan, processes):
    report = verify("tests.nanogpt_like:tied_lm", plan, processes=processes, steps=3, batch=4, seq=16, timeout=200)
    assert report.ok, str(report)


def test_the_planner_offers_pipelines_to_a_model_tied_across_traced_stages():
    from nbtrain.planner.search import search
    from nbtrain.planner.search_space import SearchOptions

    profile = nbtrain.profile(nano.tied_lm(), batch_size=1, seq_len=16)
    found = search(profile, nbtrain.Cluster.from_catalog("H100", num_devices=2), global_batch=4, seq_len=16,
                   options=SearchOptions(pp_degrees=(2,)), top=1)
    assert found and found[0].pp == 2 and found[0].layers[0] == found[0].layers[-1]
