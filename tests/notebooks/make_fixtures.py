"""Writes the fixture notebooks of this folder, one per mistake a user makes in a %%autoparallel cell.

    $ python tests/notebooks/make_fixtures.py     # from the repository root
"""

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

KERNEL = {"name": "nbtrain", "display_name": "Python (nbtrain)", "language": "python"}
SETUP = ("%load_ext nbtrain\nimport nbtrain\n"
         "config = nbtrain.GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=64, tie_embeddings=False)")
AFTER = "import psutil\nprint(\"kernel alive:\", 1 + 1, \"child processes:\", len(psutil.Process().children(recursive=True)))"
BAD_LOSS = '''def loss_failing_on_rank_1(output, targets):
    import torch.distributed as dist
    from nbtrain.profiler.model import lm_loss
    if dist.is_initialized() and dist.get_rank() == 1:
        raise ValueError("this loss fails on rank 1")
    return lm_loss(output, targets)'''
CASES = {
    "no_model": ("The cell makes no model.", "%%autoparallel --gpus 2\nx = 1"),
    "two_models": ("The cell makes two models and does not say which.",
                   "%%autoparallel --gpus 2\nencoder = nbtrain.GPT(config)\ndecoder = nbtrain.GPT(config)"),
    "bad_flag": ("A flag the magic does not have.", "%%autoparallel --gpus 2 --gpuz 4\nmodel = nbtrain.GPT(config)"),
    "nothing_fits": ("A memory budget no plan fits.",
                     "%%autoparallel --gpus 8 --memory 1MiB\nmodel = nbtrain.GPT(config)"),
    "worker_raises": ("A worker raises during the launch.",
                      "%%autoparallel --gpus 2 --batch 4 -q --launch --processes 2 --steps 2 --loss loss_failing_on_rank_1\n"
                      "model = nbtrain.GPT(config)"),
}
for name, (why, cell) in CASES.items():
    setup = SETUP + ("\n\n" + BAD_LOSS if name == "worker_raises" else "")
    error = new_code_cell(cell)
    error.metadata["tags"] = ["raises-exception"]
    nb = new_notebook(cells=[new_markdown_cell(f"# Fixture: {why}\n\nThe magic cell must end with one clear "
                                               "message; the kernel lives on and the next cell runs."),
                             new_code_cell(setup), error, new_code_cell(AFTER)],
                      metadata={"kernelspec": KERNEL, "language_info": {"name": "python"}})
    nbformat.write(nb, f"tests/notebooks/{name}.ipynb")

# A notebook written from the README alone (and the pages it links), as a new user writes one: the magic with
# --memory in the units docs/notebook.md shows, -o, --launch on their own --data, and a cell that plans a model built in an earlier cell.
README_USER = [
    "%load_ext nbtrain",
    "import torch\nimport nbtrain\nfrom transformers import GPT2Config, GPT2LMHeadModel",
    "%%autoparallel --gpus 8 --memory 24GiB --batch 16 --seq 512 -o plan\n"
    "model = GPT2LMHeadModel(GPT2Config(vocab_size=512, n_embd=64, n_layer=4, n_head=4, n_positions=512))",
    "print(plan)\nprint(plan.summary())",
    "# a list of (ids, targets) global batches, as docs/notebook.md's --data says\n"
    "g = torch.Generator().manual_seed(0)\n"
    "windows = [torch.randint(0, 256, (4, 33), generator=g) for _ in range(3)]\n"
    "batches = [(w[:, :-1], w[:, 1:]) for w in windows]",
    "%%autoparallel --gpus 2 --memory 40GiB -q --launch --processes 2 --steps 3 --data batches -o small\n"
    "small_model = nbtrain.GPT(nbtrain.GPTConfig(vocab_size=256, block_size=128, n_layer=2, n_head=4, n_embd=64,\n"
    "                                            tie_embeddings=False))",
    "print('trained on', small_result.plan.global_batch, 'rows per step; losses', "
    "[round(x, 3) for x in small_result.losses])",
    "%%autoparallel --model small_model --gpus 4 --memory '12 GiB' --batch 8 -q -o again\n"
    "# no model here: --model plans the one built above",
    "%autoparallel --model model --gpus 16 --memory 0.5TiB --batch 32 -q -o line_form",
    "print(again.num_devices, line_form.num_devices, format(line_form.predicted.budget_bytes / 2**30, '.1f'), 'GiB')",
]
cells = [new_markdown_cell("# Fixture: a notebook written from the README alone")]
cells += [new_code_cell(source) for source in README_USER]
nbformat.write(new_notebook(cells=cells, metadata={"kernelspec": KERNEL, "language_info": {"name": "python"}}),
               "tests/notebooks/readme_user.ipynb")
