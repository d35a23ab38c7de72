"""A run's options in groups (nbtrain.run.options): one home for each, the same for fit, Session and verify; the
flat keywords people type are the same options."""

from __future__ import annotations

import inspect

import pytest
import torch

import nbtrain
from nbtrain.errors import InvalidArgumentError
from nbtrain.run.options import SHORTHAND, Checkpointing, Evaluation, ModelFiles, Optimizer, options


def test_each_flat_keyword_sets_one_field_of_one_group_and_each_field_has_one():
    fields = {(group, field) for group, field in SHORTHAND.values()}
    assert len(fields) == len(SHORTHAND)  # one keyword a field
    assert options(lr=1e-3, checkpoint_dir="a", eval_every=2, weights="w").optimizer.lr == 1e-3
    assert options(optimizer=Optimizer(lr=1e-3)) == options(lr=1e-3)
    assert options(checkpointing=Checkpointing("a", every=5)) == options(checkpoint_dir="a", checkpoint_every=5)
    assert options(files=ModelFiles(weights="w")) == options(weights="w")


def test_an_option_given_twice_or_unknown_is_one_error_naming_it():
    with pytest.raises(InvalidArgumentError, match=r"lr= and optimizer=Optimizer\(lr=...\) both set optimizer.lr"):
        options(optimizer=Optimizer(lr=1e-3), lr=1e-4)
    with pytest.raises(InvalidArgumentError, match="unknown keyword learning_rate=0.1; did you mean lr=?"):
        options(learning_rate=0.1)
    with pytest.raises(InvalidArgumentError, match="evaluation must be an nbtrain Evaluation"):
        options(evaluation=[1, 2])


def test_fit_reads_in_one_breath_and_takes_the_groups_or_the_flat_keywords():
    named = [p for p in inspect.signature(nbtrain.fit).parameters.values() if p.kind != p.VAR_KEYWORD]
    assert len(named) <= 18  # it took 35 keywords, one flat list
    torch.manual_seed(0)
    model = nbtrain.build_preset("gpt-tiny", device="cpu")
    g = torch.Generator().manual_seed(0)
    batches = [(x, torch.roll(x, -1, 1)) for x in (torch.randint(0, 512, (2, 8), generator=g) for _ in range(2))]
    grouped = nbtrain.fit(model, batches, plan="dp_replicate=1", steps=2, num_processes=1, progress=False,
                          optimizer=Optimizer(lr=1e-2, weight_decay=0.1), evaluation=Evaluation(batches[:1]))
    torch.manual_seed(0)
    model = nbtrain.build_preset("gpt-tiny", device="cpu")
    typed = nbtrain.fit(model, batches, plan="dp_replicate=1", steps=2, num_processes=1, progress=False, lr=1e-2,
                        weight_decay=0.1, eval_data=batches[:1])
    assert grouped.losses == typed.losses and grouped.eval_loss == typed.eval_loss


def test_an_optimizer_factory_is_still_an_optimizer():
    factory = lambda groups: torch.optim.SGD(groups, lr=0.1)  # noqa: E731
    assert options(optimizer=factory).optimizer.factory is factory
