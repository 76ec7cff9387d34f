"""Pipelines: a served name that is a DAG of stages and models over named tensors
(docs/PIPELINES.md). The broker only moves tensors between the steps; workers run them."""
