"""A run's state outside the workers: checkpoints and trained weights, in the model's own names.

``training_state`` holds weights and AdamW state in one layout every plan shares (so a run resumes under another
plan), ``checkpoint`` saves and loads it with ``torch.distributed.checkpoint`` (DCP) with the run's progress, and
``weights`` gathers the trained weights into the notebook or saves them sharded.
"""
