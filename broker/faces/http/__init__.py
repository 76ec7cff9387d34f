"""The HTTP face: KServe v2 / Open Inference Protocol and the repository extension."""
