"""Model contract (config, tensor shapes, dtype admission), the validated model file, the oracle."""
