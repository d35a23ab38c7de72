"""nbtrain's notebook face: the ``%%autoparallel`` magic, the plan explorer, plots, notebook export.

    %load_ext nbtrain

Everything here is a thin layer over the public Python API (``nbtrain.profile``, ``plan``, ``fit``); IPython,
ipywidgets and matplotlib are imported only when a notebook feature is used.
"""
