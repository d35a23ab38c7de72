"""``check_batch``: a batch of the wrong shape, dtype or range is one line naming the step, what is wrong and what to
do; a good batch passes through untouched."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from nbtrain.errors import InvalidArgumentError
from nbtrain.run.batches import check_batch, model_vocab_size

IDS = torch.randint(0, 256, (8, 64), generator=torch.Generator().manual_seed(0))
TARGETS = torch.roll(IDS, -1, dims=1)
EXPECTED = dict(global_batch=8, seq_len=64, vocab_size=256)


def check(batch, step: int = 3, **overrides):
    return check_batch(batch, step=step, **{**EXPECTED, **overrides})


def test_a_good_batch_comes_back_as_the_same_two_tensors():
    ids, targets = check([IDS, TARGETS])
    assert ids is IDS and targets is TARGETS


@pytest.mark.parametrize("batch,kwargs", [
    ((IDS.int(), TARGETS.int()), {}),  # nn.Embedding takes int32 indices too
    ((IDS, TARGETS.masked_fill(TARGETS > 200, -100)), {}),  # -100: positions the next-token loss ignores
    ((IDS, torch.full_like(IDS, -100)), {}),
    ((IDS[:3, :10], TARGETS[:3, :10]), dict(global_batch=None, seq_len=None)),  # any shape when none is given
    ((IDS + 1000, TARGETS + 1000), dict(vocab_size=None)),  # no bound when the vocabulary is unknown
    ((IDS, torch.randn(8, 3)), dict(lm_targets=False)),  # a loss_fn of the user's own takes its own targets
])
def test_batches_the_training_can_take_pass(batch, kwargs):
    ids, targets = check(batch, **kwargs)
    assert ids is batch[0] and targets is batch[1]


@pytest.mark.parametrize("batch,kwargs,message", [
    (IDS, {}, "batch of step 3 is a Tensor; a batch is a pair (ids, targets) of tensors of shape "
              "(global_batch, seq_len) = (8, 64)"),
    ((IDS, TARGETS, TARGETS), {}, "batch of step 3 has 3 items; a batch is a pair (ids, targets)"),
    ({"input_ids": IDS, "labels": TARGETS}, {}, "batch of step 3 is a dict; a batch is a pair (ids, targets)"),
    ((IDS.tolist(), TARGETS), {}, "batch of step 3: ids is a list, not a torch.Tensor"),
    ((IDS, None), {}, "batch of step 3: targets is a NoneType, not a torch.Tensor"),
    ((IDS.float(), TARGETS), {},
     "batch of step 3: ids have dtype torch.float32; token ids must be an integer tensor (torch.long) of shape "
     "(global_batch, seq_len) = (8, 64); convert them with ids.long()"),
    ((IDS.to(torch.uint8), TARGETS), {}, "ids have dtype torch.uint8; token ids must be an integer tensor"),
    ((IDS[0], TARGETS[0]), {}, "batch of step 3: ids have shape (64); token ids are one row per sequence, of shape "
                               "(global_batch, seq_len) = (8, 64), at least 1 × 1; one sequence is ids.unsqueeze(0)"),
    ((IDS[None], TARGETS[None]), {}, "ids have shape (1, 8, 64); token ids are one row per sequence"),
    ((IDS[:, :0], TARGETS[:, :0]), dict(seq_len=None), "ids have shape (8, 0); token ids are one row per sequence, "
                                                       "of shape (global_batch, seq_len) = (8, any)"),
    ((IDS[:4], TARGETS[:4]), {}, "batch of step 3: ids have 4 rows but the plan's global batch is 8; give every step "
                                 "8 sequences, or plan for a global batch of 4"),
    ((IDS[:, :32], TARGETS[:, :32]), {}, "batch of step 3: ids have 32 tokens per row but the plan's sequence length "
                                         "is 64; give every step rows of 64 tokens"),
    ((IDS, TARGETS[:, :-1]), {}, "batch of step 3: targets have shape (8, 63) but ids (8, 64); the next-token loss "
                                 "takes one target per token"),
    ((IDS, TARGETS.float()), {}, "batch of step 3: targets have dtype torch.float32; the next-token loss takes token "
                                 "ids (torch.long)"),
    ((IDS, torch.randn(3, 5)), dict(lm_targets=False), "batch of step 3: targets have 3 rows but ids 8; give one "
                                                       "target row per sequence"),
    ((IDS, torch.tensor(1.0)), dict(lm_targets=False), "targets have a scalar but ids 8"),
    ((IDS.clone().index_fill_(1, torch.tensor([5]), 300), TARGETS), {},
     "batch of step 3: ids range from 0 to 300 but the model takes ids 0 to 255 (vocab_size=256); tokenize for this "
     "model, or build it with vocab_size ≥ 301"),
    ((IDS - 1, TARGETS), {}, "ids range from -1 to 254 but the model takes ids 0 to 255 (vocab_size=256); tokenize "
                             "for this model"),
    ((IDS, TARGETS.clone().index_fill_(0, torch.tensor([2]), 256)), {},
     "batch of step 3: targets hold 256, which is neither a token id 0 to 255 (vocab_size=256) nor -100"),
    ((IDS, TARGETS.masked_fill(TARGETS > 200, -100).index_fill_(1, torch.tensor([0]), -1)), {},
     "targets hold -1, which is neither a token id"),
])
def test_a_wrong_batch_is_one_line_that_names_the_step_the_mistake_and_the_fix(batch, kwargs, message):
    with pytest.raises(InvalidArgumentError) as error:
        check(batch, **kwargs)
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def test_the_expected_shape_names_what_is_not_known():
    with pytest.raises(InvalidArgumentError, match=r"of shape \(global_batch, seq_len\); convert"):
        check((IDS.float(), TARGETS), global_batch=None, seq_len=None)


def test_the_step_in_the_message_is_the_one_given():
    with pytest.raises(InvalidArgumentError, match="^batch of step 0: ids have 4 rows"):
        check((IDS[:4], TARGETS[:4]), step=0)


def test_a_models_vocabulary_is_the_one_the_profiler_reads():
    import nbtrain

    assert model_vocab_size(nbtrain.build_preset("gpt-tiny", device="cpu")) == 512
    assert model_vocab_size(nn.Sequential(nn.Embedding(100, 8), nn.Linear(8, 100))) == 100
    assert model_vocab_size(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))) is None
