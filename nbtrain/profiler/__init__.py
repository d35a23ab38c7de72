"""Measure a model (layers, FLOPs, bytes; on fake tensors) and describe the cluster it will train on."""
