"""The planner: pure Python (no process groups, no devices). Strategies and plans, the cost model, the search."""
