"""HotSPa's planning: sequence-length buckets (``buckets``) and a strategy per bucket with the cost of switching
between them (``bucket_search``), searched under the memory budget as Galvatron-BMW searches one static plan."""
