"""The notebook face: a thin layer over nbtrain's public API (magics, widgets, plots)."""
