"""The executor: applies a Plan to a model with PyTorch's own distributed pieces, in processes launched by
accelerate. Reads a Plan; never searches."""
