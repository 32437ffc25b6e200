"""The model executor: builds each step's tensors, runs the model, samples."""
